"""The int4 decode kernels compiled for the H200 (sm_90) on any machine, no GPU needed: what each launch shape
costs in instructions before it is timed.

Triton compiles for a named target without a device, and its wheel carries ptxas and cuobjdump. For
`moe_int4_decode`'s gate_up and down kernels at flashnext's expert shape (H 2560, I 640, top-10), one token,
this prints the SASS instruction count of the whole kernel and of its loop body, the loop steps a program
runs, the layout conversions Triton inserted (each a trip through shared memory), and an estimate of the
issue time of one call: every program's warps issuing one instruction a cycle per scheduler, 132 SMs × 4
schedulers at 1.75 GHz. The estimate leaves out memory latency and launches: on the H200 the one-token
calls ran ~2-3× longer than it (bench/results/moe-int4-decode-down.txt). It ranks shapes by the work they
issue; the GPU times them (bench.moe_int4_tune).

`--hc`: the same for the hyper-connection decode kernels at flashnext's shape (hc 4, rank 320, one row,
the launch shapes hc_project and hc_mix_up default to): in a decode-allfit step on the H200 (a02f295)
mix-up ran 5.65 µs a sublayer and the projection 5.2, ~3.5× their estimates.

`--step`: the step's other decode kernels (the GEMV, the router, the shared expert's down, the Gated DeltaNet
step) at flashnext's shapes, and the GEMV on GDN's fp8 input projection (`--resident-dtype fp8`) as `choose`
launches it and at the tune's fastest shape alone (64 rows, two scale blocks a step). Each kernel's
registers and local memory (spills) are reported beside its SASS; a GEMV's issue estimate counts its loop
once a step.

    python -m bench.sass_census [--shape BLOCK GROUPS WARPS] [--down BLOCK GROUPS WARPS] [--words]
    python -m bench.sass_census --hc | --step | --native

`--native`: the CUDA C int4 kernels (common/kernels/cuda/int4_decode.cu) built by nvcc for sm_90 at
RESIDENT_CONFIGS' one-token launch: gate_up 2,264 instructions a warp (its 4 rows × 2,560 inputs: ~6.8 a
weight a lane against the Triton words form's ~7.4), 123 registers; down 1,720 (its "loop" is the fold's
sum), 69 registers; the tensor-core gate_up (DecodeConfig.native_mma) 2,160 a warp for 32 rows × 640
inputs (~3.4 a weight a lane), 127 registers; the tensor-core down (DecodeConfig.native_down_mma) 1,224 a
warp for 16 rows × 640 inputs with the fold, 124 registers. They are straight-line code, so the issue
estimate counts every instruction once.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, replace

import torch
import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from common.kernels import arrival, hyper, moe_int4, native
from common.kernels.config import DECODE_CONFIGS, RESIDENT_CONFIGS, DecodeConfig
from common.kernels.moe_int4 import GROUP

HIDDEN, INTER, TOP_K, SMS, CLOCK_GHZ = 2560, 640, 10, 132, 1.75
HC, RANK = 4, 320
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


@dataclass(frozen=True)
class Census:
    """One compiled kernel's SASS."""

    total: int
    """Instructions in the kernel."""
    loop: int
    """Instructions of its loop body (the span a backward branch closes; 0 when fully unrolled)."""
    conversions: int
    """Layout conversions in its TTGIR."""
    opcodes: Counter
    """Instructions by opcode (without modifiers)."""
    registers: int
    """Registers a thread (ptxas's allocation: with the warps, how many programs an SM holds)."""
    local: int
    """Local memory a thread, bytes: registers spilled (0 unless ptxas ran out)."""


def compile_sm90(
    fn, signature: dict[str, str], constants: dict, num_warps: int, divisible: tuple[str, ...],
    stages: int | None = None,
):  # fmt: skip
    """`fn` compiled for sm_90: pointer arguments and those named in `divisible` marked multiples of 16, as
    Triton specialises them at launch; FMA contraction on, as on a launch; `stages` the launch's num_stages
    (None: Triton's default)."""
    names = list(signature)
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n in names
        if signature[n].startswith("*") or n in divisible
    }
    signature = signature | dict.fromkeys(constants, "constexpr")
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": num_warps, "enable_fp_fusion": True}
    options |= {"num_stages": stages} if stages else {}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def census(kernel) -> Census:
    """The SASS of a compiled Triton kernel, counted, and its resource usage."""
    sass, usage = _dump(kernel.asm["cubin"])
    return _count(sass, usage, kernel.asm["ttgir"].count("convert_layout"))


def _dump(cubin: bytes) -> tuple[str, str]:
    """cuobjdump's (from Triton's wheel) SASS and resource usage of a cubin."""
    tools = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        dump = lambda flag: (
            subprocess.run(
                [os.path.join(tools, "cuobjdump"), flag, file.name],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        return dump("-sass"), dump("-res-usage")


def _count(sass: str, usage: str, conversions: int) -> Census:
    """One kernel's SASS listing and resource line, counted."""
    registers, local = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "LOCAL"))
    found = [m for m in map(_INSTRUCTION.match, sass.splitlines()) if m]
    addresses = [int(m.group(1), 16) for m in found]
    loop = 0
    for i, m in enumerate(found):
        target = re.search(r"BRA (0x[0-9a-f]+)", m.string)
        if m.group(3).startswith("BRA") and target and int(target.group(1), 16) < addresses[i]:
            loop = i - addresses.index(int(target.group(1), 16)) + 1
    opcodes = Counter(m.group(3).split(".")[0] for m in found)
    return Census(len(found), loop, conversions, opcodes, registers, local)


def native_sass() -> tuple[dict[str, str], dict[str, str]]:
    """int4_decode.cu built by nvcc for sm_90: each kernel's SASS and resource usage, by mangled name."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "int4_decode.cubin")
        source = native.SOURCES / "int4_decode.cu"
        subprocess.run([native.nvcc(), "-O3", "-cubin", "-arch=sm_90", "-o", cubin, str(source)], check=True)
        with open(cubin, "rb") as file:
            sass, usage = _dump(file.read())
    sass_by = dict(re.findall(r"Function : (\S+)\n(.*?)(?=\n\s*Function :|\Z)", sass, re.S))
    return sass_by, dict(re.findall(r"Function (\S+):\n(.*?)\n", usage))


def native_census() -> dict[str, tuple[Census, float]]:
    """The CUDA C int4 kernels (common/kernels/cuda/int4_decode.cu, built by nvcc for sm_90) at
    RESIDENT_CONFIGS[1]'s launch: gate_up's instance for its rows a warp and flashnext's three chunks a lane,
    and down. Straight-line code: the count includes the two code-loading paths (settled or not) and down's
    unrolled groups past flashnext's five, so it overstates what a warp issues."""
    config = RESIDENT_CONFIGS[1]
    rows, warps, down_warps = config.native_rows, config.native_warps, config.native_down_warps
    sass_by, usage_by = native_sass()
    chunks = -(-HIDDEN // 1024)
    wanted = {"gate_up": f"gate_up_kernelILi{rows}ELi{chunks}E", "down": "down_kernel"}
    wanted["gate_up mma"] = "gate_up_mma_kernel"
    wanted["down mma"] = f"down_mma_kernelILi{INTER // 128}E"
    blocks = {
        "gate_up": (TOP_K * INTER // (rows * warps), warps),
        "down": (TOP_K * HIDDEN // (8 * down_warps), down_warps),
        "gate_up mma": (TOP_K * INTER // 16, 4),
        "down mma": (TOP_K * HIDDEN // 64, 4),
    }
    out = {}
    for name, mangled in wanted.items():
        symbol = next(s for s in sass_by if mangled in s)
        c = _count(sass_by[symbol], usage_by[symbol], 0)
        programs, program_warps = blocks[name]
        out[name] = (c, _issue_us(programs, program_warps, c.total))
    return out


def int4_decode_census(config: DecodeConfig) -> dict[str, tuple[Census, float]]:
    """gate_up's and down's census at one token under `config`, each with its estimated issue time (µs)."""
    codes = "*i32" if config.words else "*u8"
    pool = {"w_ptr": codes, "s_ptr": "*bf16", "z_ptr": "*u8"}
    gate_up = {"x_ptr": "*bf16", "rows_ptr": "*i64", "row_of_ptr": "*i64", **pool, "act_ptr": "*fp32"}
    gate_up |= {"k": "i32", "hidden": "i32", "inter": "i32"}
    down = {"act_ptr": "*fp32", "rows_ptr": "*i64", "row_of_ptr": "*i64", "weights_ptr": "*fp32", **pool}
    down |= {"partial_ptr": "*fp32", "hidden": "i32", "inter": "i32", "count_ptr": "*i32"}
    down |= {"shared_ptr": "*bf16", "gate_ptr": "*bf16", "out_ptr": "*bf16", "gate_stride": "i32"}
    knobs = {"HALF": GROUP // 2, "SPLIT": config.split_act, "MAGIC": config.magic, "LOOKUP": True}
    knobs |= {"WORDS": config.words}
    knobs |= {"STAGES": config.stages, "GDC": False}
    down_block = config.down_block or config.block
    down_gpb, down_warps = (
        config.down_groups_per_step or config.groups_per_step,
        config.down_warps or config.num_warps,
    )
    # gate_up's own knobs (SETTLED as a block with a shared expert runs it)
    gate_up_own = {"SETTLED": True, "STAGES": config.gate_up_stages or config.stages}
    # down as a one-token step launches it: the choices summed by its last program (arrival.py)
    down_own = {"FOLD": arrival.folds(1), "K": TOP_K, "SHARED": True, "GATED": True}
    kernels = {
        "gate_up": (moe_int4._gate_up_kernel, gate_up, HIDDEN, config.block, INTER // config.block,
                    config.groups_per_step, config.num_warps, gate_up_own),
        "down": (moe_int4._down_kernel, down, INTER, down_block, HIDDEN // down_block, down_gpb, down_warps,
                 down_own),
    }  # fmt: skip
    out = {}
    for name, (fn, signature, width, block, blocks, gpb, warps, own) in kernels.items():
        groups = width // GROUP
        gpb = min(gpb, triton.next_power_of_2(groups))
        constants = knobs | {"GROUPS": groups, "GPB": gpb, "BLOCK": block} | own
        c = census(compile_sm90(fn, signature, constants, warps, ("hidden", "inter")))
        steps = -(-groups // gpb)  # a program's loop steps
        per_warp = c.total + (steps - 1) * c.loop  # the loop body once per step
        issue_us = _issue_us(TOP_K * blocks, warps, per_warp)
        out[name] = (c, issue_us)
    return out


def _issue_us(programs: int, warps: int, instructions: int) -> float:
    """Every program's warps issuing `instructions` each, one a cycle per scheduler."""
    return programs * warps * instructions / (SMS * 4) / (CLOCK_GHZ * 1e3)


def hc_census() -> dict[str, tuple[Census, float]]:
    """hc_project's and hc_mix_up's census for one row at their default launch shapes (project: 4 columns,
    the whole stream, PROJECT_WARPS; mix-up: 8 columns, 4 warps, its rank in one padded tile and in two,
    KernelConfig.mix_up_split_rank), each with its estimated issue time (µs)."""
    n_out = RANK + HC  # the fused mix-down and inject projection
    project = {
        "x_ptr": "*bf16",
        "nw_ptr": "*bf16",
        "w_ptr": "*bf16",
        "out_ptr": "*fp32",
        "scale_ptr": "*fp32",
    }
    project |= {"rows": "i32", "n_out": "i32", "eps": "fp32"}
    project |= {"y_ptr": "*bf16", "inject_ptr": "*fp32", "new_ptr": "*bf16", "inject_stride": "i32"}
    project["part_stride"] = "i32"
    h_pad = triton.next_power_of_2(HIDDEN)
    constants = {"HC": HC, "H": HIDDEN, "H_PAD": h_pad, "BN": 4, "INJECT": True, "PARTS": HC, "GDC": False}
    warps = hyper.PROJECT_WARPS  # the previous injection in it
    c = census(compile_sm90(hyper._project_kernel, project, constants, warps, ()))
    out = {"hc_project": (c, _issue_us(-(-n_out // 4) * HC, warps, c.total))}  # (no loop: one read a stream)
    mix_up = {
        "down_ptr": "*fp32",
        "w_ptr": "*bf16",
        "x_ptr": "*bf16",
        "scale_ptr": "*fp32",
        "nw_ptr": "*bf16",
    }
    mix_up |= {"out_ptr": "*bf16", "hidden": "i32", "rank": "i32", "down_stride": "i32", "part_stride": "i32"}
    constants = {"HC": HC, "BLOCK": 8, "NORM": True, "PARTS": HC, "GDC": False}
    for split, name in ((False, "hc_mix_up"), (True, "hc_mix_up split")):  # the rank in one tile, or two
        head, tail = hyper.pow2_tiles(RANK, split)
        tiles = {"R_PAD": head, "R_TAIL": tail}
        c = census(compile_sm90(hyper._mix_up_kernel, mix_up, constants | tiles, 4, ("hidden", "rank")))
        out[name] = (c, _issue_us(HIDDEN // 8, 4, c.total))
    return out


def step_census() -> dict[str, tuple[Census, float]]:
    """The rest of a decode step's Triton kernels at flashnext's shapes and default launches, one row, each
    with its estimated issue time (µs): the GEMV on the MoE input projection (1,800 × 2,560) as `choose`
    launches it and in its CUDA-core form (16 rows a program, 512 inputs a step, x unpadded), on GDN's input
    projection (16,480 × 2,560) with the conv in its epilogue (gemv.ConvStep), its chunks' sum, the router
    (512 experts, top-10), the shared expert's SwiGLU + down (640 → 2,560) and the Gated DeltaNet step (48
    value heads of 128 × 128)."""
    from common.kernels import gated_delta, gated_mlp, gemv, routing

    gdc = {"GDC": True}
    product = {"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*fp32", "b_ptr": "*bf16", "part_ptr": "*fp32"}
    product |= {"y_ptr": "*bf16", "count_ptr": "*i32", "m": "i32", "n": "i32", "k": "i32", "k_chunk": "i32"}
    product |= {"hist_ptr": "*bf16", "slots_ptr": "*i64", "conv_w_ptr": "*bf16"}
    product |= {"conv_channels_n": "i32", "conv_width": "i32"}
    plain = {"EVEN_K": True, "HAS_SCALE": False, "HAS_BIAS": False, "PARTIAL": True, "PRECISION": "tf32"}
    plain |= {"CONV_K": 0, "CONV_BW": 1}
    plain["FOLD"] = arrival.folds(1)  # the chunks summed by the last to finish
    moe_in = 1800
    chosen = gemv.choose(1, moe_in, HIDDEN, torch.device("cpu"))
    cuda_cores = gemv.GemvConfig(bn=16, bk=512, splits=gemv.chunks(HIDDEN, 512, 5)[1], dot_rows=2)
    fp8 = product | {"w_ptr": "*fp8e4nv"}
    fp8_shape = plain | {"HAS_SCALE": True}
    gdn_in = 16480  # fp8 (--resident-dtype fp8): GDN's input projection as `choose` launches it (wide,
    narrow = gemv.GemvConfig(bn=32, bk=gemv.FP8_BK, splits=2)  # gemv.FP8_LARGE_ONE_ROW), and one block a step
    conv = plain | {"CONV_K": 4, "CONV_BW": 4}  # bf16: GDN's input projection with the conv (gemv.ConvStep)
    kernels, gemv_launch = {}, {}  # the GEMVs' stages and loop steps a program
    for name, cfg, n, signature, base in (
        ("gemv", chosen, moe_in, product, plain),
        ("gemv cuda cores", cuda_cores, moe_in, product, plain),
        ("gemv fp8", gemv.choose(1, gdn_in, HIDDEN, torch.device("cpu"), fp8=True), gdn_in, fp8, fp8_shape),
        ("gemv fp8 one block", narrow, gdn_in, fp8, fp8_shape),
        ("gemv conv", gemv.choose(1, gdn_in, HIDDEN, torch.device("cpu")), gdn_in, product, conv),
    ):
        dot = cfg.dot_rows <= 1
        shape = base | {"M_PAD": 16 if dot else 1, "BN": cfg.bn, "BK": cfg.bk, "DOT": dot} | gdc
        shape["PARTIAL"] = cfg.splits > 1
        shape["FOLD"] = shape["PARTIAL"] and arrival.folds(1)
        programs = -(-n // cfg.bn) * cfg.splits
        steps = gemv.chunks(HIDDEN, cfg.bk, cfg.splits)[0] // cfg.bk  # loop steps a program
        kernels[name] = (gemv._gemv_kernel, signature, shape, cfg.warps, ("k", "k_chunk"), programs)
        gemv_launch[name] = (cfg.stages, steps)
    parts = {"part_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16", "m": "i32", "n": "i32", "splits": "i32"}
    shape = {"BLOCK": 256, "HAS_BIAS": False} | gdc  # (from two rows on, or arrival off)
    kernels["gemv sum"] = (gemv._sum_chunks_kernel, parts, shape, 4, (), -(-moe_in // 256))
    route = {"logits_ptr": "*bf16", "weights_ptr": "*i16", "ids_ptr": "*i64", "experts": "i32"}
    shape = {"K": TOP_K, "KB": 16, "BLOCK": 512, "NORMALIZE": True, "BF16": True} | gdc
    kernels["route"] = (routing._route_kernel, route, shape, routing.ROUTE_WARPS, ("experts",), 1)
    down = {"gate_ptr": "*bf16", "up_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "hidden": "i32"}
    down |= {"gate_stride": "i32", "up_stride": "i32"}
    shape = {"INTER": INTER, "BLOCK": 8, "I_BLOCK": 1024} | gdc
    kernels["swiglu_down"] = (gated_mlp._swiglu_down_kernel, down, shape, 4, (), HIDDEN // 8)
    step = {"qkv_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "a_log_ptr": "*fp32"}
    step |= {"dt_bias_ptr": "*fp32", "state_ptr": "*fp32", "slots_ptr": "*i64", "out_ptr": "*fp32"}
    step |= dict.fromkeys(("qkv_stride", "a_stride", "b_stride", "heads_v", "group", "key_dim"), "i32")
    shape = {"DK": 128, "DV": 128, "BV": 32, "EARLY_GATES": True} | gdc
    kernels["gated_delta"] = (gated_delta._gated_delta_step_kernel, step, shape, 4, (), 48 * 4)
    out = {}
    for name, (fn, signature, constants, warps, divisible, programs) in kernels.items():
        stages, steps = gemv_launch.get(name, (None, 1))
        c = census(compile_sm90(fn, signature, constants, warps, divisible, stages=stages))
        out[name] = (c, _issue_us(programs, warps, c.total + (steps - 1) * c.loop))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=3, metavar=("BLOCK", "GROUPS", "WARPS"), default=None)
    ap.add_argument("--down", type=int, nargs=3, metavar=("BLOCK", "GROUPS", "WARPS"), default=None)
    ap.add_argument("--words", action="store_true")
    ap.add_argument("--json", action="store_true", help="one JSON object: config → kernel → counts")
    ap.add_argument("--hc", action="store_true", help="the hyper-connection decode kernels instead")
    ap.add_argument(
        "--step", action="store_true", help="the step's other decode kernels instead (step_census)"
    )
    ap.add_argument("--native", action="store_true", help="the CUDA C int4 kernels instead (needs nvcc)")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("TRITON_INTERPRET=1 makes the kernels interpreted: nothing to compile")
    configs = {
        "DECODE_CONFIGS[1]": DECODE_CONFIGS[1],
        "RESIDENT_CONFIGS[1]": RESIDENT_CONFIGS[1],
    }
    if args.shape or args.down or args.words:
        given = DecodeConfig(*(args.shape or ()), words=args.words)
        if args.down:
            given = replace(given, down_block=args.down[0], down_groups_per_step=args.down[1],
                            down_warps=args.down[2])  # fmt: skip
        configs = {"given": given}
    if args.hc:
        configs = {"hyper-connections": None}
    if args.step:
        configs = {"step": None}
    if args.native:
        configs = {"native": None}
    report = {}
    for label, config in configs.items():
        report[label] = {}
        if not args.json:
            print(f"{label}: {config}" if config else label)
        if config is None:
            kernels = {"step": step_census, "native": native_census}.get(label, hc_census)()
        else:
            kernels = int4_decode_census(config)
        for name, (c, issue_us) in kernels.items():
            report[label][name] = {"total": c.total, "loop": c.loop, "conversions": c.conversions,
                                   "issue_us": issue_us, "opcodes": dict(c.opcodes),
                                   "registers": c.registers, "local": c.local}  # fmt: skip
            if not args.json:
                top = ", ".join(f"{op} {n}" for op, n in c.opcodes.most_common(6))
                counts = f"{c.total} instructions, loop {c.loop}, {c.conversions} layout conversions"
                held = f"{c.registers} registers, {c.local} B local"
                print(f"  {name:>7}: {counts}, {held}, ~{issue_us:.1f} µs of issue a call; {top}")
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
