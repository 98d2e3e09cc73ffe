"""``generation_config.json``: the ids generation stops on.

Nemotron 3.5 ships an eos *set* there (``[2, 11]``: end of text and end of turn) while config.json's
scalar ``eos_token_id`` names one of them; stopping on the scalar alone runs chat turns past their
end. :func:`eos_ids` returns that list (or None when the file or the field is absent);
:func:`builder.config.load_config` stops on every id of it and of config.json's field.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from builder.errors import CheckpointError

GENERATION_CONFIG = "generation_config.json"


def eos_ids(directory) -> tuple[int, ...] | None:
    path = Path(directory) / GENERATION_CONFIG
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: invalid JSON ({' '.join(str(e).split())})") from None
    value = data.get("eos_token_id") if isinstance(data, dict) else None
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise CheckpointError(f"{path}: field 'eos_token_id' must be a token id or a non-empty list of them, "
                              f"got {value!r}")
    return tuple(values)


def with_generation_eos(config, directory):
    """``config`` (a NemotronHConfig) stopping on every id of generation_config.json's eos set too."""
    extra = eos_ids(directory)
    if extra is None:
        return config
    own = config.eos_token_id
    own = () if own is None else own if isinstance(own, tuple) else (own,)
    merged = tuple(dict.fromkeys(extra + own))
    out = dataclasses.replace(config, eos_token_id=merged[0] if len(merged) == 1 else merged)
    for name in ("_defaulted", "_dtype_given"):   # what parsing noted beside the fields
        if hasattr(config, name):
            object.__setattr__(out, name, getattr(config, name))
    return out
