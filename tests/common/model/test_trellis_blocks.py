"""The trellis code (common/model/trellis_blocks.py): its codebook, the incoherence transform, the bit
layout, and the Viterbi encoder's tail-biting paths and distortion. Short states (L 8 to 12) keep the
encoder fast; the benchmark measures L 16 (bench/expert_formats.py)."""

from __future__ import annotations

import pytest
import torch

from common.model.trellis_blocks import (
    TILE,
    TrellisCode,
    codebook,
    coherent,
    decode_matrix,
    decode_tiles,
    encode_matrix,
    encode_tiles,
    hadamard_block,
    incoherent,
    pack_symbols,
    unpack_symbols,
)


def test_codebook_is_standard_normal_like() -> None:
    values = codebook(16)
    assert values.shape == (1 << 16, 2)
    assert abs(values.mean()) < 0.01 and abs(values.var() - 1) < 0.02 and values.abs().max() < 3.5
    assert abs(torch.corrcoef(values.T)[0, 1]) < 0.02  # a state's two values independent


@pytest.mark.parametrize(("out", "inp"), [(64, 256), (48, 1536), (24, 768)])
def test_incoherence_is_orthonormal_and_inverts(out: int, inp: int) -> None:
    w = torch.randn(out, inp, dtype=torch.float64).float()
    v = incoherent(w)
    torch.testing.assert_close(v.norm(), w.norm(), rtol=1e-5, atol=0)  # orthonormal: norm kept
    torch.testing.assert_close(coherent(v), w, rtol=1e-5, atol=1e-5)
    assert hadamard_block(1536) == 512 and hadamard_block(24) == 8


def test_incoherence_spreads_an_outlier_channel() -> None:
    w = torch.randn(64, 1024) * 0.02
    w[:, 7] *= 50  # one input channel 50× the rest
    kurtosis = lambda m: (m.pow(4).mean() / m.pow(2).mean() ** 2).item()
    assert kurtosis(w) > 30 and kurtosis(incoherent(w)) < 3.5  # Gaussian: 3


@pytest.mark.parametrize("step_bits", [4, 5, 7, 8])
def test_symbols_pack_and_unpack(step_bits: int) -> None:
    code = TrellisCode(12, step_bits)
    symbols = torch.randint(0, 1 << step_bits, (3, code.steps))
    packed = pack_symbols(symbols, code)
    assert packed.shape == (3, code.tile_bytes) and packed.dtype == torch.uint8
    assert torch.equal(unpack_symbols(packed, code), symbols)


def test_states_follow_the_bitshift_and_bite_their_tail() -> None:
    """Decoding any symbols: s_t = ((s_{t-1} << B) | b_t) mod 2^L, s_0 from the last symbols."""
    code = TrellisCode(10, 4)
    symbols = torch.randint(0, 16, (1, code.steps))
    values = decode_tiles(symbols, code).view(code.steps, 2)
    state = 0
    for b in [*symbols[0, -3:].tolist(), *symbols[0].tolist()]:  # 3 symbols of 4 bits: 10 bits of history
        state = ((state << 4) | b) & 1023
    assert torch.equal(values[-1], codebook(10)[state])
    state = 0
    for b in [*symbols[0, -3:].tolist(), symbols[0, 0].item()]:
        state = ((state << 4) | b) & 1023
    assert torch.equal(values[0], codebook(10)[state])


@pytest.mark.parametrize("step_bits", [4, 6, 8])
def test_viterbi_beats_the_greedy_path(step_bits: int) -> None:
    """The encoder's tiles: their distortion is what decoding them gives, and below a greedy walk's (each
    step the best next state)."""
    code = TrellisCode(10, step_bits)
    x = torch.randn(16, TILE)
    mse = (decode_tiles(encode_tiles(x, code), code) - x).pow(2).mean()
    values = codebook(10)
    greedy = []
    for row in x.view(16, code.steps, 2):
        state, err = 0, 0.0
        for pair in row:
            nexts = ((state << step_bits) | torch.arange(1 << step_bits)) & 1023
            d = (values[nexts] - pair).pow(2).sum(-1)
            state, err = int(nexts[d.argmin()]), err + float(d.min())
        greedy.append(err / TILE)
    assert mse < 0.8 * torch.tensor(greedy).mean()


def test_distortion_falls_with_the_rate() -> None:
    x = torch.randn(48, TILE, generator=torch.Generator().manual_seed(0))
    mse = [
        (decode_tiles(encode_tiles(x, TrellisCode(12, b)), TrellisCode(12, b)) - x).pow(2).mean().item()
        for b in (4, 5, 6, 7, 8)
    ]
    assert mse == sorted(mse, reverse=True)
    assert mse[0] < 0.09 and mse[-1] < 0.011  # 2 and 4 bits a weight (the bounds 2^-2R: 0.0625, 0.0039)


def test_matrix_round_trip_error_and_layout() -> None:
    code = TrellisCode(10, 6)
    w = torch.randn(32, 512) * 0.03
    codes, scales = encode_matrix(w, code)
    assert codes.shape == (32, 512 * 6 // 16) and scales.shape == (32,) and scales.dtype == torch.float16
    back = decode_matrix(codes, scales, code)
    assert 0.1 < ((back - w).norm() / w.norm()).item() < 0.2
    batched = decode_matrix(torch.stack([codes, codes]), torch.stack([scales, scales]), code)
    assert torch.equal(batched[1], back)


def test_an_input_dim_off_the_tile_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        encode_matrix(torch.randn(4, 200), TrellisCode(10, 6))
