"""The memory plan: pools within the budget, the bytes the real pools allocate, clear refusals."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from common.config import MemoryPlan, WorkerConfig, format_bytes
from common.engine.engine import Engine
from common.engine.memory_plan import (
    PROCESS_RESERVE,
    MiB,
    _cache_bytes,
    _tensors_nbytes,
    arena_rows,
    format_plan,
    min_cache_slots,
    parse_size,
    plan_for_dir,
    plan_memory,
    use_expandable_segments,
)
from common.engine.runner import ModelRunner
from common.experts.artifact import convert
from common.experts.formats import FORMATS
from common.model.hf_config import parse_architecture
from common.model.loader import load_model
from common.model.synthetic.checkpoint import make_model
from common.model.synthetic.config import model_config
from common.model.synthetic.presets import ARCHS
from common.workers.decode import DecodeCore

PRESETS = [("tiny", arch) for arch in ARCHS] + [("qwen3-30b", None), ("flashnext", None)]
GiB = 1 << 30


def _config(preset: str, arch: str | None):
    return parse_architecture(model_config(preset, arch, {}), Path(f"<{preset}>/config.json"))


def _formats(cfg) -> list[str]:
    """The formats that can hold the config's experts (int4 needs dims that are multiples of 128)."""
    ok = []
    for name, fmt in FORMATS.items():
        try:
            fmt.components(cfg.hidden_size, cfg.moe_intermediate_size)
        except ValueError:
            continue
        ok.append(name)
    return ok


def _plan(cfg, arch, budget: int, **kw) -> MemoryPlan:
    settings = {"max_context": 4096, "max_running": 8, "expert_format": "bf16", "dtype": torch.bfloat16}
    return plan_memory(cfg, arch, budget_bytes=budget, **(settings | kw))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("32GiB", 32 * GiB),
        ("32G", 32 * GiB),
        ("32gib", 32 * GiB),
        ("500MiB", 500 * MiB),
        ("500M", 500 * MiB),
        ("1.5GiB", 3 * GiB // 2),
        ("2GB", 2 * 10**9),
        ("4096", 4096),
        ("64 KiB", 64 * 1024),
        ("1T", 1 << 40),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "32XB", "-1G", "1e9", "32 G B"])
def test_parse_size_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ValueError, match="not a number of bytes"):
        parse_size(text)


@pytest.mark.parametrize(("preset", "arch"), PRESETS, ids=[f"{p}-{a or 'default'}" for p, a in PRESETS])
def test_pools_stay_within_random_budgets(preset: str, arch: str | None) -> None:
    """For random budgets, contexts, lanes, chunks, dtypes and every format: an accepted plan gives out at
    most the budget, its cache has as many slots as fit (one more would not), and a refused plan raises."""
    arch_obj, cfg = _config(preset, arch)
    rng = random.Random(f"{preset}-{arch}")
    for fmt in _formats(cfg):
        for _ in range(16):
            settings = {
                "expert_format": fmt,
                "max_context": rng.choice([1, 100, 4096, 32768, 262144]),
                "max_running": rng.randint(1, 16),
                "prefill_chunk": rng.choice([16, 2048, 8192]),
                "dtype": rng.choice([torch.bfloat16, torch.float32]),
                "processes": rng.choice([1, 2]),
            }
            probe = _plan(cfg, arch_obj, GiB, **settings)
            if rng.random() < 0.5:  # 256 MiB .. 256 GiB
                budget = int(2 ** rng.uniform(28, 38))
            else:  # around the least accepted budget, up to every expert
                slots = rng.randint(-3, probe.max_cache_slots)
                budget = probe.min_budget + slots * probe.expert_bytes
            plan = _plan(cfg, arch_obj, budget, **settings)
            assert sum(plan.pools().values()) == plan.total
            if not plan.ok:
                with pytest.raises(ValueError, match="too small"):
                    plan.check()
                continue
            plan.check()
            assert plan.min_cache_slots <= plan.cache_slots <= plan.max_cache_slots
            assert plan.total <= budget
            layers, experts = len(cfg.moe_layers), cfg.num_experts
            more = plan.fixed + _cache_bytes(layers, experts, plan.cache_slots + 1, plan.expert_bytes)
            assert plan.all_experts_fit or more > budget


@pytest.mark.parametrize(("preset", "arch"), PRESETS, ids=[f"{p}-{a or 'default'}" for p, a in PRESETS])
def test_min_budget_is_the_least_that_is_accepted(preset: str, arch: str | None) -> None:
    arch_obj, cfg = _config(preset, arch)
    least = _plan(cfg, arch_obj, GiB).min_budget
    assert _plan(cfg, arch_obj, least).ok
    assert not _plan(cfg, arch_obj, least - 2 * _plan(cfg, arch_obj, least).expert_bytes).ok


def test_min_cache_slots_is_two_top_k_per_moe_layer_at_most_every_expert() -> None:
    _, flash = _config("flashnext", None)
    assert min_cache_slots(flash) == 48 * 2 * 10
    _, tiny = _config("tiny", "qwen3_moe")  # 3 MoE layers (layer 1 is dense), k = 2 of 8
    assert min_cache_slots(tiny) == 3 * 4
    _, few = parse_architecture(model_config("tiny", "mixtral", {"num_local_experts": 3}), Path("x"))
    assert min_cache_slots(few) == 4 * 3


def test_refusal_names_the_numbers_and_what_to_change() -> None:
    arch, cfg = _config("flashnext", None)
    plan = _plan(cfg, arch, 12 * GiB, dtype=torch.float32)
    assert not plan.ok
    with pytest.raises(ValueError) as err:
        plan.check()
    msg = str(err.value)
    for needle in (
        str(plan.budget),
        format_bytes(plan.fixed),
        f"{plan.cache_slots} slots",
        f"at least {plan.min_cache_slots}",
        f"at least {format_bytes(plan.min_budget)}",
        "--max-context (now 4096)",
        "--max-running (now 8)",
        "--expert-format int4 (now bf16)",
        "--dtype bfloat16",
    ):
        assert needle in msg, (needle, msg)


def test_a_budget_that_holds_every_expert_caps_the_cache() -> None:
    arch, cfg = _config("qwen3-30b", None)
    plan = _plan(cfg, arch, 512 * GiB)
    assert plan.all_experts_fit and plan.ok
    assert plan.cache_slots == plan.max_cache_slots == 48 * 128
    assert plan.total < plan.budget  # the rest stays unused


def test_flashnext_int4_at_32gib() -> None:
    """The reference workload (a 32 GiB card, int4 experts, bf16): one lane of 4096 tokens leaves the
    cache thousands of slots; 8 lanes of the full 262144-token context do not fit."""
    arch, cfg = _config("flashnext", None)
    one = _plan(cfg, arch, 32 * GiB, expert_format="int4", max_running=1)
    assert one.ok and one.cache_slots > 5 * one.min_cache_slots
    full = _plan(cfg, arch, 32 * GiB, expert_format="int4", max_context=262144)
    assert not full.ok and full.kv > 32 * GiB


def test_int4_decode_kernels_need_no_dequantised_experts() -> None:
    """With the fused kernels (CUDA's default) eight lanes of int4 decode read the codes in place; the torch
    path dequantises every chosen expert, which the plan must hold back from the cache."""
    arch, cfg = _config("flashnext", None)
    lanes = {"expert_format": "int4", "max_running": 8, "max_context": 2584, "prefill_chunk": 2048}
    kernels = _plan(cfg, arch, 32 * GiB, **lanes, processes=1)
    torch_ops = _plan(cfg, arch, 32 * GiB, **lanes, processes=1, fused_kernels=False)
    assert kernels.scratch < torch_ops.scratch and kernels.cache_slots > torch_ops.cache_slots
    bf16 = {**lanes, "expert_format": "bf16", "max_running": 1}  # no int4 kernels: nothing changes
    assert (
        _plan(cfg, arch, 80 * GiB, **bf16).scratch
        == _plan(cfg, arch, 80 * GiB, **bf16, fused_kernels=False).scratch
    )


def test_layer_major_groups_hold_their_streams() -> None:
    """A layer-major group holds its other chunks' residual streams (hc·H bf16) and rotary tables (2·head_dim
    fp32) while one computes, and runs its MoE over the whole group: the MoE's input and output [T, H], and
    per token more the int4 kernels' activated rows and grouping indices and its [T, H] result (their down
    slice stays 8,192 tokens). flashnext's default group of 32K tokens in chunks of 8K: ~1.3 GB beyond
    chunk-by-chunk prefill; a context shorter than the group counts only up to the context."""
    arch, cfg = _config("flashnext", None)
    lanes = {"expert_format": "int4", "max_running": 1, "max_context": 40000, "prefill_chunk": 8192}
    h, i, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k
    held = cfg.hc_count * h * 2 + 2 * 4 * cfg.head_dim
    moe = k * (2 * i + 40) + h * 2

    def beyond_chunks(group: int) -> int:
        return (group - 8192) * (held + moe) + 2 * group * h * 2

    grouped = _plan(cfg, arch, 32 * GiB, **lanes, layer_major_tokens=32768)
    chunked = _plan(cfg, arch, 32 * GiB, **lanes, layer_major_tokens=0)
    assert grouped.scratch - chunked.scratch == beyond_chunks(32768)
    assert grouped.cache_slots < chunked.cache_slots
    short = {**lanes, "max_context": 10000}
    short_grouped = _plan(cfg, arch, 32 * GiB, **short, layer_major_tokens=32768)
    short_chunked = _plan(cfg, arch, 32 * GiB, **short, layer_major_tokens=0)
    assert short_grouped.scratch - short_chunked.scratch == beyond_chunks(10000)


def test_serve_workers_split_the_budget() -> None:
    """Under `spillway serve` the prefill worker's cap is its own pools (arena rows of a cache with no slots,
    its prefill workspace, its reserve) plus their fragmentation share; decode's, the rest of the budget. The
    prefill part is what one process would give prefill, and the caps add up to the budget."""
    arch, cfg = _config("flashnext", None)
    lanes = {"expert_format": "int4", "max_running": 8, "max_context": 4096}
    serve = _plan(cfg, arch, 32 * GiB, **lanes, processes=2)
    alone = _plan(cfg, arch, 32 * GiB, **lanes, processes=1)
    decode_only = _plan(cfg, arch, 32 * GiB, **lanes, processes=1, prefill_chunk=1, layer_major_tokens=0)
    assert serve.ok and alone.prefill_process == 0 and alone.process_budget("decode") == alone.budget
    assert serve.process_budget("decode") + serve.process_budget("prefill") == serve.budget
    own = serve.arena - (1 + cfg.num_experts) * serve.expert_bytes  # decode keeps 1 + E rows
    assert own == arena_rows(cfg.num_experts, 1) * serve.expert_bytes
    prefill_scratch = serve.scratch - decode_only.scratch  # a 1-token prefill needs less than a decode step
    own += prefill_scratch + PROCESS_RESERVE
    assert serve.prefill_process == own + -(-own * 2 // 100)  # FRAGMENTATION = 2 %
    assert "allocator caps: decode" in format_plan(serve)
    # --lend-arena: prefill's arena rows are decode's bank; the pools and the cache are as they were
    lent = _plan(cfg, arch, 32 * GiB, **lanes, processes=2, lend_arena=True)
    assert (lent.arena, lent.cache_slots) == (serve.arena, serve.cache_slots)
    own = prefill_scratch + PROCESS_RESERVE
    assert lent.prefill_process == own + -(-own * 2 // 100)
    assert lent.process_budget("decode") + lent.process_budget("prefill") == lent.budget
    assert lent.arena_lendable_slots == 1 + 2 * cfg.num_experts and serve.arena_lendable_slots == 0
    assert f"--lend-arena: {1 + 2 * cfg.num_experts} more slots" in format_plan(lent)
    roomy = _plan(cfg, arch, 1024 * GiB, **lanes, processes=2, lend_arena=True)  # every expert cached
    assert roomy.all_experts_fit and roomy.arena_lendable_slots == 0
    with pytest.raises(ValueError, match="no process"):
        serve.process_budget("router")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the allocator setting itself: tests/gpu")
def test_expandable_segments_join_the_allocator_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Added to what PYTORCH_CUDA_ALLOC_CONF already says; an explicit choice of segments is kept."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    use_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512,expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    use_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    use_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


# -- against the real allocations (the tiny models) ---------------------------------------------------------


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp(request.param), preset="tiny", arch=request.param)


def _dir_plan(model_dir: Path, budget: int = 2 * GiB, **kw) -> MemoryPlan:
    settings = {"max_context": 100, "max_running": 3, "expert_format": "bf16", "dtype": torch.float32}
    return plan_for_dir(model_dir, budget_bytes=budget, **(settings | kw))


def _resident_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.nbytes for t in tensors.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_and_kv_are_what_the_loaded_model_holds(tiny: Path, dtype: torch.dtype) -> None:
    plan = _dir_plan(tiny, dtype=dtype)
    model = load_model(tiny, dtype=dtype)
    assert plan.weights == _resident_bytes(model)  # routed experts and host tables are not counted
    runner = ModelRunner(model, max_running=3, max_context=100, page_size=16)
    assert plan.kv == sum(t.nbytes for t in runner.pool.named_tensors().values())
    assert plan.num_pages == runner.pool.num_pages


def test_mtp_head_is_planned_when_speculating(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / "q4", preset="tiny", arch="qwen4_exp")
    plan = _dir_plan(model_dir, mtp=True)
    model = load_model(model_dir, dtype=torch.float32, with_mtp=True)
    assert plan.weights == _resident_bytes(model) > _dir_plan(model_dir).weights
    assert plan.max_cache_slots == len(model.config.moe_layers) * model.config.num_experts
    runner = ModelRunner(model, max_running=3, max_context=100, page_size=16)
    assert plan.kv == sum(t.nbytes for t in runner.pool.named_tensors().values())


def test_engine_cache_and_arena_are_what_the_plan_says(tiny: Path) -> None:
    """An engine built with the plan's slots allocates exactly the planned cache rows, tables and arena."""
    fit = _dir_plan(tiny, processes=1)
    plan = _dir_plan(tiny, processes=1, budget=fit.min_budget + 5 * fit.expert_bytes)
    assert plan.ok and plan.min_cache_slots < plan.cache_slots < plan.max_cache_slots
    engine = Engine(
        WorkerConfig(str(tiny), max_running=3, max_context=100, expert_cache=str(plan.cache_slots))
    )
    offload = engine.offload
    assert offload.tables.num_slots == plan.cache_slots
    assert sum(t.nbytes for t in offload.pool.values()) == plan.cache_slots * plan.expert_bytes + plan.arena
    tables = _tensors_nbytes(offload.tables) + offload._moved.nbytes + offload.arena.ids.nbytes
    assert plan.expert_cache == plan.cache_slots * plan.expert_bytes + tables
    assert plan.weights == _resident_bytes(engine.model)
    assert plan.kv == sum(t.nbytes for t in engine.runner.pool.named_tensors().values())


def test_an_artifact_is_planned_in_its_own_format(tmp_path: Path) -> None:
    src = make_model(tmp_path / "src", preset="tiny", arch="qwen3_moe")
    convert(src, tmp_path / "fp8", "fp8", log=lambda _: None)
    assert _dir_plan(tmp_path / "fp8", expert_format="bf16").expert_format == "fp8"


def test_decode_sizes_its_cache_from_the_budget(tiny: Path) -> None:
    cfg = WorkerConfig(model_dir=str(tiny), max_running=2, max_context=64, vram_budget=2 * GiB)
    core = DecodeCore(cfg)
    assert core.plan is not None and core.plan.ok
    assert core.cfg.expert_cache == str(core.plan.cache_slots)
    assert core.engine.offload.tables.num_slots == core.plan.cache_slots  # every expert fits: all of them
    offload = (
        core.engine.offload
    )  # a serving decode worker keeps one arena buffer: 1 + E rows beside the slots
    rows = core.plan.cache_slots + 1 + offload.store.num_experts
    assert sum(t.nbytes for t in offload.pool.values()) == rows * core.plan.expert_bytes
    assert core.plan.arena == (arena_rows(offload.store.num_experts, 2)) * core.plan.expert_bytes
    with pytest.raises(ValueError, match="too small"):
        DecodeCore(WorkerConfig(model_dir=str(tiny), vram_budget=64 * MiB))
    with pytest.raises(ValueError, match="not both"):
        DecodeCore(WorkerConfig(model_dir=str(tiny), vram_budget=2 * GiB, expert_cache="0.5"))


def test_kv_lendable_slots_are_about_what_an_engine_lends(tiny: Path) -> None:
    """The plan's `kv_lendable_slots` against an engine with the plan's slots that lends its KV pool (a
    long context, so the pool is mostly idle): the engine's bank, lent at the first stage, is the plan's
    figure up to the chunks the layout cannot use (a few slots)."""
    fit = _dir_plan(tiny, processes=1, max_context=2048)
    plan = _dir_plan(tiny, processes=1, max_context=2048, budget=fit.min_budget + 5 * fit.expert_bytes)
    assert plan.ok and plan.kv_lendable_slots > 0
    engine = Engine(
        WorkerConfig(
            str(tiny), max_running=3, max_context=2048, expert_cache=str(plan.cache_slots), lend_kv=True
        )
    )
    lent = engine.offload.tables.lent
    assert plan.kv_lendable_slots - 4 <= lent <= plan.kv_lendable_slots
