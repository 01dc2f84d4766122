"""What quantization a checkpoint declares, read before anything loads: config.json's `quantization_config`
or ModelOpt's `hf_quant_config.json`.

Supported: none (bf16/fp16/fp32), `quant_method` "fp8" (block-scaled, dequantised at load: loader.py),
ModelOpt's NVFP4 (`quant_method` "modelopt" with `quant_algo` "NVFP4", or hf_quant_config.json's
`quantization.quant_algo`) and "mxfp4" (gpt-oss): their routed experts stay in their bits
(fp4_formats.py); "gptq" and "awq" int4 (int4_config.py) and llm-compressor's "compressed-tensors" (what
ct_scheme.py supports), whose experts stay in their bits too. Any other method or algorithm is a
CheckpointError naming it, its file and key, and the supported list. Ignore lists (`ignore`,
`modules_to_not_convert`, `exclude_modules`) name modules left unquantized: "re:" + a regular expression
(compressed-tensors), a glob with * or ? (ModelOpt, gpt-oss), or a module name that also covers its
submodules.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.model.checkpoint import read_json
from common.model.ct_scheme import CT_METHOD, CT_SUPPORTED, CtScheme, compressed_tensors_scheme
from common.model.errors import CheckpointError
from common.model.int4_config import awq_scheme, gptq_scheme

MODELOPT_FILE = "hf_quant_config.json"
SUPPORTED = ("fp8", "modelopt NVFP4", "mxfp4", "gptq", "awq", *CT_SUPPORTED)
"""What `detect_quantization` accepts, as its errors list it."""
_IGNORE_KEYS = ("ignore", "modules_to_not_convert", "exclude_modules")


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's declared quantization."""

    method: str
    """"none" | "fp8" | "nvfp4" | "mxfp4" | "gptq" | "awq" | "compressed-tensors"."""
    source: Path | None
    """The file that declared it (None for an unquantized checkpoint)."""
    ignore: tuple[str, ...] = ()
    """Module patterns left unquantized, as the file writes them (AWQ's substrings as "re:" patterns)."""
    int4_format: str | None = None
    """GPTQ / AWQ: the expert format's name, with its group size and zero convention ("gptq-g32")."""
    ct: CtScheme | None = None
    """A compressed-tensors checkpoint's scheme."""

    @property
    def expert_format(self) -> str | None:
        """The published expert format whose bits the host store keeps ("nvfp4" | "mxfp4" | a GPTQ or AWQ
        format's name | a compressed-tensors one, e.g. "ct-w4a16"), else None."""
        if self.ct is not None:
            return self.ct.expert_format
        return self.int4_format or (self.method if self.method in ("nvfp4", "mxfp4") else None)

    def quantizes(self, module: str) -> bool:
        """Whether the module (a dotted name, e.g. "model.layers.0.mlp.gate") is stored quantized."""
        return self.method != "none" and not matches_any(self.ignore, module)


def matches_any(patterns: tuple[str, ...] | list[str], module: str) -> bool:
    """Whether an ignore list's patterns (any of the forms above) name the module."""
    return any(_matches(p, module) for p in patterns)


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], module) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(module, pattern)
    return module == pattern or module.startswith(pattern + ".")


def detect_quantization(model_dir: str | Path) -> QuantScheme:
    """The quantization `model_dir` declares; CheckpointError for an unsupported or malformed one."""
    config_path = Path(model_dir) / "config.json"
    modelopt_path = Path(model_dir) / MODELOPT_FILE
    config = read_json(config_path)
    quant = config.get("quantization_config")
    if quant is None and modelopt_path.is_file():
        body = read_json(modelopt_path).get("quantization")
        if not isinstance(body, dict):
            raise CheckpointError("expected an object", modelopt_path, "quantization")
        return _modelopt(body, modelopt_path, "quantization.")
    if quant is None:
        return QuantScheme("none", None)
    if not isinstance(quant, dict):
        raise CheckpointError("expected an object", config_path, "quantization_config")
    method = quant.get("quant_method")
    if method == "fp8":
        return QuantScheme("fp8", config_path, _ignore(quant, config_path, "quantization_config."))
    if method == "mxfp4":
        return QuantScheme("mxfp4", config_path, _ignore(quant, config_path, "quantization_config."))
    if method in ("gptq", "awq"):
        scheme = gptq_scheme if method == "gptq" else awq_scheme
        fmt, ignore = scheme(quant, config_path, _unsupported)
        return QuantScheme(method, config_path, ignore, int4_format=fmt)
    if method == CT_METHOD:
        ct = compressed_tensors_scheme(quant, config, config_path, SUPPORTED)
        return QuantScheme(CT_METHOD, config_path, _ignore(quant, config_path, "quantization_config."), ct=ct)
    if method == "modelopt":
        body = quant.get("quantization", quant)  # some exports nest hf_quant_config.json's body
        return _modelopt(body, config_path, "quantization_config.")
    raise _unsupported(f"quant_method {method!r}", config_path, "quantization_config.quant_method")


def _modelopt(body: dict[str, Any], path: Path, prefix: str) -> QuantScheme:
    algo = body.get("quant_algo")
    if algo != "NVFP4":
        raise _unsupported(f"ModelOpt quant_algo {algo!r}", path, prefix + "quant_algo")
    group = body.get("group_size", 16)
    if group != 16:
        raise CheckpointError(f"NVFP4 group_size {group!r} is not 16", path, prefix + "group_size")
    return QuantScheme("nvfp4", path, _ignore(body, path, prefix))


def _ignore(body: dict[str, Any], path: Path, prefix: str) -> tuple[str, ...]:
    patterns: list[str] = []
    for key in _IGNORE_KEYS:
        value = body.get(key) or []
        if not (isinstance(value, list) and all(isinstance(p, str) for p in value)):
            raise CheckpointError(f"expected a list of module names, got {value!r}", path, prefix + key)
        patterns += value
    return tuple(patterns)


def _unsupported(what: str, path: Path, key: str) -> CheckpointError:
    return CheckpointError(f"{what} is not supported (supported: {', '.join(SUPPORTED)})", path, key)
