"""config.json's `quantization_config` of a GPTQ or AWQ checkpoint, read into its expert format's name
(common/model/int4_blocks.py) and the modules it leaves unquantized.

- GPTQ (AutoGPTQ, GPTQModel): `bits` 4, `group_size` (a divisor of the dims, or -1), `desc_act` and `sym`
  (any: the stored g_idx and zeros say it all), `checkpoint_format` "gptq" (the default) or GPTQModel's
  "gptq_v2", `pack_dtype` int32 when given, no `is_marlin_format`; GPTQModel's `dynamic` only with "-:"
  entries (modules skipped), which join the ignore list as regular expressions; `lm_head` any (a quantized
  head loads dequantised like any linear).
- AWQ (AutoAWQ, as transformers reads it): `bits` 4, `group_size`, `zero_point` true, `version` "gemm"
  (any case); `modules_to_not_convert` names matched as substrings of a module's name, as AutoAWQ and
  transformers match them, so they join the ignore list as "re:" patterns.

Anything else is a CheckpointError naming the key.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.model.errors import CheckpointError
from common.model.int4_blocks import int4_format_name

Unsupported = Callable[[str, Path, str], CheckpointError]
"""Makes the error for an unsupported value (its text, the file, the key), naming the supported list."""
_PREFIX = "quantization_config."
GPTQ_FORMATS = ("gptq", "gptq_v2")


def _field(quant: dict[str, Any], key: str, path: Path, default: Any, kind: type | tuple[type, ...]) -> Any:
    value = quant.get(key)
    value = default if value is None else value  # tools write null for a field left at its default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CheckpointError(f"unexpected {key} {value!r}", path, _PREFIX + key)
    return value


def _names(quant: dict[str, Any], key: str, path: Path) -> list[str]:
    value = quant.get(key) or []
    if not (isinstance(value, list) and all(isinstance(p, str) for p in value)):
        raise CheckpointError(f"expected a list of module names, got {value!r}", path, _PREFIX + key)
    return value


def _group(quant: dict[str, Any], path: Path, default: int) -> int:
    group = _field(quant, "group_size", path, default, int)
    if group != -1 and group <= 0:
        raise CheckpointError(f"group_size {group} is neither positive nor -1", path, _PREFIX + "group_size")
    return group


def _bits(quant: dict[str, Any], path: Path, unsupported: Unsupported) -> None:
    bits = quant.get("bits", 4)
    if bits != 4:
        raise unsupported(f"{quant.get('quant_method')} with bits {bits!r}", path, _PREFIX + "bits")


def gptq_scheme(quant: dict[str, Any], path: Path, unsupported: Unsupported) -> tuple[str, tuple[str, ...]]:
    """(expert format name, ignore patterns) of a GPTQ quantization_config."""
    _bits(quant, path, unsupported)
    group = _group(quant, path, 128)
    for flag in ("desc_act", "sym"):
        _field(quant, flag, path, False, bool)
    fmt = quant.get("checkpoint_format", "gptq")
    if fmt not in GPTQ_FORMATS:
        raise unsupported(f"gptq checkpoint_format {fmt!r}", path, _PREFIX + "checkpoint_format")
    if quant.get("is_marlin_format"):
        raise unsupported("gptq in Marlin's layout", path, _PREFIX + "is_marlin_format")
    pack = quant.get("pack_dtype", "int32")
    if pack != "int32":
        raise unsupported(f"gptq pack_dtype {pack!r}", path, _PREFIX + "pack_dtype")
    dynamic = _field(quant, "dynamic", path, {}, dict)
    skipped = []
    for pattern in dynamic:
        if not pattern.startswith("-:"):  # a module quantized differently (bits, group size)
            raise unsupported(f"gptq dynamic override {pattern!r}", path, _PREFIX + "dynamic")
        skipped.append("re:" + pattern.removeprefix("-:"))
    ignore = (*_names(quant, "modules_to_not_convert", path), *skipped)
    return int4_format_name(fmt, group), ignore


def awq_scheme(quant: dict[str, Any], path: Path, unsupported: Unsupported) -> tuple[str, tuple[str, ...]]:
    """(expert format name, ignore patterns) of an AWQ quantization_config."""
    _bits(quant, path, unsupported)
    group = _group(quant, path, 128)
    version = quant.get("version", "gemm")
    if not (isinstance(version, str) and version.lower() == "gemm"):
        raise unsupported(f"awq version {version!r}", path, _PREFIX + "version")
    if quant.get("zero_point", True) is not True:
        raise unsupported("awq without zero_point", path, _PREFIX + "zero_point")
    names = _names(quant, "modules_to_not_convert", path)
    return int4_format_name("awq", group), tuple(f"re:.*{re.escape(n)}.*" for n in names)
