"""A tuning aid for the int4 MoE kernels (common/kernels/moe_int4.py) at flashnext's expert shape (H 2560,
I 640, top-10).

Decode (default): µs per call of `moe_int4_decode` for one and eight tokens, over output rows per program,
groups per loop step and warps (and for three of those shapes down's own rows per program and the split
activations), each output checked against the defaults', and the share of the HBM floor each reaches (the
experts a call uses, read once, at the HBM rate measured here). Calls are replayed from a CUDA graph, each
on another layer's pool rows (a pool larger than L2), as a decode step's 48 layers would be; a call's tokens
draw from a Zipf popularity, so they share experts as eight lanes do.

`--grouped`: ms per call of the prefill kernels (`moe_int4_grouped`) for 8,192 and 25,600 tokens routed
uniformly over 512 experts, over `GroupedConfig` (pairs per block, columns per program, warps, pipelining
stages), as TFLOP/s against the bf16 GEMM rate measured here; each setting's output is checked against the
default's.

    python -m bench.moe_int4_tune [--tokens 1 8] [--rows 4096]
    python -m bench.moe_int4_tune --grouped [--tokens 8192 25600]

`--magic`, `--words`, `--stages N`: every shape with those DecodeConfig knobs, beside the defaults. `--down`:
gate_up's and down's shapes apart. `--native`: gate_up by the CUDA C kernel (`_native_settings`), beside
the all-resident one-token shape.

`--once`: no timing, three eager calls of the decode defaults per token count (`moe-int4-decode-ncu.txt`:
`ncu --kernel-name regex:"_gate_up_kernel|_down_kernel" --launch-skip 4 --launch-count 4 --section ...
python -m bench.moe_int4_tune --once --rows 2048`, the third one-token call and the first eight-token one);
`--once --native`: the all-resident shapes' calls (RESIDENT_CONFIGS), as `moe-int4-native-ncu.txt` profiles.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

from bench.common import measure_hbm_gbps, measure_tflops, median_ms, replay_us
from bench.flashnext import random_int4_store
from common.kernels.config import RESIDENT_CONFIGS, DecodeConfig, decode_config
from common.kernels.moe_int4 import moe_int4_decode
from common.kernels.moe_int4_grouped import GROUPED, GroupedConfig, moe_int4_grouped

HIDDEN, INTER, TOP_K, CALLS, EXPERTS = 2560, 640, 10, 48, 512


def decode_calls(pool: dict, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """CALLS (x, rows [tokens, k], weights) as decode steps' MoE layers: each call one layer's EXPERTS pool
    rows, each token's k experts drawn from a Zipf popularity (exponent 0.9, as synthetic-zipf's middle
    layer), so tokens share experts as eight lanes do. Seeded: every setting times the same calls."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    layers = pool["down_qweight"].shape[0] // EXPERTS
    popularity = 1 / torch.arange(1, EXPERTS + 1, device="cuda", dtype=torch.float32) ** 0.9
    out = []
    for c in range(CALLS):
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        ids = torch.multinomial(popularity.expand(tokens, -1), TOP_K, generator=gen)  # [tokens, k] distinct
        weights = torch.softmax(torch.randn(tokens, TOP_K, device="cuda", generator=gen), -1)
        out.append((x, (c % layers) * EXPERTS + ids, weights))
    return out


def time_config(pool: dict, calls: list, setting: dict, repeats: int = 20) -> tuple[float, torch.Tensor]:
    """µs per call of `calls` recorded as one graph, replayed `repeats` times; and the first call's output."""
    config = shape(setting, calls[0][1].shape[0])
    first = moe_int4_decode(*calls[0], pool, config=config)
    return replay_us(
        lambda: [moe_int4_decode(*c, pool, config=config) for c in calls], repeats
    ) / CALLS, first


def shape(setting: dict, tokens: int) -> DecodeConfig:
    """A setting's launch shape: its knobs over DecodeConfig's plain defaults, or (no knobs) the token
    count's of DECODE_CONFIGS."""
    return DecodeConfig(**setting) if setting else decode_config(tokens)


def label(setting: dict) -> str:
    if not setting:
        return "defaults (DECODE_CONFIGS)"
    knobs = (setting["block"], setting["groups_per_step"], setting["num_warps"])
    text = "block {:>2} groups/step {:>2} warps {}".format(*knobs)
    if setting.get("down_block"):
        text += f" down block {setting['down_block']}"
    if setting.get("down_groups_per_step"):
        text += f" down {setting['down_groups_per_step']} groups/step {setting['down_warps']} warps"
    text += " split" if setting.get("split_act") else ""
    text += " magic" if setting.get("magic") else ""
    text += " words" if setting.get("words") else ""
    text += f" gate_up stages {setting['gate_up_stages']}" if setting.get("gate_up_stages") else ""
    if setting.get("native_mma"):
        text += " native mma"
    elif setting.get("native_rows"):
        text += f" native {setting['native_rows']}x{setting['native_warps']}"
    if setting.get("native_down_mma"):
        text += " native down mma"
    elif setting.get("native_down_warps"):
        text += f" native down {setting['native_down_warps']}"
    return text + (f" stages {setting['stages']}" if setting.get("stages", 1) > 1 else "")


def grouped_sweep(tokens_list: list[int]) -> None:
    """The prefill kernels over launch shapes, fastest first, per token count."""
    peak = measure_tflops()
    store = random_int4_store(1, EXPERTS, HIDDEN, INTER)
    pool = {name: block.cuda() for name, block in store.parts[0].items()}
    rows = torch.arange(EXPERTS, device="cuda")
    print(f"bf16 GEMM {peak:.0f} TFLOP/s")
    for tokens in tokens_list:
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        ids = torch.rand(tokens, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices
        weights = torch.softmax(torch.randn(tokens, TOP_K, device="cuda", generator=gen), -1)
        flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
        want = moe_int4_grouped(x, ids, weights, rows, pool, GROUPED).float()
        results = []
        shapes = [(32, 64, 4, 1), *itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4))]
        for shape in shapes:
            config = GroupedConfig(*shape)
            call = functools.partial(moe_int4_grouped, x, ids, weights, rows, pool, config)
            try:
                got = call().float()  # compiles it too
                ms = median_ms(call, 3)  # events, no graph: grouping the pairs syncs the host
            except Exception as error:  # e.g. out of shared memory at the largest tiles
                print(f"  {config}: {type(error).__name__}")
                continue
            error = ((got - want).norm() / want.norm()).item()
            results.append((ms, config, error))
        print(f"tokens {tokens}: {flops / 1e12:.2f} TFLOP of expert GEMMs per call")
        for ms, c, error in sorted(results, key=lambda r: r[0])[:10]:
            tflops = flops / (ms / 1e3) / 1e12
            setting = f"block_m {c.block_m:>3} block_n {c.block_n:>3} warps {c.num_warps} stages {c.stages}"
            rate = f"{tflops:5.1f} TFLOP/s ({tflops / peak:.0%})"
            print(f"  {setting}: {ms:7.2f} ms, {rate}, vs default {error:.0e}")


def _byte_settings() -> list[dict]:
    """The byte kernels' shapes: rows, groups a step and warps; for three of them down's own rows and the
    split activations (down is L1-bound, moe-int4-decode-ncu.txt)."""
    settings = [
        {"block": b, "groups_per_step": g, "num_warps": w}
        for b, g, w in itertools.product((8, 16, 32), (1, 2, 4, 8), (2, 4, 8))
    ]
    for (b, g, w), down, split in itertools.product(
        ((8, 4, 4), (16, 1, 2), (16, 4, 4)), (None, 32, 64), (False, True)
    ):
        if down or split:
            settings.append(
                {"block": b, "groups_per_step": g, "num_warps": w, "down_block": down, "split_act": split}
            )
    return settings


def _down_settings() -> list[dict]:
    """gate_up's and down's shapes apart (down: 5 groups of 128 at flashnext's shape, where gate_up has 20):
    a few gate_up shapes × down's rows, groups a step and warps, codes as words; and the byte form's
    one-token shape with down's at one group a step."""
    gate_ups = ((8, 4, 4), (16, 2, 2), (16, 4, 4), (32, 4, 2))
    downs = ((8, 4, 4), (16, 1, 2), (32, 1, 1), (32, 1, 2), (32, 2, 2), (64, 1, 2), (64, 1, 4))
    settings = [
        {"block": b, "groups_per_step": g, "num_warps": w, "words": True}
        | {"down_block": db, "down_groups_per_step": dg, "down_warps": dw}
        for (b, g, w), (db, dg, dw) in itertools.product(gate_ups, downs)
    ]
    for db, dg, dw in ((64, 1, 1), (32, 1, 1), (32, 1, 2)):
        settings.append(
            {"block": 8, "groups_per_step": 4, "num_warps": 4, "split_act": True}
            | {"down_block": db, "down_groups_per_step": dg, "down_warps": dw}
        )
    return settings


def _native_settings() -> list[dict]:
    """gate_up by the CUDA C kernel (DecodeConfig.native_rows) over rows a warp and warps a block, down as
    RESIDENT_CONFIGS' one-token shape; then down by its CUDA C kernel too, over warps a block; then gate_up
    on the tensor cores (DecodeConfig.native_mma), with Triton's and the CUDA down; then down on the tensor
    cores (DecodeConfig.native_down_mma) after either CUDA gate_up; beside the Triton words shape."""
    down = {"words": True, "down_block": 16, "down_groups_per_step": 1, "down_warps": 2}
    resident = {"block": 8, "groups_per_step": 4, "num_warps": 4} | down
    gate_up = [
        resident | {"native_rows": r, "native_warps": w} for r, w in itertools.product((1, 2, 4), (2, 4, 8))
    ]
    both = [resident | {"native_rows": 2, "native_warps": 2, "native_down_warps": w} for w in (1, 2, 4, 8)]
    mma = [resident | {"native_rows": 2, "native_mma": True, "native_down_warps": w} for w in (0, 4)]
    down_mma = [
        resident
        | {"native_rows": 2, "native_warps": 2, "native_mma": m, "native_down_warps": 4}
        | {"native_down_mma": True}
        for m in (False, True)
    ]
    return [resident, *gate_up, *both, *mma, *down_mma]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grouped", action="store_true", help="the prefill kernels (default: decode)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument(
        "--rows", type=int, default=4096, help="pool rows the decode calls read (EXPERTS a layer)"
    )
    ap.add_argument("--once", action="store_true", help="three untimed decode calls a token count (ncu)")
    ap.add_argument("--magic", action="store_true", help="the shapes with DecodeConfig.magic; the defaults")
    ap.add_argument("--words", action="store_true", help="the shapes with DecodeConfig.words; the defaults")
    ap.add_argument(
        "--stages", type=int, default=None, help="the shapes with DecodeConfig.stages; the defaults"
    )
    ap.add_argument(
        "--down", action="store_true", help="gate_up's and down's shapes apart (`_down_settings`)"
    )
    ap.add_argument("--native", action="store_true", help="gate_up by the CUDA C kernel (`_native_settings`)")
    args = ap.parse_args()
    if args.grouped:
        grouped_sweep(args.tokens or [8192, 25600])
        return
    if args.rows < EXPERTS:
        ap.error(f"--rows must be at least one layer's {EXPERTS} experts")
    store = random_int4_store(1, args.rows, HIDDEN, INTER)  # args.rows // EXPERTS layers' experts
    pool = {name: block.cuda() for name, block in store.parts[0].items()}  # [rows, ...] each
    if args.once:  # with --native, the all-resident shapes (RESIDENT_CONFIGS: the CUDA C kernels)
        configs = RESIDENT_CONFIGS if args.native else None
        for tokens in args.tokens or [1, 8]:
            for call in decode_calls(pool, tokens)[:3]:
                moe_int4_decode(*call, pool, config=decode_config(tokens, configs))
        torch.cuda.synchronize()
        return
    hbm = measure_hbm_gbps()
    expert_bytes = store.expert_bytes
    print(f"HBM {hbm:.0f} GB/s; expert {expert_bytes / 2**20:.2f} MiB")
    if args.native:
        settings = [{}, *_native_settings()]
    elif args.down:
        settings = [{}, *_down_settings()]
    else:
        settings = _byte_settings()
    extra = {"magic": args.magic, "words": args.words, "stages": args.stages}
    extra = {knob: v for knob, v in extra.items() if v}
    if extra:  # every shape with these knobs, beside the defaults
        shapes = [s for s in settings if not (args.words and s.get("split_act"))]  # (ignored by words)
        settings = [{}, *({**setting, **extra} for setting in shapes)]
    for tokens in args.tokens or [1, 8]:
        calls = decode_calls(pool, tokens)
        want = moe_int4_decode(*calls[0], pool, config=decode_config(tokens)).float()  # the defaults'
        results = []
        for setting in settings:
            us, got = time_config(pool, calls, setting)
            error = ((got.float() - want).norm() / want.norm()).item()
            assert error < 1e-2, f"{label(setting)}: {error:.1e} from the defaults (bf16 weights: ~1e-3)"
            results.append((us, setting, error))
        used = sum(c[1].unique().numel() for c in calls) / CALLS  # experts a call reads at least once
        floor = used * expert_bytes / (hbm * 1e3)  # µs to read them once at the HBM rate
        print(f"tokens {tokens}: {used:.1f} experts a call, HBM floor {floor:.1f} µs per call")
        for us, setting, error in sorted(results, key=lambda r: r[0])[:16]:
            print(f"  {label(setting)}: {us:7.2f} µs ({floor / us:.0%} of HBM), vs default {error:.0e}")


if __name__ == "__main__":
    main()
