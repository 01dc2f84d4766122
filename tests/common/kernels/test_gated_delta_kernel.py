"""The fused Gated DeltaNet decode step against the torch recurrence (with the gates GatedDeltaNet forms):
outputs and the state written back in place, grouped key heads, several sequences in scattered slots."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model.qwen4_exp import delta_rule

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("heads_k", "heads_v", "dk", "dv"), [(2, 4, 16, 32), (1, 1, 32, 32), (4, 12, 32, 64)]
)
def test_fused_step_matches_torch(heads_k: int, heads_v: int, dk: int, dv: int) -> None:
    from common.kernels.gated_delta import gated_delta_step

    gen = torch.Generator().manual_seed(heads_v)
    t, slots_total = 3, 5
    qkv = torch.randn(t, 2 * heads_k * dk + heads_v * dv, generator=gen)
    a, b = torch.randn(t, heads_v, generator=gen), torch.randn(t, heads_v, generator=gen)
    a_log, dt_bias = torch.randn(heads_v, generator=gen) * 0.5, torch.randn(heads_v, generator=gen)
    state = torch.randn(slots_total, heads_v, dk, dv, generator=gen)
    slots = torch.tensor([4, 0, 2])

    q, k, v = torch.split(qkv, [heads_k * dk, heads_k * dk, heads_v * dv], dim=-1)
    q = q.view(t, heads_k, dk).repeat_interleave(heads_v // heads_k, dim=1)
    k = k.view(t, heads_k, dk).repeat_interleave(heads_v // heads_k, dim=1)
    g = -a_log.exp() * F.softplus(a + dt_bias)
    want, want_state = delta_rule.recurrent_step(
        q, k, v.view(t, heads_v, dv), g, torch.sigmoid(b), state[slots]
    )

    on = lambda x: x.to(DEVICE)
    # a and b as they come: contiguous, rows of a fused projection's output (read in place), or with
    # strided columns (copied first)
    fused = on(torch.cat([a, b, torch.zeros(t, 3)], dim=1))
    wide = on(torch.stack([a, b], dim=-1))  # [T, Hv, 2]: a and b with a column stride of 2
    gates = [
        (on(a), on(b)),
        (fused[:, :heads_v], fused[:, heads_v : 2 * heads_v]),
        (wide[..., 0], wide[..., 1]),
    ]
    for ga, gb in gates:
        got_state = on(state.clone())
        got = gated_delta_step(on(qkv), ga, gb, on(a_log), on(dt_bias), got_state, on(slots), heads_k, 16)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_state.cpu()[slots], want_state, rtol=1e-4, atol=1e-4)
        untouched = torch.tensor([1, 3])
        assert torch.equal(got_state.cpu()[untouched], state[untouched])
