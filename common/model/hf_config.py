"""Read a model directory's config.json (+ generation_config.json) into a ModelConfig."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from common.config import ModelConfig
from common.model.errors import CheckpointError
from common.model.registry import Architecture, get_architecture


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or a CheckpointError naming the file."""
    if not path.is_file():
        raise CheckpointError("file not found", path)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"not valid JSON: {exc}", path) from exc
    if not isinstance(data, dict):
        raise CheckpointError("expected a JSON object", path)
    return data


def load_architecture(model_dir: str | Path) -> tuple[Architecture, ModelConfig]:
    """The architecture and parsed config of the model in `model_dir`."""
    path = Path(model_dir) / "config.json"
    arch, cfg = parse_architecture(read_json(path), path)
    return arch, _with_generation_eos(cfg, Path(model_dir) / "generation_config.json")


def parse_architecture(hf: dict[str, Any], path: Path) -> tuple[Architecture, ModelConfig]:
    """The architecture and parsed config of a config.json dict; errors name `path`."""
    model_type = hf.get("model_type")
    if model_type is None:
        raise CheckpointError("config has no model_type", path, "model_type")
    try:
        arch = get_architecture(model_type)
    except KeyError as exc:
        raise CheckpointError(str(exc.args[0]), path, "model_type") from exc
    try:
        cfg = arch.parse_config(hf)
    except KeyError as exc:
        raise CheckpointError("required field missing", path, str(exc.args[0])) from exc
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"invalid config: {exc}", path) from exc
    return arch, cfg


def _with_generation_eos(cfg: ModelConfig, path: Path) -> ModelConfig:
    """generation_config.json's eos ids extend config.json's (HF generate stops on either)."""
    if not path.is_file():
        return cfg
    eos = read_json(path).get("eos_token_id")
    extra = eos if isinstance(eos, list) else [] if eos is None else [eos]
    merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
    return dataclasses.replace(cfg, eos_token_ids=merged)
