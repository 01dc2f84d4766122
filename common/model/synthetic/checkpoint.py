"""Synthetic MoE checkpoints in the real Hugging Face on-disk format, with deterministic random weights.

They look exactly like the published ones (config.json, per-expert tensor names, sharded safetensors with an
index, a tokenizer). Families: ``qwen3_moe``, ``qwen2_moe``, ``mixtral`` and ``glm4_moe`` (one flat
config.json, weights under ``model.``), ``qwen4_exp`` (nested config.json, text weights under
``model.language_model.``, the PLE table in row shards, ``model.visual.``, ``mtp.``) and ``qwen3_next``
(flat, its Gated DeltaNet input projections fused as ``in_proj_qkvz`` / ``in_proj_ba``).

The families and presets are in presets.py, the config files in config.py, the tensors each family holds
in plan.py; this module draws the values and writes them. ``synthetic_tensors`` yields the same tensors one
at a time, in memory.

Weights are *informative*: logits spread wide and routing is decisive, so comparing two implementations on
logits and greedy tokens is not dominated by near-ties.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from common.model.fp8_blocks import FP8_BLOCK, quantize_fp8_block
from common.model.synthetic.config import generation_config, model_config, resolve_preset, text_config
from common.model.synthetic.ct_checkpoint import CT_QUANTIZE, CtWriter, ct_quantization
from common.model.synthetic.fp4_checkpoint import FP4_QUANTIZE, Fp4Writer, fp4_quantization
from common.model.synthetic.int4_checkpoint import INT4_QUANTIZE, Int4Writer, int4_quantization
from common.model.synthetic.plan import ShardPlan, TensorSpec, plan_shards, plan_tensors
from common.model.synthetic.presets import STORAGE_DTYPES, TOKENIZER_VOCAB
from common.model.synthetic.quantized_linears import converted
from common.progress import progress

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------------------

# A tensor is drawn in chunks of this many elements, chunk i from its own generator, so large tensors are
# drawn in parallel (and identically whatever the number of workers). A tensor of at most one chunk is drawn
# from the key's generator alone, as it always was.
_CHUNK = 1 << 22
# How far (in bytes of generated tensors) the parallel generator may run ahead of its consumer; the tensor
# being consumed may exceed it.
_LOOKAHEAD_BYTES = 1 << 30


def _key_seeds(keys: Sequence[str], seed: int) -> dict[str, int]:
    seeds: dict[str, int] = {}
    taken: set[int] = set()
    for key in keys:
        salt = 0
        value = zlib.crc32(f"{seed}/{key}".encode())
        while value in taken:
            salt += 1
            value = zlib.crc32(f"{seed}/{key}/{salt}".encode())
        taken.add(value)
        seeds[key] = value
    return seeds


def generator_seeds(shards: Sequence[ShardPlan], seed: int) -> dict[str, int]:
    """The ``torch.Generator`` seed of every tensor: a stable hash of (seed, key), distinct across keys.

    The CPU generator (mt19937) only uses the low 32 bits of its seed, so the hash is 32-bit crc32 (stable
    across processes, unlike hash()). With ~20k tensors a collision is possible (~4% for qwen3-30b); it
    would give two same-shaped tensors identical values, so colliding keys are re-hashed with a salt.
    Chunk i > 0 of a tensor larger than one chunk uses crc32 of (this seed, i).
    """
    return _key_seeds([t.key for shard in shards for t in shard.tensors], seed)


_scratch = threading.local()


def _fill(spec: TensorSpec, out: torch.Tensor, seed: int, chunk: int) -> None:
    """Draw chunk ``chunk`` of ``spec`` into ``out`` (a flat slice of the tensor, at most one chunk)."""
    g = torch.Generator().manual_seed(seed if chunk == 0 else zlib.crc32(f"{seed}/{chunk}".encode()))
    n = out.numel()
    if out.dtype == torch.float32:
        values = out
    else:  # draw in float32, then round once: a per-thread buffer saves a fresh allocation per chunk
        buffer = getattr(_scratch, "buffer", None)
        if buffer is None or buffer.numel() < n:
            buffer = _scratch.buffer = torch.empty(max(n, _CHUNK), dtype=torch.float32)
        values = buffer[:n]
    if spec.init == "normal" and spec.mean == 0.0 and n >= 16:
        # Bit for bit randn(n) * std (CPU normal_ rounds z * std once, as mul_ does, for 16+ float32
        # elements) without the elementwise passes, each of which starts an intra-op thread team in every
        # drawing thread (bench/LOG.md, Synthetic checkpoint drawing).
        values.normal_(0.0, spec.std, generator=g)
    elif spec.init == "normal":
        torch.randn(n, generator=g, dtype=torch.float32, out=values).mul_(spec.std).add_(spec.mean)
    elif spec.init == "log_uniform":
        torch.rand(n, generator=g, dtype=torch.float32, out=values)
        values.mul_(spec.high - spec.low).add_(spec.low).log_()
    else:
        raise ValueError(f"{spec.key}: unknown init {spec.init!r}")
    if values is not out:
        out.copy_(values)


def _start(spec: TensorSpec, seed: int, storage: torch.dtype, submit: Any) -> tuple[torch.Tensor, list[Any]]:
    """Allocate ``spec``'s tensor and ``submit(fn, *args)`` the draws of its chunks; return both."""
    if spec.init == "const":
        return torch.tensor(spec.values, dtype=spec.torch_dtype(storage)).reshape(spec.shape), []
    with torch.inference_mode(False):  # worker threads fill it, outside any caller's inference mode
        out = torch.empty(spec.shape, dtype=spec.torch_dtype(storage))
    flat = out.view(-1)
    jobs = [
        submit(_fill, spec, flat[start : start + _CHUNK], seed, start // _CHUNK)
        for start in range(0, spec.numel, _CHUNK)
    ]
    return out, jobs


def _tensor(spec: TensorSpec, generator_seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Draw ``spec`` in this thread (its own generators: any tensor can be produced alone, reruns agree)."""
    out, _ = _start(spec, generator_seed, dtype, lambda fn, *args: fn(*args))
    return out


def _default_workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 32))


def _generate(
    specs: Sequence[TensorSpec], seeds: Mapping[str, int], storage: torch.dtype, workers: int
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """(key, tensor) for ``specs`` in order, the chunks drawn by ``workers`` threads ahead of the consumer."""
    if workers <= 1:
        for spec in specs:
            yield spec.key, _tensor(spec, seeds[spec.key], storage)
        return
    pending: deque[tuple[str, torch.Tensor, list[Future]]] = deque()
    ahead = 0  # bytes allocated for pending tensors
    todo = iter(specs)
    with ThreadPoolExecutor(workers, thread_name_prefix="synthetic") as pool:
        try:
            while True:
                while not pending or ahead < _LOOKAHEAD_BYTES:
                    upcoming = next(todo, None)
                    if upcoming is None:
                        break
                    out, jobs = _start(upcoming, seeds[upcoming.key], storage, pool.submit)
                    pending.append((upcoming.key, out, jobs))
                    ahead += out.nbytes
                if not pending:
                    return
                key, out, jobs = pending.popleft()
                for job in jobs:
                    job.result()
                ahead -= out.nbytes
                yield key, out
        finally:  # the consumer stopped early (or a draw failed): drop the work queued for later tensors
            for _, _, jobs in pending:
                for job in jobs:
                    job.cancel()


def synthetic_tensors(
    config: Mapping[str, Any],
    seed: int = 0,
    *,
    workers: int | None = None,
    keep: Callable[[str], bool] | None = None,
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Yield (HF key, tensor) for every tensor of the checkpoint of ``config``, in checkpoint order.

    ``config`` is a config.json dict (``model_config``'s result). Tensors are in their storage dtype (the
    config's torch_dtype; qwen4_exp's n-gram hash buffers are int64) and equal, bit for bit, what
    ``make_model`` writes for the same config and seed. Nothing is written to disk: a caller can build a
    large checkpoint straight in (GPU) memory, holding only what it keeps. Values are drawn by ``workers``
    threads (default: the CPUs available, at most 32) up to ~1 GiB ahead of the consumer; the values do not
    depend on ``workers``. ``keep(key)`` selects tensors (the others are never drawn; values do not change).
    """
    if config["torch_dtype"] not in STORAGE_DTYPES:
        raise ValueError(f"torch_dtype {config['torch_dtype']!r} not supported")
    specs = plan_tensors(config)
    seeds = _key_seeds([s.key for s in specs], seed)
    if keep is not None:
        specs = [s for s in specs if keep(s.key)]
    storage = STORAGE_DTYPES[config["torch_dtype"]]
    return _generate(specs, seeds, storage, _default_workers() if workers is None else workers)


# ---------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------


def _save_shard(tensors: Mapping[str, torch.Tensor], out: Path, filename: str) -> None:
    tmp = out / (filename + ".tmp")
    save_file(dict(tensors), tmp, metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # safetensors creates files owner-only; checkpoints are shared read-only data
    # Rename last so an interrupted run never leaves a plausible-looking but truncated shard.
    os.replace(tmp, out / filename)


def _remove_stale_weights(out: Path) -> None:
    # A previous run with another shard count would leave files the new index does not mention.
    for f in [
        *out.glob("model-*-of-*.safetensors"),
        out / "model.safetensors",
        out / "model.safetensors.index.json",
    ]:
        f.unlink(missing_ok=True)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def fp8_quantization_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's quantization_config for the FP8 variant of ``cfg``, as Qwen3-FP8 writes it: every
    linear a quantizing tool converts (quantized_linears.py) block-quantized, the other 2-D weights listed
    as not converted."""
    skip = [
        s.key.removesuffix(".weight")
        for s in plan_tensors(cfg)
        if len(s.shape) == 2 and not converted(cfg, s.key, tuple(s.shape))
    ]
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        "modules_to_not_convert": skip,
    }


def _stored(
    cfg: Mapping[str, Any], key: str, tensor: torch.Tensor, quantize: str | None
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors for one planned tensor: itself, or (fp8) its fp8 codes and block scale_inv."""
    if quantize is None or not converted(cfg, key, tuple(tensor.shape)):
        return {key: tensor}
    weight, scale_inv = quantize_fp8_block(tensor)
    return {key: weight, f"{key}_scale_inv": scale_inv}


def make_model(
    out: str | Path,
    preset: str = "tiny",
    arch: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    seed: int = 0,
    shard_bytes: int | None = None,
    quantize: str | None = None,
) -> Path:
    """Write a synthetic checkpoint into ``out`` and return it.

    Writes config.json, generation_config.json, the tokenizer, and the weights as safetensors shards
    (plus model.safetensors.index.json when there is more than one). Shards are generated and saved one at
    a time, so peak memory is about one shard (plus ``synthetic_tensors``' lookahead) whatever the model
    size. ``quantize`` writes a quantized variant as its producing tool does: "fp8" HF block
    FP8 (each linear but the embedding, head and routers; the shards keep the plan's grouping), "nvfp4" /
    "mxfp4" (fp4_checkpoint.py), "gptq" / "gptq-desc-act" / "awq" (int4_checkpoint.py), "w4a16" /
    "w4a16-asym" / "nvfp4a16" (ct_checkpoint.py).
    """
    from common.model.synthetic.tokenizer import check_vision_token_ids, tokenizer_vocab_size, write_tokenizer

    p, arch = resolve_preset(preset, arch)
    if p.plan_only:
        raise ValueError(
            f"preset {preset!r} ({arch}) is for `spillway plan` only: make-model does not write a checkpoint "
            f"of its size (a small one: --preset tiny --arch {arch})"
        )
    allowed = ("fp8", *FP4_QUANTIZE, *INT4_QUANTIZE, *CT_QUANTIZE)
    if quantize not in (None, *allowed):
        raise ValueError(f"quantize={quantize!r} is not supported (only {allowed})")
    if quantize is not None and arch == "qwen3_next":  # its fused GDN projections have no quantized layout
        raise ValueError(f"make-model writes qwen3_next unquantized only, not quantize={quantize!r}")
    cfg = model_config(preset, arch, overrides)
    extra_files: dict[str, Any] = {}
    writer: Fp4Writer | Int4Writer | CtWriter | None = None  # (fp8: `_stored`)
    if quantize == "fp8":
        cfg["quantization_config"] = fp8_quantization_config(cfg)
    elif quantize in INT4_QUANTIZE:
        writer = Int4Writer(cfg, quantize)
        cfg["quantization_config"], extra_files = int4_quantization(cfg, quantize)
    elif quantize in CT_QUANTIZE:
        writer, cfg["quantization_config"] = CtWriter(cfg, quantize), ct_quantization(cfg, quantize)
    elif quantize is not None:
        writer = Fp4Writer(cfg, quantize)
        cfg["quantization_config"], extra_files = fp4_quantization(cfg, quantize)
    shards = plan_shards(cfg, shard_bytes or p.shard_bytes)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    vocab = text_config(cfg)["vocab_size"]
    vision = "vision_config" in cfg
    write_tokenizer(out, vocab_size=min(vocab, TOKENIZER_VOCAB), vision=vision)
    if tokenizer_vocab_size(out) > vocab:
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer's {tokenizer_vocab_size(out)}")
    if vision:
        # The vision tokens are the tokenizer's top five ids. Only a vocabulary larger than the tokenizer's
        # (flashnext keeps the release's ids, past the synthetic tokenizer) may disagree: logged, not raised.
        check_vision_token_ids(out, cfg, strict=vocab <= TOKENIZER_VOCAB)
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", generation_config(cfg))
    for name, body in extra_files.items():
        _write_json(out / name, body)

    _remove_stale_weights(out)
    tensors = synthetic_tensors(cfg, seed)
    weight_map: dict[str, str] = {}
    total = 0
    for n, shard in enumerate(progress(shards, f"writing {out.name}", unit="shard"), 1):
        log.info("writing %s (%d/%d, %.1f MB)", shard.filename, n, len(shards), shard.nbytes / 1e6)
        batch: dict[str, torch.Tensor] = {}
        for spec in shard.tensors:
            key, tensor = next(tensors)
            assert key == spec.key, (key, spec.key)  # the same plan, in the same order
            batch.update(writer.stored(key, tensor) if writer else _stored(cfg, key, tensor, quantize))
        _save_shard(batch, out, shard.filename)
        weight_map.update(dict.fromkeys(batch, shard.filename))
        total += sum(t.nbytes for t in batch.values())
        del batch
    tensors.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(out / "model.safetensors.index.json", index)
    return out
