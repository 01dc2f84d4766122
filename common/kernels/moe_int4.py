"""Decode MoE over int4 (W4A16, group 128) experts read in place from their pool rows: two Triton kernels.

The torch path dequantises every chosen expert to the activation dtype before its GEMVs: for top-10 of
2560×640 experts that is ~100 MB written and read again per layer to use 26 MB of int4. Here the codes are
read once, dequantised in registers and multiplied at once:

1. gate/up: program (pair p, block of I columns) computes gate and up rows of expert rows[p] against x[t]
   (t = p // k), and writes silu(gate) · up in fp32 — act [P, I].
2. down: program (pair p, block of H rows) computes act[p] · down^T and scales it by the routing weight —
   partial sums [P, H] fp32; the last of a token's k programs of a block to finish adds its k choices (and
   the shared expert) in a fixed order (arrival.py: the result does not depend on scheduling), or (several
   tokens, or arrival.ENABLED False) a third kernel does.

All-resident one-token steps run both as CUDA C instead (moe_int4_native.py, RESIDENT_CONFIGS), where the
kernels can be built: a warp's rows share the inputs in registers, which Triton's layouts could not express.

Int4 layout (common/experts/formats.py): qweight uint8 [R, out, in/2] (column 2j in the low nibble of byte j,
2j+1 in the high one), scales bf16 and zeros uint8 [R, out, in/128]; w = (q − zero) · scale. A loop step
covers GROUPS_PER_STEP groups of 128 inputs; per group Σ_j (q_j − z)·x_j = Σ_j q_j·x_j − z·Σ_j x_j, so the
zero point costs one multiply per row and group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from common.kernels import arrival, moe_int4_native
from common.kernels.arrival import arrive, sum_terms
from common.kernels.pdl import gdc_enter, launch

GROUP = 128
GROUPS_PER_STEP = 4
"""Groups of 128 inputs one loop step reads: [BLOCK rows × 4 groups × 64 bytes] per load keeps enough bytes in
flight (one group per step left the kernels at ~0.5 TB/s)."""


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the decode kernels (`moe_int4_decode`) for one token count."""

    block: int = 16
    """Output rows per program (gate_up's; down's too unless `down_block`)."""
    groups_per_step: int = GROUPS_PER_STEP
    num_warps: int = 4
    down_block: int | None = None
    """Down's own output rows per program: more rows share each load of the activations."""
    down_groups_per_step: int | None = None
    """Down's own groups a loop step (default `groups_per_step`): flashnext's down has 5 groups, which 4 a
    step cover in two steps with three groups' lanes idle."""
    down_warps: int | None = None
    """Down's own warps a program (default `num_warps`)."""
    split_act: bool = False
    """gate_up stores each group of activations evens first: down reads two contiguous runs."""
    magic: bool = False
    """Turn each code into a float by placing it in the mantissa of 2²³ (an OR and a subtraction) instead of
    an int-to-float conversion, an instruction the SMs issue at a quarter of the FMA rate."""
    words: bool = False
    """Read the codes as 32-bit words, eight codes each, taken out in place (`_words_dot`); the activations
    between the kernels stored by nibble position. Ignores `split_act` and `magic`; no host reads."""
    stages: int = 1
    """Software-pipelining stages of the loop over groups: with 2 or more, Triton copies the rows of the
    next steps into shared memory asynchronously while a step computes (with 1, each step waits a full
    memory round trip for its rows: static unrolling did not move the loads ahead, ptxas kept them
    interleaved)."""
    mma: bool = False
    """gate_up on the tensor cores (`_gate_up_mma`; needs `words`, and a `block` of 16 or more): a word's
    codes i and 4 + i become two bf16 values at once (one shift and one AND-OR on the word), their (q − z)·s
    in paired bf16 instructions, and the products an MMA of x padded to 16 rows: no reductions over K.
    Compiled for sm_90 at block 32, 4 warps (`bench.sass_census --mma --shape 32 1 4`): 357 SASS
    instructions a loop step of 2,048 weights a warp (0.17 a weight) against the words form's 0.22, ~6.4 µs
    of issue a call against 8.2, 66 registers, 200 programs in one wave. Timed on the H200
    (`bench.moe_int4_tune --mma`, bench/results/moe-int4-decode-mma.txt): 33.63 µs a call at its best shape
    (block 32, 4 warps, 3 stages) against the words form's 24.26; fewer programs, each with one load in
    flight, lost more than the instructions saved. The weights and x are rounded to bf16, as torch's
    dequantisation and activations are."""
    gate_up_stages: int | None = None
    """gate_up's own `stages` (default `stages`): the tensor cores' loop takes a group a step, 20 at
    flashnext's shape, where down keeps its one-step-a-round-trip loop."""
    gate_up_registers: int | None = None
    """A cap on gate_up's registers a thread (Triton's `maxnreg`; None: ptxas's choice). Compiled for sm_90
    (`bench.sass_census --registers`), RESIDENT_CONFIGS' one-token gate_up takes 95 registers: 5 programs of
    4 warps an SM, 660 at once against the call's 800 (10 pairs × 80 blocks), a second partial wave. At 64,
    8 an SM hold them all in one wave, for 688 SASS instructions against 616 and no spills. On the H200
    (`bench.moe_int4_tune --down --tokens 1 --registers 64`, bench/results/moe-int4-decode-registers.txt):
    24.04 µs a call against 24.24, inside the spread; the second wave is not what holds gate_up back."""
    gate_up_chunks: int = 1
    """gate_up's inputs cut into this many chunks of whole loop steps, one program each: the chunk's gate and
    up go to memory, and the last of a block's chunks to finish (arrival.py) sums them in order and applies
    SwiGLU. For the tensor-core form, whose 200 programs at one token each walk all 20 groups with one load in
    flight (moe-int4-decode-mma.txt: 33.63 µs a call against the words form's 24.26, for ~6.4 µs of issue
    against 8.2): five chunks give 1,000 programs of four steps, which at 56 registers fit the SMs in one wave
    (`bench.sass_census --mma --shape 32 1 4 --chunks 5`: ~7.7 µs of issue a call). Not used with host reads
    (each chunk would copy the whole rows). Timed on the H200 (moe-int4-decode-chunks.txt, f4c0b4f): the
    best chunked shape, tensor cores at 64 rows, 8 warps, five chunks, 24.27 µs a call against the default's
    24.94 in the same run: within the spread, so one chunk stays."""
    native_rows: int = 0
    """gate_up by the CUDA C kernel (common/kernels/moe_int4_native.py) at this many gate rows a warp (1, 2
    or 4; 0: Triton's), where it takes the call (bf16 x on Hopper, no host reads, one chunk, not `mma`);
    else Triton's."""
    native_warps: int = 4
    """The CUDA gate_up's warps a block."""
    native_mma: bool = False
    """With `native_rows`: gate_up by the CUDA C tensor-core kernel instead (moe_int4_native.gate_up's `mma`;
    ~3.4 instructions a code against ~6.8, `bench.sass_census --native`), where it takes the call (hidden up
    to 2,560). Each warp loads one group of codes ahead of the one it multiplies: with every group loaded
    before any math (one wave of 400 blocks at flashnext's shape, loads then MMAs) it measured 20.02 µs a call
    against the scalar kernel's 19.65; two groups ahead 17.74, one 16.29, none 16.91
    (`bench.moe_int4_tune --native --tokens 1`, bench/results/moe-int4-decode-native.txt). Every group
    copied to shared memory at once instead (cp.async, a commit group a group, each multiplied as it
    landed): 19.23 µs against 16.39, decode-allfit 212.16 tok/s against 227.56 (b934b6c,
    decode-allfit-native-async-ab.json; the first group lands no earlier than the rest). Nsight Compute of
    this kernel: bench/results/moe-int4-native-ncu.txt. The zero points folded in after the MMAs instead
    (codes as 128 + q, (128 + z) · Σx taken from each dot, Σx by an all-ones MMA: 1,744 instructions a warp
    against 2,168) ran 17.23 µs against 16.69 and 224.63 tok/s against 226.88 (f115b2d,
    decode-allfit-int4-fold-zero-ab.json): the kernel waits on its dependent chains, not on issue."""
    native_down_warps: int = 0
    """down (and the fold of a token's choices) by the CUDA C kernel at this many warps a block, 8 rows a warp
    (0: Triton's), where it takes the call (`words`, bf16 on Hopper, no host reads); else Triton's."""
    native_down_mma: bool = False
    """With `native_down_warps`: down on the tensor cores in CUDA C instead (moe_int4_native.down's `mma`),
    where it and the CUDA gate_up take the call: gate_up hands it the activations in bf16 in order (act
    layout 3; the other forms keep them in fp32). RESIDENT_CONFIGS' one-token default (its figures are in
    RESIDENT_CONFIGS' docstring). Its first runs, before int4_decode.cu's load_after_wait, read the
    activations before gate_up wrote them in graph replays and do not count."""


DECODE_CONFIGS = {
    1: DecodeConfig(block=8, split_act=True),
    2: DecodeConfig(block=8, groups_per_step=2, num_warps=2, split_act=True),
    8: DecodeConfig(block=16, groups_per_step=1, num_warps=2, down_block=64, magic=True),
}
"""The fastest shape per token count in `python -m bench.moe_int4_tune` on the H200
(bench/results/moe-int4-decode-tune.txt): one token 30.65 µs a call (the former default, 16 rows × 4 groups
× 4 warps: 32.73); two tokens 48.31 and four 82.65, both with the split activations (the one-token shape:
51.53 and 92.72); eight 146.8 (the former default: 172.9), and with `magic` 134.5 against 146.2 in one run
(`--magic`, bench/results/moe-int4-decode-magic.txt). One token gained nothing from `magic` (31.31 against
29.42). In a decode-1 step the one-token shape measured no faster than the former default (72.71 against
72.78 tok/s, one machine, back to back): the step's copy kernels share the SMs with it. Steps that copy
misses run these; see RESIDENT_CONFIGS for the others."""

RESIDENT_CONFIGS = {
    **DECODE_CONFIGS,
    1: DecodeConfig(
        block=8, down_block=16, down_groups_per_step=1, down_warps=2, words=True,
        native_rows=2, native_warps=2, native_down_warps=4, native_mma=True, native_down_mma=True,
    ),
}  # fmt: skip
"""The shapes of decode steps with no copies beside them (every expert resident:
OffloadedExperts.all_resident): DECODE_CONFIGS but at one token, where gate_up and down run as CUDA C
(DecodeConfig.native_rows, native_down_warps; Triton's words form below where the kernels cannot be built),
both on the tensor cores (native_mma, native_down_mma): 16.92 µs a call at 1140ea1 against 18.22 with the
scalar CUDA down and 20.16 with both scalar (`bench.moe_int4_tune --native --tokens 1`,
bench/results/moe-int4-decode-native.txt); decode-allfit 205.32 tok/s against the scalar down's 200.92
(decode-allfit-native-down-mma-ab.json). The tensor-core gate_up first ran 206.01 against the scalar
gate_up's 198.31 (+3.9 %, one process, decode-allfit-native-mma-ab.json, x read through ld.global.nc). The
scalar pair first ran decode-allfit 195.92 tok/s against Triton's 187.00 (+4.8 %; gate_up alone 193.28), in
one process (decode-allfit-native-ab.json, 611985c). Before them,
the codes read as words with down at one group a step (flashnext's 5 groups: 4 a step left three idle in the
second) measured 24.40 µs a call against 29.36 (`bench.moe_int4_tune --down`,
bench/results/moe-int4-decode-down.txt) and ran decode-allfit at 135.51 tok/s against 131.60
(decode-allfit-int4-ab.json). In decode-1, with the misses' copies beside it, the Triton words shape ran 3 %
slower (71.25 against 73.53, decode-1-int4-ab.json), and with both CUDA C kernels 0.8 % slower (92.53 against
93.29, decode-1-native-ab.json; the CUDA gate_up alone with split activations, 4.5 % slower): offloaded steps
keep DECODE_CONFIGS. Words alone measured 28.79 a call and ran decode-allfit 3 % slower; software-pipelined,
28.8-29.6 (moe-int4-decode-words.txt). At eight tokens words measured 120.6 against 134.4 a call, not yet
measured in a decode step."""


MMA_CONFIGS = {
    **RESIDENT_CONFIGS,
    1: replace(
        RESIDENT_CONFIGS[1], block=32, groups_per_step=1, num_warps=4, gate_up_stages=3, mma=True,
        native_rows=0, native_down_warps=0,
    ),
}  # fmt: skip
"""RESIDENT_CONFIGS with one token's gate_up on the tensor cores (DecodeConfig.mma), 32 rows a program at
4 warps, its loop pipelined three deep, down as the Triton words form's: the tune's best tensor-core shape,
39 % slower a call than the words form (moe-int4-decode-mma.txt); the switch `int4-mma` of
`bench.decode_offload --ablate` still runs it in a step."""


def decode_config(tokens: int, configs: dict[int, DecodeConfig] | None = None) -> DecodeConfig:
    """The measured shape of the largest token count in `configs` (default DECODE_CONFIGS) not above
    `tokens`."""
    configs = DECODE_CONFIGS if configs is None else configs
    return configs[max((n for n in configs if n <= tokens), default=1)]


@triton.jit
def _groups_dot(
    w_ptr, s_ptr, z_ptr, rows_out, g0, x_even, x_odd,
    GROUPS: tl.constexpr, GPB: tl.constexpr, HALF: tl.constexpr, MAGIC: tl.constexpr,
):  # fmt: skip
    """Σ over groups g0..g0+GPB−1 (those < GROUPS) of w[rows_out, group] · x → [BLOCK] fp32.

    x_even, x_odd [GPB, HALF]: the groups' even and odd inputs (0 past the last group)."""
    gi = g0 + tl.arange(0, GPB)  # [GPB]
    live = gi < GROUPS
    cols = gi[:, None] * HALF + tl.arange(0, HALF)[None, :]  # [GPB, HALF] byte columns
    packed = tl.load(
        w_ptr + rows_out[:, None, None] * (GROUPS * HALF) + cols[None, :, :],
        mask=live[None, :, None],
        other=0,
    )  # [BLOCK, GPB, HALF] uint8
    at = rows_out[:, None] * GROUPS + gi[None, :]  # [BLOCK, GPB]; loaded with the codes, before any math
    scale = tl.load(s_ptr + at, mask=live[None, :], other=0).to(tl.float32)
    zero = tl.load(z_ptr + at, mask=live[None, :], other=0).to(tl.float32)
    if MAGIC:  # 2²³ + q read as a float is exact: q without a conversion instruction
        word = packed.to(tl.int32)
        low = ((word & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        high = ((word >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    else:
        low = (packed & 15).to(tl.float32)
        high = (packed >> 4).to(tl.float32)
    dot = tl.sum(low * x_even[None, :, :] + high * x_odd[None, :, :], axis=2)  # [BLOCK, GPB]
    x_sum = tl.sum(x_even + x_odd, axis=1)  # [GPB]
    return tl.sum(scale * (dot - zero * x_sum[None, :]), axis=1)


@triton.jit
def _nibble_x(ptr, gi, live, m, CODE: tl.constexpr, PLACE: tl.constexpr, MAJOR: tl.constexpr):
    """The inputs code CODE of each word multiplies, for groups gi: [GPB, 16] fp32, divided by the code's
    place value PLACE. MAJOR: the vector is stored that way already (`_words_at`); else in input order, any
    dtype."""
    if MAJOR:
        return tl.load(ptr + (gi[:, None] * 8 + CODE) * 16 + m[None, :], mask=live[:, None], other=0.0)
    x = tl.load(ptr + gi[:, None] * 128 + m[None, :] * 8 + CODE, mask=live[:, None], other=0.0)
    return x.to(tl.float32) * (1.0 / PLACE)


@triton.jit
def _nibble_term(words, high, zero, x_ptr, gi, live, m, CODE: tl.constexpr, MAJOR: tl.constexpr):
    """(q − z) · x of code CODE of every word: [BLOCK, GPB, 16] fp32. The code is masked in place and ORed
    into the mantissa of 2²³: the float 2²³ + q·16^e, exact; less 2²³ + z·16^e it is (q − z)·16^e, and the
    input it multiplies comes divided by 16^e. Codes 0-4 in place (e = CODE), 5-7 from `high`, the word
    shifted right by 20 (e = CODE − 5): at bit 20 or above a code would reach the float's exponent."""
    if CODE < 5:
        bits = (words & (15 << (4 * CODE))) | 0x4B000000
        place: tl.constexpr = 16.0**CODE
    else:
        bits = (high & (15 << (4 * (CODE - 5)))) | 0x4B000000
        place: tl.constexpr = 16.0 ** (CODE - 5)
    offset = 8388608.0 + zero * place  # [BLOCK, GPB] 2²³ + z·16^e
    x = _nibble_x(x_ptr, gi, live, m, CODE, place, MAJOR)
    return (bits.to(tl.float32, bitcast=True) - offset[:, :, None]) * x[None, :, :]


@triton.jit
def _words_dot(
    w_ptr, s_ptr, z_ptr, rows_out, g0, x_ptr, GROUPS: tl.constexpr, GPB: tl.constexpr, MAJOR: tl.constexpr
):  # fmt: skip
    """Σ over groups g0..g0+GPB−1 (those < GROUPS) of w[rows_out, group] · x → [BLOCK] fp32, the codes read
    as int32 words [BLOCK, GPB, 16] (input 8·m + i in bits 4i..4i+3 of word m), each taken out in place
    (`_nibble_term`): one shift a word, no int-to-float conversion, no byte unpacking, one layout conversion
    where the byte form had four. Compiled for sm_90 (one token's shapes): gate_up 616 SASS instructions
    against the byte form's 656 (its input read as strided scalars, one a code position), down 304 against
    376."""
    gi = g0 + tl.arange(0, GPB)  # [GPB]
    live = gi < GROUPS
    m = tl.arange(0, 16)  # words of a group
    at = rows_out[:, None, None] * (GROUPS * 16) + gi[None, :, None] * 16 + m[None, None, :]
    words = tl.load(w_ptr + at, mask=live[None, :, None], other=0)  # [BLOCK, GPB, 16] int32
    at = rows_out[:, None] * GROUPS + gi[None, :]  # [BLOCK, GPB]
    scale = tl.load(s_ptr + at, mask=live[None, :], other=0).to(tl.float32)
    zero = tl.load(z_ptr + at, mask=live[None, :], other=0).to(tl.float32)
    high = words >> 20
    acc = _nibble_term(words, high, zero, x_ptr, gi, live, m, 0, MAJOR)
    for i in tl.static_range(1, 8):
        acc += _nibble_term(words, high, zero, x_ptr, gi, live, m, i, MAJOR)
    return tl.sum(scale * tl.sum(acc, axis=2), axis=1)


@triton.jit
def _words_at(n):
    """Where entry n of a vector goes stored by nibble position (`_nibble_x` MAJOR), and the factor its value
    is stored with (1 / its code's place value)."""
    g, r = n // 128, n % 128
    i, m = r % 8, r // 8
    shift = tl.where(i < 5, 4 * i, 4 * (i - 5))
    return (g * 8 + i) * 16 + m, ((127 - shift) << 23).to(tl.float32, bitcast=True)


@triton.jit
def expert_ptrs(w_ptr, s_ptr, z_ptr, row, rows_out, GROUPS: tl.constexpr, HALF: tl.constexpr):
    """Pool row `row`'s codes, scales and zeros of one matrix of `rows_out` output rows."""
    at = row * rows_out
    return w_ptr + at * (GROUPS * HALF), s_ptr + at * GROUPS, z_ptr + at * GROUPS


@triton.jit
def _load_pairs(
    ptr, g0, GROUPS: tl.constexpr, GPB: tl.constexpr, HALF: tl.constexpr, SPLIT: tl.constexpr = False
):  # fmt: skip
    """A vector's even and odd entries of groups g0..g0+GPB−1, [GPB, HALF] fp32 each (0 past the last).
    SPLIT: the vector is stored split, each group's evens then its odds (`_split_at`): two contiguous runs."""
    gi = g0 + tl.arange(0, GPB)
    live = (gi < GROUPS)[:, None]
    if SPLIT:
        at = gi[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
        even = tl.load(ptr + at, mask=live, other=0).to(tl.float32)
        odd = tl.load(ptr + at + HALF, mask=live, other=0).to(tl.float32)
    else:
        at = gi[:, None] * (2 * HALF) + 2 * tl.arange(0, HALF)[None, :]
        even = tl.load(ptr + at, mask=live, other=0).to(tl.float32)
        odd = tl.load(ptr + at + 1, mask=live, other=0).to(tl.float32)
    return even, odd


@triton.jit
def _split_at(n, HALF: tl.constexpr):
    """Where entry n of a vector goes when stored split: per group of 2·HALF, the evens then the odds."""
    j = n % (2 * HALF)
    return n - j + (j % 2) * HALF + j // 2


@triton.jit
def _pair_row(rows_ptr, row_of_ptr, p, LOOKUP: tl.constexpr):
    """Pair p's pool row: rows[p], or with LOOKUP row_of[rows[p]] (rows holds expert ids)."""
    row = tl.load(rows_ptr + p)
    if LOOKUP:
        row = tl.load(row_of_ptr + row)
    return row.to(tl.int64)


@triton.jit
def _listed(rows_ptr, fill_ptr, valid_ptr, fills, p, FILLS: tl.constexpr):
    """Pair p's expert id and whether it is a valid entry of the step's copy list ([fills] ids, valid)."""
    expert = tl.load(rows_ptr + p).to(tl.int64)
    q = tl.arange(0, FILLS)
    listed = tl.load(fill_ptr + q, mask=q < fills, other=-1)
    valid = tl.load(valid_ptr + q, mask=q < fills, other=0) != 0
    return expert, tl.max(((listed == expert) & valid).to(tl.int32), axis=0) != 0


@triton.jit
def _stage(src, dst, count, TILE: tl.constexpr):
    """dst[:count] ← src[:count] in one tile: every load in flight at once (count ≤ TILE)."""
    i = tl.arange(0, TILE)
    tl.store(dst + i, tl.load(src + i, mask=i < count), mask=i < count)


@triton.jit
def _stage_rows(
    hw_ptr, hs_ptr, hz_ptr, w, s, z, expert, rows_out, first, BLOCK: tl.constexpr, GROUPS: tl.constexpr,
    HALF: tl.constexpr, CODES: tl.constexpr, SCALES: tl.constexpr,
):  # fmt: skip
    """Copy rows first..first+BLOCK−1 of a matrix of `rows_out` rows (codes, scales, zeros) from host row
    `expert` into the pool row at w, s, z."""
    hw, hs, hz = expert_ptrs(hw_ptr, hs_ptr, hz_ptr, expert, rows_out, GROUPS, HALF)
    _stage(hw + first * (GROUPS * HALF), w + first * (GROUPS * HALF), BLOCK * GROUPS * HALF, CODES)
    _stage(hs + first * GROUPS, s + first * GROUPS, BLOCK * GROUPS, SCALES)
    _stage(hz + first * GROUPS, z + first * GROUPS, BLOCK * GROUPS, SCALES)


@triton.jit
def _code_halves(pairs, HIGH: tl.constexpr, BF16: tl.constexpr):
    """The low or high half of each int32 of `pairs` (bf16 bits of 128 + q), as 128 + q: read in place as a
    bf16, or (BF16 false: x in another dtype, and the interpreter, whose dots and arithmetic do not take
    bf16) shifted into an fp32's upper half, the same value."""
    if BF16:
        half = (pairs >> 16) if HIGH else pairs
        value = half.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        bits = ((pairs >> 16) << 16) if HIGH else (pairs << 16)
        value = bits.to(tl.float32, bitcast=True)
    return value


@triton.jit
def _mma_rows(acc, x_lo, x_hi, words, i: tl.constexpr, zero, scale, BF16: tl.constexpr):
    """acc [16, BLOCK] + x's inputs 8m + i and 8m + 4 + i [16, 16] times code i and 4 + i of each word m
    [BLOCK, 16] dequantised. OR-ed into 0x4300 (bf16 128.0, whose unit in the last place is 1) a code q reads
    as 128 + q; less 128 + z it is q − z, exact; times the scale, one rounding."""
    pairs = ((words >> (4 * i)) & 0x000F000F) | 0x43004300  # codes i and 4 + i, one AND-OR for both
    precision: tl.constexpr = "tf32" if BF16 else "ieee"  # (bf16: no effect; fp32: exact products)
    w_lo = (_code_halves(pairs, False, BF16) - zero) * scale
    acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision=precision)
    w_hi = (_code_halves(pairs, True, BF16) - zero) * scale
    return tl.dot(x_hi, tl.trans(w_hi), acc, input_precision=precision)


@triton.jit
def _gate_up_mma(
    w, s, z, n, inter, x, g_lo, GROUPS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """gate and up [BLOCK] fp32 for rows n and n + inter of the codes as words (DecodeConfig.mma) over groups
    g_lo..g_lo+CHUNK−1: one group a loop step, x's row padded to the 16 rows a dot takes (the masked rows
    read nothing). The weights in bf16 for bf16 x, else in fp32."""
    BF16: tl.constexpr = x.dtype.element_ty == tl.bfloat16
    dtype: tl.constexpr = tl.bfloat16 if BF16 else tl.float32
    r = tl.arange(0, 16)
    m = tl.arange(0, 16)  # a group's words: word m holds inputs 8m..8m+7
    one_row = r[:, None] == 0
    gate = tl.zeros((16, BLOCK), dtype=tl.float32)
    up = tl.zeros((16, BLOCK), dtype=tl.float32)
    for g in tl.range(g_lo, g_lo + CHUNK, num_stages=STAGES):
        words_g = tl.load(w + n[:, None] * (GROUPS * 16) + g * 16 + m[None, :])  # [BLOCK, 16] int32
        words_u = tl.load(w + (n + inter)[:, None] * (GROUPS * 16) + g * 16 + m[None, :])
        scale_g = tl.load(s + n * GROUPS + g).to(dtype)[:, None]
        scale_u = tl.load(s + (n + inter) * GROUPS + g).to(dtype)[:, None]
        zero_g = (tl.load(z + n * GROUPS + g).to(tl.float32) + 128.0).to(dtype)[:, None]
        zero_u = (tl.load(z + (n + inter) * GROUPS + g).to(tl.float32) + 128.0).to(dtype)[:, None]
        inputs = x + g * 128 + m[None, :] * 8 + r[:, None] * 0  # [16, 16]
        for i in tl.static_range(4):
            x_lo = tl.load(inputs + i, mask=one_row, other=0.0).to(dtype)
            x_hi = tl.load(inputs + 4 + i, mask=one_row, other=0.0).to(dtype)
            gate = _mma_rows(gate, x_lo, x_hi, words_g, i, zero_g, scale_g, BF16)
            up = _mma_rows(up, x_lo, x_hi, words_u, i, zero_u, scale_u, BF16)
    return tl.sum(gate, axis=0), tl.sum(up, axis=0)  # row 0: the others are 0


@triton.jit
def _gate_up_step(
    gate, up, w, s, z, n, inter, g0, x, GROUPS: tl.constexpr, GPB: tl.constexpr, HALF: tl.constexpr,
    MAGIC: tl.constexpr, WORDS: tl.constexpr,
):  # fmt: skip
    """gate and up [BLOCK] plus one loop step's products (groups g0..g0+GPB−1)."""
    if WORDS:
        gate += _words_dot(w, s, z, n, g0, x, GROUPS, GPB, False)
        up += _words_dot(w, s, z, n + inter, g0, x, GROUPS, GPB, False)
    else:
        x_even, x_odd = _load_pairs(x, g0, GROUPS, GPB, HALF)
        gate += _groups_dot(w, s, z, n, g0, x_even, x_odd, GROUPS, GPB, HALF, MAGIC)
        up += _groups_dot(w, s, z, n + inter, g0, x_even, x_odd, GROUPS, GPB, HALF, MAGIC)
    return gate, up


@triton.jit
def _down_step(
    w, s, z, n, g0, a, GROUPS: tl.constexpr, GPB: tl.constexpr, HALF: tl.constexpr, SPLIT: tl.constexpr,
    MAGIC: tl.constexpr, WORDS: tl.constexpr,
):  # fmt: skip
    """One loop step's products of down's rows n [BLOCK] (groups g0..g0+GPB−1)."""
    if WORDS:
        dot = _words_dot(w, s, z, n, g0, a, GROUPS, GPB, True)
    else:
        a_even, a_odd = _load_pairs(a, g0, GROUPS, GPB, HALF, SPLIT)
        dot = _groups_dot(w, s, z, n, g0, a_even, a_odd, GROUPS, GPB, HALF, MAGIC)
    return dot


@triton.jit
def _gate_up_kernel(
    x_ptr, rows_ptr, row_of_ptr, w_ptr, s_ptr, z_ptr, act_ptr, k, hidden, inter,
    hw_ptr, hs_ptr, hz_ptr, fill_ptr, valid_ptr, fills, part_ptr, count_ptr,
    GROUPS: tl.constexpr, GPB: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr, SPLIT: tl.constexpr,
    MAGIC: tl.constexpr, LOOKUP: tl.constexpr, HOST: tl.constexpr, FILLS: tl.constexpr, CODES: tl.constexpr,
    SCALES: tl.constexpr, WORDS: tl.constexpr, STAGES: tl.constexpr, SETTLED: tl.constexpr,
    MMA: tl.constexpr, CHUNKS: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    if SETTLED:  # the rows are a kernel's further back (pdl.py): their two dependent reads before the wait
        row = _pair_row(rows_ptr, row_of_ptr, p, LOOKUP)
    gdc_enter(GDC)
    t = p // k
    if not SETTLED:
        row = _pair_row(rows_ptr, row_of_ptr, p, LOOKUP)
    first = tl.program_id(1) * BLOCK
    n = first + tl.arange(0, BLOCK)  # [BLOCK] act columns (< inter: inter % BLOCK == 0)
    w, s, z = expert_ptrs(w_ptr, s_ptr, z_ptr, row, 2 * inter, GROUPS, HALF // 4 if WORDS else HALF)
    if HOST:  # a listed miss: its gate and up rows from the host into its pool row, then read as a hit's
        expert, listed = _listed(rows_ptr, fill_ptr, valid_ptr, fills, p, FILLS)
        if listed:
            _stage_rows(
                hw_ptr, hs_ptr, hz_ptr, w, s, z, expert, 2 * inter, first, BLOCK, GROUPS, HALF, CODES, SCALES
            )  # fmt: skip
            _stage_rows(
                hw_ptr, hs_ptr, hz_ptr, w, s, z, expert, 2 * inter, first + inter, BLOCK, GROUPS, HALF, CODES,
                SCALES,
            )  # fmt: skip
            tl.debug_barrier()  # the program's own writes, visible to all its threads
    x = x_ptr + t * hidden
    chunk: tl.constexpr = GROUPS // CHUNKS
    # this program's groups of inputs; all of them from a constant 0, where the loop's masks fold (616 SASS
    # instructions against 656 from program_id(2) · chunk)
    g_lo = tl.program_id(2) * chunk if CHUNKS > 1 else 0
    if MMA:
        gate, up = _gate_up_mma(w, s, z, n, inter, x, g_lo, GROUPS, chunk, BLOCK, STAGES)
    else:
        gate = tl.zeros((BLOCK,), dtype=tl.float32)
        up = tl.zeros((BLOCK,), dtype=tl.float32)
        for g0 in tl.range(g_lo, g_lo + chunk, GPB, num_stages=STAGES):
            gate, up = _gate_up_step(gate, up, w, s, z, n, inter, g0, x, GROUPS, GPB, HALF, MAGIC, WORDS)
    if CHUNKS == 1:
        _store_act(act_ptr, p, n, inter, gate, up, HALF, SPLIT, WORDS)
    else:  # this chunk's gate and up [CHUNKS, P, 2, I]; the last chunk to arrive sums them (arrival.py)
        chunk_stride = tl.num_programs(0) * 2 * inter
        at = p * (2 * inter) + n
        tl.store(part_ptr + tl.program_id(2) * chunk_stride + at, gate)
        tl.store(part_ptr + tl.program_id(2) * chunk_stride + at + inter, up)
        if arrive(count_ptr + p * tl.num_programs(1) + tl.program_id(1), CHUNKS):
            gate = sum_terms(part_ptr, at, n < inter, chunk_stride, CHUNKS)
            up = sum_terms(part_ptr, at + inter, n < inter, chunk_stride, CHUNKS)
            _store_act(act_ptr, p, n, inter, gate, up, HALF, SPLIT, WORDS)


@triton.jit
def _store_act(act_ptr, p, n, inter, gate, up, HALF: tl.constexpr, SPLIT: tl.constexpr, WORDS: tl.constexpr):
    """act[p, n] ← silu(gate) · up, in the layout down reads (by nibble position with WORDS, else split or
    in order)."""
    act = gate / (1.0 + tl.exp(-gate)) * up
    if WORDS:
        at, factor = _words_at(n)
        tl.store(act_ptr + p * inter + at, act * factor)
    else:
        tl.store(act_ptr + p * inter + (_split_at(n, HALF) if SPLIT else n), act)


@triton.jit
def _down_kernel(
    act_ptr, rows_ptr, row_of_ptr, weights_ptr, w_ptr, s_ptr, z_ptr, partial_ptr, hidden, inter,
    hw_ptr, hs_ptr, hz_ptr, fill_ptr, valid_ptr, fills,
    count_ptr, shared_ptr, gate_ptr, out_ptr, gate_stride,
    GROUPS: tl.constexpr, GPB: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr, SPLIT: tl.constexpr,
    MAGIC: tl.constexpr, LOOKUP: tl.constexpr, HOST: tl.constexpr, FILLS: tl.constexpr, CODES: tl.constexpr,
    SCALES: tl.constexpr, WORDS: tl.constexpr, STAGES: tl.constexpr, FOLD: tl.constexpr, K: tl.constexpr,
    SHARED: tl.constexpr, GATED: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    # The rows and the routing weight are never gate_up's outputs (the kernel before): read before the wait.
    row = _pair_row(rows_ptr, row_of_ptr, p, LOOKUP)
    weight = tl.load(weights_ptr + p).to(tl.float32)
    gdc_enter(GDC)
    first = tl.program_id(1) * BLOCK
    n = first + tl.arange(0, BLOCK)  # [BLOCK] output rows (< hidden)
    w, s, z = expert_ptrs(w_ptr, s_ptr, z_ptr, row, hidden, GROUPS, HALF // 4 if WORDS else HALF)
    if HOST:
        expert, listed = _listed(rows_ptr, fill_ptr, valid_ptr, fills, p, FILLS)
        if listed:
            _stage_rows(
                hw_ptr, hs_ptr, hz_ptr, w, s, z, expert, hidden, first, BLOCK, GROUPS, HALF, CODES, SCALES
            )
            tl.debug_barrier()
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    a = act_ptr + p * inter
    for g0 in tl.range(0, GROUPS, GPB, num_stages=STAGES):
        acc += _down_step(w, s, z, n, g0, a, GROUPS, GPB, HALF, SPLIT, MAGIC, WORDS)
    tl.store(partial_ptr + p * hidden + n, acc * weight)
    if FOLD:  # the token's last choice to arrive at these rows sums the choices (arrival.py)
        t = p // K
        if arrive(count_ptr + t * tl.num_programs(1) + tl.program_id(1), K):
            _sum_choices(partial_ptr, shared_ptr, gate_ptr, out_ptr, t, n, n < hidden, hidden, gate_stride, K,
                         SHARED, GATED)  # fmt: skip


@triton.jit
def _sum_choices(
    partial_ptr, shared_ptr, gate_ptr, out_ptr, t, i, live, hidden, gate_stride,
    K: tl.constexpr, SHARED: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """out[t, i] ← Σ_j partial[t·K + j, i] (+ the shared expert's output, gated), in out's dtype."""
    acc = tl.zeros(i.shape, dtype=tl.float32)
    for j in tl.static_range(K):  # the choices in order: the same sum whatever the schedule
        acc += tl.load(partial_ptr + (t * K + j) * hidden + i, mask=live, other=0.0, cache_modifier=".cg")
    if SHARED:
        shared = tl.load(shared_ptr + t * hidden + i, mask=live, other=0.0).to(tl.float32)
        if GATED:
            shared = shared * tl.sigmoid(tl.load(gate_ptr + t * gate_stride).to(tl.float32))
        acc += shared
    tl.store(out_ptr + t * hidden + i, acc.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _combine_kernel(
    partial_ptr, shared_ptr, gate_ptr, out_ptr, gate_stride, hidden,
    K: tl.constexpr, SHARED: tl.constexpr, GATED: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    gdc_enter(GDC)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    _sum_choices(
        partial_ptr, shared_ptr, gate_ptr, out_ptr, t, i, i < hidden, hidden, gate_stride, K, SHARED, GATED
    )


def _native(c: DecodeConfig, x: torch.Tensor, host: dict | None, inter: int) -> bool:
    """Whether this call's gate_up runs the CUDA C kernel (DecodeConfig.native_rows)."""
    plain = host is None and c.gate_up_chunks == 1 and not c.mma
    return (
        bool(c.native_rows)
        and plain
        and moe_int4_native.available(x, x.shape[1], inter, c.native_rows, c.native_warps)
    )


def moe_int4_decode(
    x: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    pool: dict[str, torch.Tensor],
    block: int | None = None,
    before_down: Callable[[], None] | None = None,
    groups_per_step: int | None = None,
    num_warps: int | None = None,
    before_gate_up: Callable[[], None] | None = None,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    down_block: int | None = None,
    split_act: bool | None = None,
    magic: bool | None = None,
    row_of: torch.Tensor | None = None,
    host: dict[str, torch.Tensor] | None = None,
    fills: tuple[torch.Tensor, torch.Tensor] | None = None,
    words: bool | None = None,
    stages: int | None = None,
    down_groups_per_step: int | None = None,
    down_warps: int | None = None,
    gate_up_registers: int | None = None,
    gate_up_stages: int | None = None,
    mma: bool | None = None,
    gate_up_chunks: int | None = None,
    configs: dict[int, DecodeConfig] | None = None,
    settled: bool = False,
    native_rows: int | None = None,
    native_warps: int | None = None,
    native_down_warps: int | None = None,
    native_mma: bool | None = None,
    native_down_mma: bool | None = None,
) -> torch.Tensor:
    """Σ_j weights[t, j] · SwiGLU expert at pool row rows[t, j] (x[t]) → [T, H] in x's dtype.

    x [T, H] (bf16/fp16/fp32, contiguous); rows, weights [T, k] (with `row_of` [E], rows holds expert ids and
    row_of[id] is the pool row: the kernels look it up, where a gather would be one more launch); pool: an
    int4 pool's components (`gate_up_qweight` [R, 2I, H/2], `gate_up_scales`/`gate_up_zeros` [R, 2I, H/128],
    `down_*` likewise [R, H, ...]). H and I multiples of 128. Fixed launch shapes, no host sync: a recorded
    step can hold it. `before_gate_up` and `before_down` run right before the kernels that read those matrices
    (to wait for the rows' copies). `shared` [T, H] (a shared expert's output, gated by σ(shared_gate [T, 1])
    when given) is added in the kernel that sums the choices (torch took five: the sum, the cast, the sigmoid,
    the product and the sum). `block` (output rows per program; `down_block` for down's kernel, default
    `block`), `groups_per_step` (a power of two; `down_groups_per_step`), `num_warps` (`down_warps`) and
    `split_act` (gate_up stores each group of the activations evens first, so that down reads two
    contiguous runs instead of every other entry: down is L1-bound, bench/results/moe-int4-decode-ncu.txt),
    `magic`, `words`, `stages`, `mma`, `gate_up_*`, `native_*` (DecodeConfig) are tuning knobs
    (bench/moe_int4_tune.py sweeps them on the GPU); `configs` the shape table (default DECODE_CONFIGS).
    With `block` None every knob left None takes `decode_config(T, configs)`'s; with a `block`, those left
    None take DecodeConfig's plain defaults (what the tune labels a setting by).

    `host` (the layer's host store blocks, by component, [E, ...] as the pool's rows; mapped) and `fills`
    (the step's copy list: expert ids [P] and valid [P] bool), with `row_of`: a program whose pair's expert
    is a valid entry of the list first copies its own rows of the matrix from the host into the expert's
    pool row, in one tile (every load in flight at once: read as the GEMV's loop reads, tiny scale and zero
    rows and one round trip a loop step, the link ran at 40-43 GB/s), then computes from them as a hit's
    program does. The misses are copied by the kernels that use them, which start at once: no copy launch,
    the hits computed while the misses stream in. One token's misses cross the link once (a token's experts
    are distinct); of several tokens, every pair of a missed expert copies its rows (the same bytes). On the
    H200 decode-1 steps ran slower this way than with the copies launched first (OffloadedExperts.host_reads).
    The three kernels take part in programmatic dependent launch (common/kernels/pdl.py, on by default).
    Down reads its rows (and `row_of`) and routing weights before it waits for gate_up, which never writes
    them. `settled`: rows and `row_of` are not the outputs of the kernel launched just before this call (a
    shared expert's kernels came between: the caller knows), so gate_up reads them before its wait too.
    """
    t, k = rows.shape
    given = {"block": block, "groups_per_step": groups_per_step, "num_warps": num_warps}
    given |= {"down_block": down_block, "split_act": split_act, "magic": magic, "words": words}
    given |= {"down_groups_per_step": down_groups_per_step, "down_warps": down_warps}
    given["gate_up_registers"] = gate_up_registers
    given["gate_up_stages"] = gate_up_stages
    given["mma"] = mma
    given["gate_up_chunks"] = gate_up_chunks
    given["stages"] = stages
    given |= {
        "native_rows": native_rows,
        "native_warps": native_warps,
        "native_down_warps": native_down_warps,
        "native_mma": native_mma,
        "native_down_mma": native_down_mma,
    }
    base = decode_config(t, configs) if block is None else DecodeConfig()  # a shape given: the rest plain
    c = replace(base, **{name: v for name, v in given.items() if v is not None})
    assert not c.mma or (c.words and c.block >= 16), "mma: codes as words, at least 16 rows a program"
    words = c.words and host is None  # host reads stage bytes: the byte form (and no tensor cores)
    c = replace(c, words=words, mma=c.mma and words, gate_up_chunks=c.gate_up_chunks if host is None else 1)
    hidden = x.shape[1]
    inter = pool["down_qweight"].shape[2] * 2
    native_gate_up = _native(c, x, host, inter)
    down_mma = (
        native_gate_up
        and c.native_down_mma
        and bool(c.native_down_warps)
        and moe_int4_native.down_mma_available(x, inter, shared_gate)
    )
    act_dtype = torch.bfloat16 if down_mma else torch.float32
    act = torch.empty((t * k, inter), dtype=act_dtype, device=x.device)
    partial = torch.empty((t * k, hidden), dtype=torch.float32, device=x.device)
    x, rows, weights = x.contiguous(), rows.reshape(-1).contiguous(), weights.reshape(-1).contiguous()
    pdl = launch(x.device)  # every kernel of the call: the same launch
    knobs = {"HALF": GROUP // 2, "SPLIT": c.split_act, "MAGIC": c.magic, "num_warps": c.num_warps}
    knobs |= {"WORDS": c.words, "STAGES": c.stages, **pdl}
    gate_up_knobs = {"SETTLED": settled, "MMA": c.mma, "STAGES": c.gate_up_stages or c.stages, **pdl}
    if c.gate_up_registers:
        gate_up_knobs["maxnreg"] = c.gate_up_registers
    if c.words:  # the codes as int32 words: 16 a group's row
        pool = {name: t.view(torch.int32) if name.endswith("qweight") else t for name, t in pool.items()}
    knobs["LOOKUP"] = row_of is not None
    row_of = rows if row_of is None else row_of  # (unread without LOOKUP)
    knobs["HOST"] = host is not None
    assert host is None or (fills is not None and knobs["LOOKUP"]), "host reads need the copy list and ids"
    listed, valid = fills if host is not None else (rows, rows)  # (unread without HOST)
    knobs["FILLS"] = triton.next_power_of_2(listed.numel()) if host is not None else 1
    src = host if host is not None else pool  # (unread without HOST)

    def reads(matrix: str) -> tuple:
        names = (f"{matrix}_qweight", f"{matrix}_scales", f"{matrix}_zeros")
        return (*(src[n] for n in names), listed, valid, listed.numel())

    def tiles(rows: int, groups: int) -> dict[str, int]:  # a miss program's staging tiles (HOST)
        if host is None:
            return {"CODES": 1, "SCALES": 1}  # unread: one compiled variant whatever the block
        return {
            "CODES": triton.next_power_of_2(rows * groups * GROUP // 2),
            "SCALES": triton.next_power_of_2(rows * groups),
        }

    if before_gate_up is not None:
        before_gate_up()
    groups = hidden // GROUP  # per kernel at most its groups' power of two: a step past them reads nothing
    gpb, n_chunks, blocks = (
        min(c.groups_per_step, triton.next_power_of_2(groups)),
        c.gate_up_chunks,
        inter // c.block,
    )
    assert groups % n_chunks == 0 and (n_chunks == 1 or (groups // n_chunks) % (1 if c.mma else gpb) == 0), (
        f"gate_up_chunks {n_chunks}: whole loop steps of {groups} groups"
    )
    part = act  # (unread with one chunk)
    if n_chunks > 1:
        part = torch.empty((n_chunks, t * k, 2, inter), dtype=torch.float32, device=x.device)
    counts = arrival.counters(x.device, t * k * blocks) if n_chunks > 1 else act
    if native_gate_up:
        lookup = row_of if knobs["LOOKUP"] else None
        layout = 3 if down_mma else 1 if c.words else 2 if c.split_act else 0
        mma = c.native_mma and moe_int4_native.mma_available(x, hidden, inter)
        moe_int4_native.gate_up(
            x, rows, lookup, pool, act, k, c.native_rows, c.native_warps, layout, pdl, settled, mma
        )
    else:
        _gate_up_kernel[(t * k, blocks, n_chunks)](
            x, rows, row_of, pool["gate_up_qweight"], pool["gate_up_scales"], pool["gate_up_zeros"], act, k,
            hidden, inter, *reads("gate_up"), part, counts, GROUPS=groups, GPB=gpb, BLOCK=c.block,
            CHUNKS=n_chunks, **tiles(c.block, groups), **(knobs | gate_up_knobs),
        )  # fmt: skip
    if before_down is not None:
        before_down()
    groups, down_block = inter // GROUP, c.down_block or c.block
    knobs["num_warps"] = c.down_warps or c.num_warps
    out = torch.empty_like(x)
    gated = shared_gate is not None
    shared = shared.contiguous() if shared is not None else partial
    # the shared expert, its gate and the output: read and written by whichever kernel sums the choices
    sums = (shared, shared_gate if gated else partial, out, shared_gate.stride(0) if gated else 0)
    sums_knobs = {"K": k, "SHARED": shared is not partial, "GATED": gated}
    fold = arrival.folds(t)
    warps = c.native_down_warps
    if down_mma or (
        warps and c.words and host is None and moe_int4_native.down_available(x, inter, warps, shared_gate)
    ):
        rows_a_block = moe_int4_native.MMA_DOWN_ROWS if down_mma else 8 * warps
        counts = arrival.counters(x.device, t * hidden // rows_a_block) if fold else None
        moe_int4_native.down(
            act, rows, row_of if knobs["LOOKUP"] else None, weights, pool, partial, out, k, warps, counts,
            shared if sums_knobs["SHARED"] else None, shared_gate, pdl, mma=down_mma,
        )  # fmt: skip
    else:
        blocks = hidden // down_block
        counts = arrival.counters(x.device, t * blocks) if fold else partial
        gpb = min(c.down_groups_per_step or c.groups_per_step, triton.next_power_of_2(groups))
        down = (pool["down_qweight"], pool["down_scales"], pool["down_zeros"])
        _down_kernel[(t * k, blocks)](
            act, rows, row_of, weights, *down, partial, hidden, inter, *reads("down"), counts, *sums,
            GROUPS=groups, GPB=gpb, BLOCK=down_block, FOLD=fold, **sums_knobs, **tiles(down_block, groups),
            **knobs,
        )  # fmt: skip
    if not fold:
        _combine_kernel[(t, triton.cdiv(hidden, 1024))](
            partial, *sums, hidden, BLOCK=1024, **sums_knobs, **pdl
        )
    return out
