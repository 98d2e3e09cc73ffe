"""The JSON of an HTTP ``generate`` / ``generate_stream`` request for the ensemble, checked before
Triton parses it (``serving.http_guard`` calls ``check_generate_body``).

Triton 2.51's HTTP generate extension casts a JSON integer to an INT32 input without a range check
(``"max_tokens": 4294967301`` arrives as 5, a silent wrong answer) and refuses a value of the wrong
JSON type with a message that names its parser's key ``data`` instead of the input
(``Unable to parse 'data': attempt to access JSON non-signed-integer as signed-integer``). Here each
known input gets its JSON type and range checked, with one line naming the field. Triton takes any
other top-level key as a request parameter, which no model reads, so a misspelt or foreign field
(``min_tokens`` for ``min_length``) was silently ignored: a key that is neither an input nor one of
``PARAMETERS`` is refused by name. A key given twice is refused too (Triton reads the first, Python's
``json`` the last: the two disagreed on what was checked).
"""
from __future__ import annotations

import json
import re

from serving.tensors import REQUEST_INPUTS, TEXT_INPUTS

INT32 = (-2**31, 2**31 - 1)
UINT64 = (0, 2**64 - 1)
_KINDS = {"STRING": "string", "INT32": "int32", "UINT64": "uint64", "FP32": "number", "FP16": "number",
          "BOOL": "bool"}
#: ensemble input -> JSON kind (a list of such values is what Triton takes as the input's data), for
#: every input the ensemble declares (serving.tensors)
FIELDS = {t.name: _KINDS[t.dtype] for t in [t for _, t in TEXT_INPUTS.values()] + list(REQUEST_INPUTS)}
#: top-level keys that are not inputs: Triton's request id and parameters object, and the request
#: parameter the speculative model reads (``"speculative": false``: target-only)
PARAMETERS = ("id", "parameters", "speculative")
GENERATE_PATH = re.compile(r"^/v2/models/ensemble(/versions/[^/]+)?/generate(_stream)?/?(\?.*)?$")


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check(name: str, kind: str, value) -> str | None:
    if isinstance(value, list):
        for item in value:
            if isinstance(item, list):
                return f"{name}: expected a {kind} or a flat list of them, got {_short(value)}"
            error = _check(name, kind, item)
            if error:
                return error
        return None
    if kind == "string":
        if not isinstance(value, str):
            return f"{name}: expected a string, got {_short(value)}"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{name}: not valid UTF-8 (a lone surrogate escape)"
        return None
    if kind == "bool":
        return None if isinstance(value, bool) else f"{name}: expected true or false, got {_short(value)}"
    if kind == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"{name}: expected a number, got {_short(value)}"
    low, high = INT32 if kind == "int32" else UINT64
    if not isinstance(value, int) or isinstance(value, bool):
        return f"{name}: expected an integer, got {_short(value)}"
    if not low <= value <= high:
        return f"{name}: {value} is outside the {kind.upper()} range [{low}, {high}]"
    return None


def check_generate_body(body: bytes, streaming: bool = True) -> str | None:
    """None if Triton may parse ``body``; else one line naming the field (or the body).
    ``streaming``: the request came to ``generate_stream``; to ``generate``, a ``stream`` of true
    makes the ensemble answer in several responses, which Triton's ``generate`` reports as an error
    under HTTP 200."""
    twice = []

    def pairs(items):
        seen = set()
        for key, _ in items:
            if key in seen:
                twice.append(key)
            seen.add(key)
        return dict(items)
    try:
        doc = json.loads(body, object_pairs_hook=pairs)
    except (ValueError, UnicodeDecodeError) as e:
        return f"request body: not valid JSON ({e})"
    if not isinstance(doc, dict):
        return f"request body: expected a JSON object, got {_short(doc)}"
    if twice:
        return f"{twice[0]}: given twice in the request body"
    unknown = [key for key in doc if key not in FIELDS and key not in PARAMETERS]
    if unknown:
        return (f"{unknown[0]}: not an input of the ensemble (nor a request parameter nemospec reads); "
                f"its inputs: {', '.join(sorted(FIELDS))}")
    for name, kind in FIELDS.items():
        if name in doc and (error := _check(name, kind, doc[name])):
            return error
    if "parameters" in doc and not isinstance(doc["parameters"], dict):
        return f"parameters: expected a JSON object, got {_short(doc['parameters'])}"
    if not streaming and True in (doc.get("stream") if isinstance(doc.get("stream"), list) else [doc.get("stream")]):
        return "stream: true needs the generate_stream endpoint; generate returns one response"
    return None
