"""The kernels' configuration: which kernel forms and launch options the decode and prefill passes use.

One frozen `KernelConfig`, chosen when a worker builds its model (WorkerConfig.kernels) and handed to the
modules and kernel functions that read it; its defaults are the benchmarks' choices, and benchmarks build
variants of it (`dataclasses.replace`). It imports nothing: the kernels and the model both read it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

MOE_DOWN_TOKENS = 8192
"""Tokens a grouped int4 down projection takes at once (`moe_int4_grouped`): its per-(token, choice) output
rows, [tokens × top-k, H] in the model dtype, are the largest buffer of a
prefill MoE, so a layer-major group's MoE (every chunk's tokens at once) runs gate/up over all of them and
down in slices of this many."""
GROUPS_PER_STEP = 4
"""Groups of 128 inputs one loop step of the int4 decode kernels reads: [BLOCK rows × 4 groups × 64 bytes]
per load keeps enough bytes in flight."""


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
    between the kernels stored by nibble position. Ignores `split_act` and `magic`."""
    stages: int = 1
    """Software-pipelining stages of the loop over groups: with 2 or more, Triton copies the rows of the
    next steps into shared memory asynchronously while a step computes (with 1, each step waits a full
    memory round trip for its rows: static unrolling did not move the loads ahead, ptxas kept them
    interleaved)."""
    gate_up_stages: int | None = None
    """gate_up's own `stages` (default `stages`)."""
    native_rows: int = 0
    """gate_up by the CUDA C kernel (common/kernels/moe_int4_native.py) at this many gate rows a warp (1, 2
    or 4; 0: Triton's), where it takes the call (bf16 x on Hopper);
    else Triton's."""
    native_warps: int = 4
    """The CUDA gate_up's warps a block."""
    native_mma: bool = False
    """With `native_rows`: gate_up by the CUDA C tensor-core kernel instead (moe_int4_native.gate_up's `mma`;
    about half the scalar kernel's instructions a code), where it takes the call (hidden up to 2,560). Each
    warp loads one group of codes ahead of the one it multiplies."""
    native_down_warps: int = 0
    """down (and the fold of a token's choices) by the CUDA C kernel at this many warps a block, 8 rows a warp
    (0: Triton's), where it takes the call (`words`, bf16 on Hopper); else Triton's."""
    native_down_mma: bool = False
    """With `native_down_warps`: down on the tensor cores in CUDA C instead (moe_int4_native.down's `mma`),
    where it and the CUDA gate_up take the call: gate_up hands it the activations in bf16 in order (act
    layout 3; the other forms keep them in fp32). RESIDENT_CONFIGS' one-token default."""


class ShapeTable(Mapping[int, DecodeConfig]):
    """Launch shapes by token count: a read-only mapping, hashable (a KernelConfig holding it is)."""

    def __init__(self, shapes: Mapping[int, DecodeConfig]) -> None:
        self._shapes = dict(shapes)

    def __getitem__(self, tokens: int) -> DecodeConfig:
        return self._shapes[tokens]

    def __iter__(self) -> Iterator[int]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def __hash__(self) -> int:
        return hash(frozenset(self._shapes.items()))

    def __repr__(self) -> str:
        return f"ShapeTable({self._shapes!r})"


DECODE_CONFIGS = ShapeTable(
    {
        1: DecodeConfig(block=8, split_act=True),
        2: DecodeConfig(block=8, groups_per_step=2, num_warps=2, split_act=True),
        8: DecodeConfig(block=16, groups_per_step=1, num_warps=2, down_block=64, magic=True),
    }
)
"""The int4 decode kernels' shape per token count for steps that copy misses (the fastest of
`python -m bench.moe_int4_tune`); see RESIDENT_CONFIGS for the others. A shape applies from its token count
up to the next one's (`decode_config`)."""

RESIDENT_CONFIGS = ShapeTable({
    **DECODE_CONFIGS,
    1: DecodeConfig(
        block=8, down_block=16, down_groups_per_step=1, down_warps=2, words=True,
        native_rows=2, native_warps=2, native_down_warps=4, native_mma=True, native_down_mma=True,
    ),
})  # fmt: skip
"""The shapes of decode steps with no copies beside them (every expert resident:
OffloadedExperts.all_resident): DECODE_CONFIGS but at one token, where gate_up and down run as CUDA C on the
tensor cores (DecodeConfig.native_rows, native_down_warps, native_mma, native_down_mma), with Triton's words
form (down at one group a step) where the CUDA kernels cannot be built. Steps that copy misses keep
DECODE_CONFIGS: the copies share the SMs with these kernels."""


def decode_config(tokens: int, configs: Mapping[int, DecodeConfig] | None = None) -> DecodeConfig:
    """The shape of the largest token count in `configs` (default DECODE_CONFIGS) not above
    `tokens`."""
    configs = DECODE_CONFIGS if configs is None else configs
    return configs[max((n for n in configs if n <= tokens), default=1)]


@dataclass(frozen=True)
class KernelConfig:
    """The kernel forms and launch options of a model's passes (each field: the default's choice, False or
    another value a variant the benchmarks compare). Fields about the fused kernels matter only where they run
    (`use_fused_kernels`)."""

    pdl: bool = True
    """Kernels that take part launch with programmatic dependent launch (pdl.py; CUDA, compute capability 9
    on)."""
    pdl_early_trigger: bool = True
    """A taking-part kernel lets the next one launch once all its programs have waited (False: at their
    exit)."""
    pdl_start_trigger: bool = True
    """The launches made with `trigger_first` let the next kernel launch as their programs start."""
    gemv_pdl: bool = True
    """The Triton and CUDA C GEMVs take part in programmatic dependent launch."""
    fold_sums: bool = True
    """The GEMV's chunk sums and the int4 MoE's combine fold into the kernels before them, at one row
    (arrival.py; False: a separate kernel sums)."""
    gemv: bool = True
    """Projections of at most GEMV_ROWS rows on CUDA run through the GEMVs (False: cuBLAS)."""
    gemv_native: bool = True
    """One-row projections `gemv_native.takes` holds for run through the CUDA C GEMV (False: Triton's)."""
    large_one_row: bool = True
    """At one row, a bf16 weight of gemv.CUBLAS_ROWS rows and more runs the GEMV's one-chunk launch (False:
    cuBLAS)."""
    fp8_large_one_row: bool = True
    """At one row, an fp8 weight of gemv.CUBLAS_ROWS rows and more runs gemv.FP8_LARGE_ONE_ROW's launch
    (False: `choose`'s one block a step)."""
    conv_epilogue: bool = True
    """GDN's one-token conv runs in its input projection's GEMV epilogue (False: its own kernel after)."""
    moe_dispatch: bool = True
    """A few rows' MoE block (routing, shared expert) dispatches through moe_dispatch.py's kernel (False:
    three kernels)."""
    shared_kernel: bool = True
    """A few rows' shared expert after its input projections runs as one Triton kernel (`swiglu_down`)."""
    lookahead: bool = True
    """MoE layers with a next layer to guess for (`install_lookahead`) copy its guessed experts ahead."""
    mix_up_kernel: bool = True
    """Hyper-connections run the mix-up GEMV inside the mix kernel (`hc_mix_up`)."""
    mix_up_split_rank: bool = True
    """hc_mix_up covers the rank in two power-of-two tiles (False: one tile padded to the next power)."""
    project_kernel: bool = True
    """With `mix_up_kernel`: hyper-connections normalise the streams inside the input projection's kernel
    (`hc_project`)."""
    defer_inject: bool = True
    """With `project_kernel`: a pass that allows it leaves each injection to the next hyper-connection's
    projection kernel."""
    hold_mixer_launch: bool | None = None
    """In decode steps, the token mixer's input projection (the layer's largest GEMV) launches only once the
    mix-up kernel before it has exited (pdl.launch's `hold_next`). None: where that projection runs the wide
    fp8 launch (gemv.FP8_LARGE_ONE_ROW), whose single wave of large programs early residents slow
    (bench/LOG.md, Holding the mixer's launch); True / False: always / never."""
    select_kernel: bool = True
    """QSA's decode top-k and key expansion in one Triton launch (`select_blocks`)."""
    select_rank: bool = True
    """`select_blocks` ranks every block against all the query's (False: one program a query searches the
    k-th largest score's bits)."""
    prologue_kernel: bool = True
    """QSA's decode key compression, norms and rotations run as programs of one kernel (qsa_prologue.py)."""
    attention_programs: int = 2048
    """Split programs the paged decode attention aims for (decode_attention.py)."""
    combine_shared: bool = True
    """With the int4 decode kernels: decode's shared expert added in the kernel that sums the choices (False:
    by torch after)."""
    moe_dense: bool = True
    """Routed experts of an offloaded provider on CUDA, of a format the in-place kernels read (bf16, fp8,
    the 4-bit floats, published int4), decode and prefill through them (moe_dense.py, moe_dense_grouped.py:
    each pair's weights read where they lie; False: torch gathers the chosen experts dequantised first)."""
    split_lanes: int = 8
    """Lane counts from which a recorded decode pass runs as two groups of lanes (common/model/groups.py: one
    group computes while the other's experts copy), where the model and its expert provider can; 0: never."""
    pipeline_depth: int = 2
    """Decode passes a worker keeps in flight (common/engine/decode_pipeline.py): 2 launches step n+1 before
    step n's tokens come back; 1 waits for each."""
    int4_decode: Mapping[int, DecodeConfig] = DECODE_CONFIGS
    """The int4 decode kernels' launch shapes by token count, for steps with copies beside them."""
    int4_resident: Mapping[int, DecodeConfig] = RESIDENT_CONFIGS
    """The int4 decode kernels' launch shapes by token count, every expert resident (no copies beside)."""

    def __post_init__(self) -> None:
        for name in ("int4_decode", "int4_resident"):  # any mapping given: held read-only and hashable
            if not isinstance(getattr(self, name), ShapeTable):
                object.__setattr__(self, name, ShapeTable(getattr(self, name)))


KERNELS = KernelConfig()
"""The default configuration."""
