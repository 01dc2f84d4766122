"""What one dependent stage of a decode step costs apart from its bytes, as a kernel boundary and as a grid
barrier (CUDA; the kernels are bench/cuda/stage_floor.cu).

A one-token decode step is a chain of ~580 kernels, each needing the whole output of one before it; its time
over its bytes (decode-allfit: ~1.9 ms of 4.3 on the H200) is what those boundaries cost. This measures the
boundary alone: `stages` small GEMVs in a chain (each block multiplies its `rows` rows of a bf16 weight
[blocks · rows, K] by the stage before's whole output), with the weights' bytes per stage swept from none
(the pure dependency) to a hyper-connection's ~6.5 MB, each stage's weights its own (more than L2 holds):

- `serial`: a launch a stage, replayed from a CUDA graph, without programmatic dependent launch;
- `pdl-late`: the same in programmatic dependent launch, a block's weight copies issued after its wait;
- `pdl`: the same with the copies issued before the wait (how the step's kernels load their weights);
- `persistent-A`: every stage in one cooperative launch, a grid barrier (one counter) between stages, the
  weights of the next A stages in flight while a stage computes and waits (A = 0: after its barrier).
- `persistent-cg-A`: the same with cooperative groups' grid sync as the barrier (A = 0 and 2).

For each: µs a stage, the HBM time of its bytes at the device-to-device copy rate measured in the run, and
what the stage costs over them. Every variant's last output is checked bit for bit against `serial`'s, and
`serial`'s first stages against torch.

    python -m bench.stage_floor [--stages 256] [--rows 0 1 4 12] [--k 2048] [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import torch

from bench.common import measure_hbm_gbps, median_ms, progress, replay_us, write_result
from common.kernels import native

SOURCES = Path(__file__).resolve().parent / "cuda"
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_SETUP = (_I, _I, _I)
_CHAIN = (_P, _L, _P, _L, _I, _I, _I, _I, _I, _I, _I, _P)
_PERSISTENT = (_P, _L, _P, _L, _I, _I, _I, _I, _I, _I, _I, _P, _P)
AHEADS = (0, 1, 2, 4)
CG_AHEADS = (0, 2)
"""The lookaheads also run with cooperative groups' grid sync as the barrier (`persistent-cg-A`)."""
SMEM_LIMIT = 227 * 1024  # a block's shared memory at most on sm_90


def _entry(name: str, argtypes: tuple):
    lib = native.library("stage_floor", native.arch_of(torch.cuda.current_device()), SOURCES)
    if lib is None:
        raise RuntimeError("bench/cuda/stage_floor.cu could not be built (nvcc on PATH or $CUDA_HOME?)")
    fn = getattr(lib, f"spillway_stage_floor_{name}")
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def smem_bytes(rows: int, k: int, slots: int) -> int:
    """stage_floor.cu's stage_smem: the mbarriers, `slots` weight slices and the input."""
    return 128 + slots * rows * k * 2 + k * 4


class Chain:
    """`stages` stages of `rows` rows a block over `blocks` blocks, K inputs: the weights, the outputs (row s
    is stage s's input; row 0 random) and the launches."""

    def __init__(self, stages: int, rows: int, k: int, blocks: int):
        self.stages, self.rows, self.k, self.blocks = stages, rows, k, blocks
        self.n = blocks * max(rows, 1)  # outputs a stage
        gen = torch.Generator(device="cuda").manual_seed(rows)
        elems = blocks * rows * k
        self.w = (torch.randn(max(stages * elems, 1), device="cuda", generator=gen) / k**0.5).bfloat16()
        self.stage_elems = elems
        self.outs = torch.zeros(stages + 1, self.n, device="cuda")
        self.outs[0] = torch.randn(self.n, device="cuda", generator=gen)
        self.counter = torch.zeros(1, dtype=torch.int32, device="cuda")
        slots = max(a for a in AHEADS if a == 0 or smem_bytes(rows, k, a) <= SMEM_LIMIT)
        native.check(_entry("setup", _SETUP)(rows, k, max(slots, 1)), "stage_floor_setup")

    def bytes_a_stage(self) -> int:
        return self.stage_elems * 2

    def chain(self, pdl: bool, pre: bool) -> None:
        status = _entry("chain", _CHAIN)(
            self.w.data_ptr(), self.stage_elems, self.outs.data_ptr(), self.n, self.n, self.rows, self.k,
            self.stages, self.blocks, int(pdl), int(pre), torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        native.check(status, "stage_floor_chain")

    def persistent(self, ahead: int, cg_sync: bool = False) -> None:
        status = _entry("persistent", _PERSISTENT)(
            self.w.data_ptr(), self.stage_elems, self.outs.data_ptr(), self.n, self.n, self.rows, self.k,
            self.stages, self.blocks, ahead, int(cg_sync), self.counter.data_ptr(),
            torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        native.check(status, "stage_floor_persistent")

    def reference(self, s: int) -> torch.Tensor:
        """Stage s's output from its input row, in torch."""
        x = self.outs[s][torch.arange(self.k, device="cuda") % self.n]
        if self.rows == 0:
            return ((x[:32].sum() + x[-32:].sum()) / 64).expand(self.n)
        return self.w[s * self.stage_elems : (s + 1) * self.stage_elems].view(self.n, self.k).float() @ x


def variants(chain: Chain) -> dict:
    """name → a run of every stage."""
    out = {
        "serial": lambda: chain.chain(pdl=False, pre=True),
        "pdl-late": lambda: chain.chain(pdl=True, pre=False),
        "pdl": lambda: chain.chain(pdl=True, pre=True),
    }
    for cg_sync, aheads in ((False, AHEADS), (True, CG_AHEADS)):
        for ahead in aheads:
            if smem_bytes(chain.rows, chain.k, max(ahead, 1)) <= SMEM_LIMIT:
                name = f"persistent-{'cg-' if cg_sync else ''}{ahead}"
                out[name] = lambda a=ahead, cg=cg_sync: chain.persistent(a, cg)
    return out


def measure(chain: Chain, hbm_gbps: float) -> dict:
    """µs a stage of each variant whose last output is serial's bit for bit (`wrong`: the largest difference
    of each that is not); the stage's bytes and their HBM time."""
    floor_us = chain.bytes_a_stage() / hbm_gbps / 1e3
    row = {"bytes_a_stage": chain.bytes_a_stage(), "hbm_us_a_stage": floor_us, "us_a_stage": {}, "wrong": {}}
    want = None
    for name, run in variants(chain).items():
        run()
        torch.cuda.synchronize()
        if want is None:  # serial: its first stages against torch, then everyone's last against it
            for s in range(min(2, chain.stages)):
                torch.testing.assert_close(chain.outs[s + 1], chain.reference(s), rtol=1e-4, atol=1e-5)
            want = chain.outs[-1].clone()
        got = chain.outs[-1]
        if not torch.equal(got, want):  # recorded, not timed: the other variants' figures still stand
            row["wrong"][name] = (got - want).abs().max().item()
            progress(f"rows {chain.rows}: {name} differs from serial by {row['wrong'][name]:.3g}")
            continue
        # the persistent launch eager (one launch: its launch cost spread over every stage)
        us = median_ms(run) * 1e3 if name.startswith("persistent") else replay_us(run, replays=5)
        row["us_a_stage"][name] = us / chain.stages
        progress(f"rows {chain.rows}: {name} {us / chain.stages:.2f} µs a stage")
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=256)
    ap.add_argument("--rows", type=int, nargs="+", default=[0, 1, 4, 12])
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    blocks = torch.cuda.get_device_properties(0).multi_processor_count
    hbm = measure_hbm_gbps()
    print(f"HBM {hbm:.0f} GB/s; {blocks} blocks, {args.stages} stages, K {args.k}")
    rows = {}
    for r in args.rows:
        row = measure(Chain(args.stages, r, args.k, blocks), hbm)
        rows[str(r)] = row
        cells = "  ".join(f"{n} {us:6.2f}" for n, us in row["us_a_stage"].items())
        print(f"rows {r:3d} ({row['bytes_a_stage'] / 1e6:5.2f} MB, {row['hbm_us_a_stage']:5.2f} µs): {cells}")
        torch.cuda.empty_cache()
    path = write_result(
        "stage-floor",
        {"hbm_gbps": hbm, "blocks": blocks, "stages": args.stages, "k": args.k, "rows": rows},
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
