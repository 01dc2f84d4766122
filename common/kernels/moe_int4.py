"""Decode MoE over int4 (W4A16, group 128) experts read in place from their pool rows: two Triton kernels.

The codes are read once, dequantised in registers and multiplied (torch dequantises every chosen expert):

1. gate/up: program (pair p, block of I columns) → silu(gate) · up of expert rows[p] on x[p // k], [P, I].
2. down: program (pair p, block of H rows) → act[p] · downᵀ × routing weight, [P, H] fp32; the last of a
   token's k programs of a block adds its choices (and the shared expert) in a fixed order (arrival.py), or
   (several tokens, or KernelConfig.fold_sums False) a third kernel does.

All-resident one-token steps run both as CUDA C where built (moe_int4_native.py). Layout
(common/experts/formats.py): qweight uint8 [R, out, in/2] (column 2j in byte j's low nibble, 2j+1 in its
high one), scales bf16 and zeros uint8 [R, out, in/128]; w = (q − zero) · scale. Per group
Σ_j (q_j − z)·x_j = Σ_j q_j·x_j − z·Σ_j x_j: the zero point is one multiply a row and group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from common.kernels import arrival, moe_int4_native
from common.kernels.arrival import arrive
from common.kernels.config import KERNELS, DecodeConfig, KernelConfig
from common.kernels.pdl import gdc_enter, launch

GROUP = 128


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
        place: tl.constexpr = 16.0 ** (CODE - 5)  # type: ignore[no-redef]  # Triton: a constexpr per branch
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
    where the byte form had four."""
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
    GROUPS: tl.constexpr, GPB: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr, SPLIT: tl.constexpr,
    MAGIC: tl.constexpr, LOOKUP: tl.constexpr, WORDS: tl.constexpr, STAGES: tl.constexpr,
    SETTLED: tl.constexpr, GDC: tl.constexpr,
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
    x = x_ptr + t * hidden
    gate = tl.zeros((BLOCK,), dtype=tl.float32)
    up = tl.zeros((BLOCK,), dtype=tl.float32)
    for g0 in tl.range(0, GROUPS, GPB, num_stages=STAGES):
        gate, up = _gate_up_step(gate, up, w, s, z, n, inter, g0, x, GROUPS, GPB, HALF, MAGIC, WORDS)
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
    count_ptr, shared_ptr, gate_ptr, out_ptr, gate_stride,
    GROUPS: tl.constexpr, GPB: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr, SPLIT: tl.constexpr,
    MAGIC: tl.constexpr, LOOKUP: tl.constexpr, WORDS: tl.constexpr, STAGES: tl.constexpr, FOLD: tl.constexpr,
    K: tl.constexpr,
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


def _native(c: DecodeConfig, x: torch.Tensor, inter: int) -> bool:
    """Whether this call's gate_up runs the CUDA C kernel (DecodeConfig.native_rows)."""
    return bool(c.native_rows) and moe_int4_native.available(
        x, x.shape[1], inter, c.native_rows, c.native_warps
    )


def moe_int4_decode(
    x: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    pool: dict[str, torch.Tensor],
    *,
    config: DecodeConfig,
    kernels: KernelConfig = KERNELS,
    row_of: torch.Tensor | None = None,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    before_gate_up: Callable[[], None] | None = None,
    before_down: Callable[[], None] | None = None,
    settled: bool = False,
) -> torch.Tensor:
    """Σ_j weights[t, j] · SwiGLU expert at pool row rows[t, j] (x[t]) → [T, H] in x's dtype.

    x [T, H] (bf16/fp16/fp32, contiguous); rows, weights [T, k] (with `row_of` [E], rows holds expert ids and
    row_of[id] is the pool row: the kernels look it up, where a gather would be one more launch); pool: an
    int4 pool's components (`gate_up_qweight` [R, 2I, H/2], `gate_up_scales`/`gate_up_zeros` [R, 2I, H/128],
    `down_*` likewise [R, H, ...]). H and I multiples of 128. `config`: the launch shape (`decode_config`);
    `kernels`: the launch options. Fixed launch shapes, no host sync: graph-safe. `before_gate_up` and
    `before_down` run right before the kernels that read those matrices (to wait for the rows' copies).
    `shared` [T, H] (gated by σ(shared_gate [T, 1]) when given) is added where the choices are summed.
    `settled`: rows and `row_of` are not the previous kernel's outputs, so gate_up reads them before its
    programmatic wait too (down always does).
    """
    t, k = rows.shape
    c = config
    hidden = x.shape[1]
    inter = pool["down_qweight"].shape[2] * 2
    native_gate_up = _native(c, x, inter)
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
    pdl = launch(x.device, kernels=kernels)  # every kernel of the call: the same launch
    knobs: dict[str, object] = {"HALF": GROUP // 2, "SPLIT": c.split_act, "MAGIC": c.magic}
    knobs |= {"num_warps": c.num_warps, "WORDS": c.words, "STAGES": c.stages, **pdl}
    gate_up_knobs = {"SETTLED": settled, "STAGES": c.gate_up_stages or c.stages, **pdl}
    if c.words:  # the codes as int32 words: 16 a group's row
        pool = {name: t.view(torch.int32) if name.endswith("qweight") else t for name, t in pool.items()}
    knobs["LOOKUP"] = row_of is not None
    row_of = rows if row_of is None else row_of  # (unread without LOOKUP)
    if before_gate_up is not None:
        before_gate_up()
    groups = hidden // GROUP  # per kernel at most its groups' power of two: a step past them reads nothing
    gpb, blocks = min(c.groups_per_step, triton.next_power_of_2(groups)), inter // c.block
    if native_gate_up:
        lookup = row_of if knobs["LOOKUP"] else None
        layout = 3 if down_mma else 1 if c.words else 2 if c.split_act else 0
        mma = c.native_mma and moe_int4_native.mma_available(x, hidden, inter)
        moe_int4_native.gate_up(
            x, rows, lookup, pool, act, k, c.native_rows, c.native_warps, layout, pdl, settled, mma
        )
    else:
        _gate_up_kernel[(t * k, blocks)](
            x, rows, row_of, pool["gate_up_qweight"], pool["gate_up_scales"], pool["gate_up_zeros"], act, k,
            hidden, inter, GROUPS=groups, GPB=gpb, BLOCK=c.block, **(knobs | gate_up_knobs),
        )  # fmt: skip
    if before_down is not None:
        before_down()
    groups, down_block = inter // GROUP, c.down_block or c.block
    knobs["num_warps"] = c.down_warps or c.num_warps
    out = torch.empty_like(x)
    gated = shared_gate is not None
    shared = shared.contiguous() if shared is not None else partial
    # the shared expert, its gate and the output: read and written by whichever kernel sums the choices
    gate_stride = shared_gate.stride(0) if shared_gate is not None else 0
    sums = (shared, shared_gate if gated else partial, out, gate_stride)
    sums_knobs = {"K": k, "SHARED": shared is not partial, "GATED": gated}
    fold = arrival.folds(t, kernels)
    warps = c.native_down_warps
    if down_mma or (warps and c.words and moe_int4_native.down_available(x, inter, warps, shared_gate)):
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
            act, rows, row_of, weights, *down, partial, hidden, inter, counts, *sums,
            GROUPS=groups, GPB=gpb, BLOCK=down_block, FOLD=fold, **sums_knobs, **knobs,
        )  # fmt: skip
    if not fold:
        _combine_kernel[(t, triton.cdiv(hidden, 1024))](
            partial, *sums, hidden, BLOCK=1024, **sums_knobs, **pdl
        )
    return out
