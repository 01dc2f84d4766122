"""Trellis-coded weights: a bitshift trellis with a computed Gaussian codebook after a randomized Hadamard
transform (QTIP's scheme, as EXL3 uses it; written from the papers' descriptions).

A matrix [out, in] is coded in tiles of TILE inputs of one row. Step t of N = TILE / 2 emits two weights
from an L-bit state, s_t = ((s_{t−1} << B) | b_t) mod 2^L: B / 2 bits a weight. Tail-biting: s_t is bits
[(t+1)·B − L, (t+1)·B) of the tile's circular bit string, most significant first. `codebook(s)`: two
multiply-add hashes of the state, each hash's four bytes summed (Irwin-Hall ≈ N(0, 1)).

Incoherence: w̃ = H_out S_out w S_in H_in (orthonormal block Hadamard, blocks the largest power of two
dividing the dim; random signs from a seed per dim), each row over its rms (an fp16 scale). `decode_matrix`
inverts both, returning w. Encoding: Viterbi over the 2^L states, twice (the second pass held to the
first's tail-biting overlap), vectorised over tiles in torch on any device.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

TILE = 128
"""Weights a tile (one row's consecutive inputs)."""
HADAMARD_MAX = 4096
_HASH = ((0x9E3779B1, 0x7F4A7C15), (0x85EBCA77, 0xC2B2AE3D))
"""(multiplier, increment) of the codebook's two hashes a state."""
_IRWIN_HALL_MEAN = 4 * 127.5
_IRWIN_HALL_STD = math.sqrt(4 * (256**2 - 1) / 12)


@dataclass(frozen=True)
class TrellisCode:
    """One trellis code: `state_bits` L, `step_bits` B (two weights a step: B / 2 bits a weight)."""

    state_bits: int = 16
    step_bits: int = 6

    def __post_init__(self) -> None:
        if not 2 <= self.step_bits < self.state_bits <= 24:
            raise ValueError(f"need 2 <= step_bits < state_bits <= 24, got {self}")

    @property
    def bits_per_weight(self) -> float:
        return self.step_bits / 2

    @property
    def steps(self) -> int:
        return TILE // 2

    @property
    def tile_bytes(self) -> int:
        return self.steps * self.step_bits // 8


@functools.cache
def codebook(state_bits: int, device: str = "cpu") -> torch.Tensor:
    """The values of every state: [2^L, 2] fp32, each ~N(0, 1) (mean 0, variance 1, |v| < 3.46)."""
    s = torch.arange(1 << state_bits, dtype=torch.int64, device=device)
    values = []
    for mul, add in _HASH:
        h = (s * mul + add) & 0xFFFFFFFF
        byte_sum = torch.stack([(h >> shift) & 0xFF for shift in (0, 8, 16, 24)]).sum(0)
        values.append((byte_sum.float() - _IRWIN_HALL_MEAN) / _IRWIN_HALL_STD)
    return torch.stack(values, dim=-1)


# --- incoherence ----------------------------------------------------------------------------------------


def hadamard_block(dim: int) -> int:
    """The Hadamard block size for a dim: its largest power-of-two divisor, at most HADAMARD_MAX."""
    return min(dim & -dim, HADAMARD_MAX)


@functools.cache
def _hadamard(n: int, device: str) -> torch.Tensor:
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(n)


@functools.cache
def _signs(dim: int, side: str, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(dim * 2 + (side == "out"))
    return (torch.randint(0, 2, (dim,), generator=g) * 2 - 1).float().to(device)


def rotate(w: torch.Tensor, side: str, inverse: bool = False) -> torch.Tensor:
    """w [..., dim] times S H (forward: columns mixed) on its last dim, or its inverse (H S); fp32."""
    dim = w.shape[-1]
    n, dev = hadamard_block(dim), str(w.device)
    h, s = _hadamard(n, dev), _signs(dim, side, dev)
    w = w.float()
    if not inverse:
        w = w * s
    w = (w.reshape(*w.shape[:-1], dim // n, n) @ h).reshape(w.shape)  # H symmetric: its own transpose
    return w * s if inverse else w


def incoherent(w: torch.Tensor) -> torch.Tensor:
    """w [..., out, in] -> H_out S_out w S_in H_in (fp32)."""
    return rotate(rotate(w, "in").transpose(-1, -2), "out").transpose(-1, -2)


def coherent(w: torch.Tensor) -> torch.Tensor:
    """The inverse of `incoherent`."""
    return rotate(rotate(w, "in", inverse=True).transpose(-1, -2), "out", inverse=True).transpose(-1, -2)


# --- coding ---------------------------------------------------------------------------------------------


def _viterbi(x: torch.Tensor, code: TrellisCode, overlap: torch.Tensor | None) -> torch.Tensor:
    """Best state sequences [R, N] (int64) for targets x [R, N, 2]; `overlap` [R]: the start state's high
    L − B bits and the end state's low L − B bits must equal it (tail-biting), else free."""
    r, n = x.shape[:2]
    big, low = 1 << code.state_bits, 1 << (code.state_bits - code.step_bits)
    c0, c1 = codebook(code.state_bits, str(x.device)).unbind(-1)  # [S] each
    states = torch.arange(big, device=x.device)

    def distortion(t: int) -> torch.Tensor:  # [R, S]
        return (x[:, t, 0, None] - c0).square_() + (x[:, t, 1, None] - c1).square_()

    cost = distortion(0)
    if overlap is not None:
        cost = cost.masked_fill((states[None] >> code.step_bits) != overlap[:, None], math.inf)
    back = torch.empty(r, n, low, dtype=torch.int16 if code.step_bits < 16 else torch.int32, device=x.device)
    for t in range(1, n):
        best, arg = cost.view(r, 1 << code.step_bits, low).min(dim=1)  # over each successor's predecessors
        back[:, t] = arg.to(back.dtype)
        cost = best.repeat_interleave(1 << code.step_bits, dim=1) + distortion(t)
    if overlap is not None:
        cost = cost.masked_fill((states[None] & (low - 1)) != overlap[:, None], math.inf)
    path = torch.empty(r, n, dtype=torch.int64, device=x.device)
    path[:, -1] = cost.argmin(dim=1)
    for t in range(n - 1, 0, -1):
        j = path[:, t] >> code.step_bits  # the predecessor's low bits
        high = back[:, t].gather(1, j[:, None])[:, 0].long()
        path[:, t - 1] = (high << (code.state_bits - code.step_bits)) | j
    return path


def encode_tiles(x: torch.Tensor, code: TrellisCode, chunk: int = 256) -> torch.Tensor:
    """Targets x [R, TILE] (~N(0, 1)) -> each tile's symbols [R, N] (int64, B bits each), tail-biting;
    `chunk` tiles at a time (memory ~ chunk · 2^L · 12 bytes)."""
    x = x.float().view(x.shape[0], code.steps, 2)
    low = (1 << (code.state_bits - code.step_bits)) - 1
    out = []
    for part in x.split(chunk):
        first = _viterbi(part, code, None)
        overlap = first[:, -1] & low  # the end state's low bits, which the start state must begin with
        out.append(_viterbi(part, code, overlap) & ((1 << code.step_bits) - 1))
    return torch.cat(out)


def _state_bit_index(code: TrellisCode) -> torch.Tensor:
    """[N, L] positions in the circular bit string of each state's bits, most significant first."""
    total = code.steps * code.step_bits
    ends = (torch.arange(code.steps) + 1) * code.step_bits
    return (ends[:, None] - code.state_bits + torch.arange(code.state_bits)[None]) % total


def decode_tiles(symbols: torch.Tensor, code: TrellisCode) -> torch.Tensor:
    """Symbols [R, N] -> the tiles' values [R, TILE] (fp32)."""
    shifts = torch.arange(code.step_bits - 1, -1, -1, device=symbols.device)
    bits = ((symbols[..., None] >> shifts) & 1).flatten(1)  # [R, N·B], most significant first
    index = _state_bit_index(code).to(symbols.device)
    weights = 1 << torch.arange(code.state_bits - 1, -1, -1, device=symbols.device)
    states = (bits[:, index] * weights).sum(-1)  # [R, N]
    return codebook(code.state_bits, str(symbols.device))[states].flatten(1)


def pack_symbols(symbols: torch.Tensor, code: TrellisCode) -> torch.Tensor:
    """[R, N] B-bit symbols -> uint8 [R, N·B/8], the bit string most significant bit first."""
    shifts = torch.arange(code.step_bits - 1, -1, -1, device=symbols.device)
    bits = ((symbols[..., None] >> shifts) & 1).flatten(1).view(symbols.shape[0], -1, 8)
    return (bits << torch.arange(7, -1, -1, device=symbols.device)).sum(-1).to(torch.uint8)


def unpack_symbols(packed: torch.Tensor, code: TrellisCode) -> torch.Tensor:
    """The inverse of `pack_symbols`."""
    shifts = torch.arange(7, -1, -1, device=packed.device)
    bits = ((packed.long()[..., None] >> shifts) & 1).flatten(-2).view(*packed.shape[:-1], code.steps, -1)
    return (bits << torch.arange(code.step_bits - 1, -1, -1, device=packed.device)).sum(-1)


def encode_matrix(w: torch.Tensor, code: TrellisCode) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (in a multiple of TILE) -> (codes uint8 [out, in·B/16], row scales fp16 [out])."""
    out, inp = w.shape
    if inp % TILE:
        raise ValueError(f"trellis codes need an input dim that is a multiple of {TILE}, got {inp}")
    v = incoherent(w)
    scale = v.pow(2).mean(dim=1).sqrt().clamp(min=1e-30).half()
    x = (v / scale.float()[:, None]).reshape(-1, TILE)
    codes = pack_symbols(encode_tiles(x, code), code)  # [out · in / TILE, tile bytes]
    return codes.view(out, -1), scale


def decode_matrix(codes: torch.Tensor, scale: torch.Tensor, code: TrellisCode) -> torch.Tensor:
    """(codes [..., out, in·B/16], scales [..., out]) -> w [..., out, in] (fp32)."""
    *lead, out, nbytes = codes.shape
    inp = nbytes // code.tile_bytes * TILE
    tiles = decode_tiles(unpack_symbols(codes.reshape(-1, code.tile_bytes), code), code)
    return coherent(tiles.view(*lead, out, inp) * scale.float()[..., None])
