"""Reading config.json values: each field's JSON value checked and converted (integers, numbers
with their infinity spellings, booleans, dtypes, activations, layer patterns and block type lists),
with errors that name the field and the file being read (``SOURCE``)."""
from __future__ import annotations

import contextvars
import json
import math
from typing import Any

from builder.errors import CheckpointError

PATTERN_LETTERS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
BLOCK_TYPE_NAMES = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "attention",
    "full_attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}
DTYPES = ("float32", "float16", "bfloat16")
_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
_INF_STRINGS = {"inf": math.inf, "+inf": math.inf, "infinity": math.inf, "+infinity": math.inf,
                "-inf": -math.inf, "-infinity": -math.inf}
_FLOAT_TAG = "__float__"
_FLOAT_TAG_VALUES = {"Infinity": math.inf, "-Infinity": -math.inf}

# Where validation errors say they come from (a config.json path while load_config runs).
SOURCE: contextvars.ContextVar[str] = contextvars.ContextVar("nemospec_config_source", default="NemotronHConfig")


def fail(message: str) -> CheckpointError:
    return CheckpointError(f"{SOURCE.get()}: {message}")



def check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(f"field '{name}': expected an integer, got {value!r}")


def check_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(f"field '{name}': expected a number, got {value!r}")


# --- JSON value parsing ------------------------------------------------------------------------------
def to_json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        if math.isnan(value):
            return {_FLOAT_TAG: "NaN"}
        return {_FLOAT_TAG: "Infinity" if value > 0 else "-Infinity"}
    if isinstance(value, (tuple, list)):
        return [to_json(v) for v in value]
    return value


def parse_int(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise fail(f"field '{name}': expected an integer, got {json.dumps(value)}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise fail(f"field '{name}': expected an integer, got {show(value)}")


def parse_optional_int(value: Any, name: str) -> int | None:
    return None if value is None else parse_int(value, name)


def parse_float(value: Any, name: str) -> float:
    if isinstance(value, bool):
        raise fail(f"field '{name}': expected a number, got {json.dumps(value)}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict) and set(value) == {_FLOAT_TAG} and value[_FLOAT_TAG] in _FLOAT_TAG_VALUES:
        return _FLOAT_TAG_VALUES[value[_FLOAT_TAG]]
    if isinstance(value, str) and value.strip().lower() in _INF_STRINGS:
        return _INF_STRINGS[value.strip().lower()]
    raise fail(f"field '{name}': expected a number, got {show(value)}")


def parse_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    raise fail(f"field '{name}': expected true or false, got {show(value)}")


def parse_str(value: Any, name: str) -> str:
    if isinstance(value, str) and value:
        return value
    raise fail(f"field '{name}': expected a non-empty string, got {show(value)}")


#: the activations both lowerings implement (builder.backends.torch_backend and trt_dense; tested equal)
ACTIVATIONS = ("relu2", "relu", "silu", "gelu", "softplus", "sigmoid")


def parse_activation(value: Any, name: str) -> str:
    value = parse_str(value, name)
    if value not in ACTIVATIONS:
        raise fail(f"field '{name}': {value!r} is not supported (expected one of {', '.join(ACTIVATIONS)})")
    return value


def parse_eos(value: Any, name: str) -> int | tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if not value:
            raise fail(f"field '{name}': expected an integer or a non-empty list of integers, got []")
        return tuple(parse_int(v, name) for v in value)
    return parse_int(value, name)


def parse_time_step_limit(value: Any, name: str) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise fail(f"field '{name}': expected two numbers [min, max], got {show(value)}")
    return (parse_float(value[0], name), parse_float(value[1], name))


def parse_dtype(value: Any, name: str) -> str:
    if value is None:
        return "float32"
    if isinstance(value, str):
        key = value.strip().lower()
        if key.startswith("torch."):
            key = key[len("torch."):]
        if key in _DTYPE_ALIASES:
            return _DTYPE_ALIASES[key]
    raise fail(f"field '{name}': expected one of {', '.join(DTYPES)}, got {show(value)}")


def parse_kind_list(value: Any, name: str) -> tuple[str, ...]:
    """A list of block type names (ours or transformers' spellings) -> our kind names."""
    if not isinstance(value, (list, tuple)):
        raise fail(f"field '{name}': expected a list of block type names, got {show(value)}")
    kinds = []
    for i, item in enumerate(value):
        if not isinstance(item, str) or item not in BLOCK_TYPE_NAMES:
            raise fail(f"field '{name}': unknown block type {show(item)} at position {i}; expected one of "
                        f"{', '.join(BLOCK_TYPE_NAMES)}")
        kinds.append(BLOCK_TYPE_NAMES[item])
    return tuple(kinds)


def parse_pattern(value: Any, name: str) -> tuple[str, ...]:
    """A hybrid override pattern string ('M', '*', '-', 'E' letters) -> our kind names."""
    if not isinstance(value, str):
        raise fail(f"field '{name}': expected a pattern string of M * - E letters, got {show(value)}")
    kinds = []
    for i, letter in enumerate(value):
        if letter not in PATTERN_LETTERS:
            raise fail(f"field '{name}': unknown layer letter {letter!r} at position {i} (0-based) of "
                        f"{value!r}; expected M (mamba), * (attention), - (mlp) or E (moe)")
        kinds.append(PATTERN_LETTERS[letter])
    return tuple(kinds)


def show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
