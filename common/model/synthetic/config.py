"""A synthetic checkpoint's config.json and generation_config.json: a preset's fields, overridden
(`--set KEY=VALUE`), with qwen4_exp's derived fields filled in and checked."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from common.model.hf_config import parse_architecture
from common.model.synthetic.presets import (
    ARCHITECTURES,
    ARCHS,
    EOS_TOKEN_ID,
    FROZEN_FIELDS,
    PAD_TOKEN_ID,
    PRESETS,
    ROPE_KEYS,
    STORAGE_DTYPES,
    Preset,
)

# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """Parse ``KEY=VALUE`` strings into a dict.

    VALUE is parsed as JSON where it can be (``6`` -> 6, ``false`` -> False, ``[0]`` -> [0],
    ``null`` -> None) and kept as a string otherwise. An item without ``=`` or with an empty key
    raises ValueError naming it.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"malformed override {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def resolve_preset(preset: str, arch: str | None) -> tuple[Preset, str]:
    """Validate (preset, arch); a missing arch means the preset's first one."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    if arch is None:
        return p, p.default_arch
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {list(ARCHS)}")
    if arch not in p.configs:
        raise ValueError(f"preset {preset!r} does not support arch {arch!r}; it supports {list(p.configs)}")
    return p, arch


def model_config(preset: str, arch: str | None, overrides: Mapping[str, Any] | None) -> dict:
    """Return the config.json dict for ``preset``/``arch`` with ``overrides`` applied, without writing.

    The flat families' dict is in the legacy form real checkpoints use (``rope_theta``, ``rope_scaling``,
    ``torch_dtype``) plus ``architectures`` and ``model_type``. qwen4_exp's is the release's nested form
    (see ``_qwen4_config`` for where overrides go).
    """
    p, arch = resolve_preset(preset, arch)
    overrides = dict(overrides or {})
    frozen = sorted(k for k in overrides if k in FROZEN_FIELDS or k.rpartition(".")[2] == "model_type")
    if frozen:
        raise ValueError(f"cannot override {frozen}; pick the family with arch= (one of {list(ARCHS)})")
    if arch == "qwen4_exp":
        cfg = _qwen4_config(p.configs[arch], overrides)
    else:
        cfg = {
            "architectures": [ARCHITECTURES[arch]],
            "model_type": arch,
            "torch_dtype": "bfloat16",
            # The synthetic tokenizer has no BOS; generation stops on <|im_end|> (and <|endoftext|>, see
            # generation_config.json).
            "bos_token_id": None,
            "eos_token_id": EOS_TOKEN_ID,
            **_copy(p.configs[arch]),  # deep copy: callers may mutate the result
            **overrides,
        }
    if cfg["torch_dtype"] not in STORAGE_DTYPES:
        raise ValueError(
            f"torch_dtype {cfg['torch_dtype']!r} not supported; choose one of {list(STORAGE_DTYPES)}"
        )
    parse_architecture(cfg, Path("config.json"))  # the overrides checked as the loader will check them
    return cfg


def _copy(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's fields of a config.json dict: qwen4_exp's ``text_config``, else ``cfg`` itself."""
    return cfg["text_config"] if cfg.get("model_type") == "qwen4_exp" else cfg


def _qwen4_config(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """qwen4_exp's config.json: ``base`` (a preset) with ``overrides``, derived fields filled in, validated.

    An override key goes to the top level where the top level has it (``tie_word_embeddings``,
    ``image_token_id``, ``torch_dtype``; ``tie_word_embeddings`` is mirrored into text_config, where
    transformers also keeps it), into ``text_config.rope_parameters`` for the RoPE keys (``rope_theta``,
    ``partial_rotary_factor``, ``mrope_section``, ...), into ``vision_config`` / ``text_config`` for a dotted
    ``vision_config.KEY`` / ``text_config.KEY``, and into ``text_config`` otherwise.
    """
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES["qwen4_exp"]],
        "model_type": "qwen4_exp",
        **_copy(base),
        "torch_dtype": "bfloat16",
    }
    for key, value in overrides.items():
        value = _copy(value)
        section, dot, sub = key.partition(".")
        text = cfg["text_config"]
        if dot and section in ("text_config", "vision_config"):
            cfg[section][sub] = value
        elif key in cfg:
            cfg[key] = value
            if key in text:
                text[key] = value
        elif key in ROPE_KEYS and key not in text:
            if not isinstance(text.get("rope_parameters"), dict):
                text["rope_parameters"] = {}
            text["rope_parameters"][key] = value
        else:
            text[key] = value

    text, vision = cfg["text_config"], cfg["vision_config"]
    interval = text.get("full_attention_interval", 4)
    text.setdefault(
        "layer_types",
        [
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(text["num_hidden_layers"])
        ],
    )
    rope = text.get("rope_parameters")
    if isinstance(rope, dict):
        rope.setdefault(
            "mrope_section", _mrope_section(text["head_dim"], rope.get("partial_rotary_factor", 1.0))
        )
    vision.setdefault("out_hidden_size", text["hidden_size"])
    _validate_qwen4(text)
    return cfg


def _mrope_section(head_dim: int, partial_rotary_factor: float) -> list[int]:
    """[T, H, W] frequency counts of interleaved M-RoPE, summing to rotary_dim / 2.

    transformers' interleaved layout gives H the frequencies 1, 4, 7, ... below ``3 * section[1]`` and W
    2, 5, 8, ... below ``3 * section[2]``; T keeps the rest. Qwen's (head_dim 256 x 0.25) is [11, 11, 10].
    """
    half = int(head_dim * partial_rotary_factor) // 2
    h, w = len(range(1, half, 3)), len(range(2, half, 3))
    return [half - h - w, h, w]


def _validate_qwen4(text: Mapping[str, Any]) -> None:
    """The invariants the tensor shapes depend on (transformers checks the same ones on load)."""
    n, types = text["num_hidden_layers"], text["layer_types"]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    unknown = sorted(set(types) - {"linear_attention", "full_attention", "indexed_attention"})
    if unknown:
        raise ValueError(f"unsupported qwen4_exp layer_types {unknown}")
    ple_ids = text.get("ple_layer_ids") or []
    bad = [i for i in ple_ids if not 1 <= i <= n or types[i - 1] != "linear_attention"]
    if bad:
        raise ValueError(
            f"ple_layer_ids are one-indexed linear_attention layers in [1, {n}]; {bad} are not "
            f"(with fewer layers, set ple_layer_ids too, e.g. ple_layer_ids=[1] or [])"
        )
    if ple_ids:
        heads = (text["ngram_size"] - 1) * text["heads_per_ngram"]
        if heads <= 0 or text["ple_embed_dim"] % heads:
            raise ValueError(
                f"ple_embed_dim {text['ple_embed_dim']} is not a multiple of the {heads} n-gram heads"
            )
    if any(t != "linear_attention" for t in types):
        missing = [
            k
            for k in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget")
            if text.get(k) is None
        ]
        if missing:
            raise ValueError(f"qwen4_exp attention layers need the QSA indexer fields {missing}")


def generation_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """generation_config.json for ``cfg``: stop tokens and pad only, no sampling defaults."""
    return {
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": [EOS_TOKEN_ID, PAD_TOKEN_ID],
        "pad_token_id": PAD_TOKEN_ID,
    }
