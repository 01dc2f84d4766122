"""The one-kernel Gated DeltaNet decode step (common/kernels/gdn_step.py) against the three kernels it folds
(conv_step, gated_delta_step, gated_rms_norm, each tested against torch): outputs, the conv histories and the
recurrent states written back in place, over two steps in a row (the arrival counters back at zero), grouped
key heads split into value blocks, inputs as strided views of a fused projection, scattered slots."""

from __future__ import annotations

import pytest
import torch

from common.kernels.causal_conv import conv_step
from common.kernels.gated_delta import gated_delta_step
from common.kernels.gated_norm import gated_rms_norm
from common.kernels.gdn_step import gdn_step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("heads_k", "heads_v", "dk", "dv", "block_v"),
    [(2, 4, 16, 32, 16), (1, 1, 32, 32, 32), (4, 12, 16, 64, 16)],
)
def test_one_kernel_matches_the_three(heads_k: int, heads_v: int, dk: int, dv: int, block_v: int) -> None:
    gen = torch.Generator().manual_seed(heads_v + block_v)
    t, slots_total, taps = 3, 5, 4
    channels, value = 2 * heads_k * dk + heads_v * dv, heads_v * dv
    on = lambda x: x.to(DEVICE)
    history = on(torch.randn(slots_total, channels, taps - 1, generator=gen))
    weight = on(torch.randn(channels, taps, generator=gen) * 0.5)
    a_log, dt_bias = on(torch.randn(heads_v, generator=gen) * 0.5), on(torch.randn(heads_v, generator=gen))
    state = on(torch.randn(slots_total, heads_v, dk, dv, generator=gen))
    norm_weight = on(torch.randn(dv, generator=gen))
    slots = on(torch.tensor([4, 0, 2]))
    mine = (history.clone(), state.clone())
    theirs = (history.clone(), state.clone())
    for _ in range(2):
        # one fused projection's output [T, qkv | z | b | a | pad], the inputs its strided column views
        fused = on(torch.randn(t, channels + value + 2 * heads_v + 3, generator=gen))
        qkv, z = fused[:, :channels], fused[:, channels : channels + value]
        b, a = fused[:, channels + value :][:, :heads_v], fused[:, channels + value + heads_v :][:, :heads_v]
        conv = conv_step(qkv.contiguous(), theirs[0], slots, weight, silu=True)
        core = gated_delta_step(conv, a, b, a_log, dt_bias, theirs[1], slots, heads_k, block_v)
        want = gated_rms_norm(core, z, norm_weight, 1e-6, torch.float32)
        got = gdn_step(
            qkv, mine[0], weight, a, b, a_log, dt_bias, mine[1], slots, heads_k, z, norm_weight, 1e-6,
            torch.float32, block_v,
        )  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(mine[0], theirs[0])  # the histories: copies, shifted alike
        torch.testing.assert_close(mine[1], theirs[1], rtol=1e-5, atol=1e-5)
    untouched = torch.tensor([1, 3], device=DEVICE)
    assert torch.equal(mine[0][untouched], history[untouched])
    assert torch.equal(mine[1][untouched], state[untouched])


def test_history_must_fit_the_conv() -> None:
    with pytest.raises(ValueError, match="history"):
        gdn_step(
            torch.zeros(1, 8), torch.zeros(2, 8, 2), torch.zeros(8, 4), torch.zeros(1, 1), torch.zeros(1, 1),
            torch.zeros(1), torch.zeros(1), torch.zeros(2, 1, 2, 4), torch.zeros(1, dtype=torch.long), 1,
            torch.zeros(1, 4), torch.zeros(4), 1e-6, torch.float32,
        )  # fmt: skip
