"""The JSON of an HTTP ``generate`` / ``generate_stream`` request for the ensemble, checked before
Triton parses it (``serving.http_guard`` calls ``check_generate_body``).

Triton 2.51's HTTP generate extension casts a JSON integer to an INT32 input without a range check
(``"max_tokens": 4294967301`` arrives as 5, a silent wrong answer) and refuses a value of the wrong
JSON type with a message that names its parser's key ``data`` instead of the input
(``Unable to parse 'data': attempt to access JSON non-signed-integer as signed-integer``). Here each
known input gets its JSON type and range checked, with one line naming the field. Triton takes any
other top-level key as a request parameter, which no model reads, so a misspelt or foreign field
(``runtime_top_k`` for ``top_k``) was silently ignored: a key that is neither an input nor one of
``PARAMETERS`` is refused by name. A key given twice is refused too (Triton reads the first, Python's
``json`` the last: the two disagreed on what was checked), as are a list of several values for a
one-value input (Triton then blamed another input's batch size) and a number JSON cannot hold as a
finite double (``1e400``: Triton's parser answered 500 naming no field). The ``speculative`` model,
which a client may call directly with token ids as the TensorRT-LLM backend's ``tensorrt_llm``
model is called, gets the same checks over its own inputs.
"""
from __future__ import annotations

import json
import math
import re

from serving.tensors import REQUEST_INPUTS, TEXT_INPUTS, Tensor

INT32 = (-2**31, 2**31 - 1)
UINT64 = (0, 2**64 - 1)
_KINDS = {"STRING": "string", "INT32": "int32", "UINT64": "uint64", "FP32": "number", "FP16": "number",
          "BOOL": "bool"}


def _fields(tensors) -> dict:
    """input -> (JSON kind, one value only, nested lists allowed): a list of such values is what
    Triton takes as the input's data."""
    return {t.name: (_KINDS[t.dtype], t.dims == (1,), len(t.dims) > 1) for t in tensors}


#: each model a client may call generate on -> its inputs (serving.tensors, and the speculative
#: model's own in model_repo/speculative/config.pbtxt)
MODEL_FIELDS = {
    "ensemble": _fields([t for _, t in TEXT_INPUTS.values()] + list(REQUEST_INPUTS)),
    "speculative": _fields([Tensor("input_ids", "INT32", (-1,)), Tensor("max_tokens", "INT32"),
                            Tensor("stop_words_ids", "INT32", (2, -1)), Tensor("bad_words_ids", "INT32", (2, -1)),
                            *REQUEST_INPUTS]),
}
FIELDS = MODEL_FIELDS["ensemble"]
#: top-level keys that are not inputs: Triton's request id and parameters object, the request
#: parameter the speculative model reads (``"speculative": false``: target-only), and TensorRT-LLM's
#: ``accumulate_tokens``, which only its BLS model reads: its ensemble, as ours, streams each step's
#: own text whatever it says (vLLM's and SGLang's TensorRT-LLM benchmark clients send it ``true`` to
#: the ensemble and join the chunks)
PARAMETERS = ("id", "parameters", "speculative", "accumulate_tokens")
GENERATE_PATH = re.compile(r"^/v2/models/(ensemble|speculative)(/versions/[^/]+)?/generate(_stream)?/?(\?.*)?$")


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check(name: str, kind: str, value, one: bool = False, nested: bool = False) -> str | None:
    if isinstance(value, list):
        if one and len(value) != 1:
            return f"{name}: expected one {kind}, got a list of {len(value)}"
        for item in value:
            if isinstance(item, list) and not nested:
                return f"{name}: expected a {kind} or a flat list of them, got {_short(value)}"
            error = _check(name, kind, item, nested=nested)
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
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"{name}: expected a number, got {_short(value)}"
        return None if math.isfinite(value) else f"{name}: expected a finite number, got {_short(value)}"
    low, high = INT32 if kind == "int32" else UINT64
    if not isinstance(value, int) or isinstance(value, bool):
        return f"{name}: expected an integer, got {_short(value)}"
    if not low <= value <= high:
        return f"{name}: {value} is outside the {kind.upper()} range [{low}, {high}]"
    return None


def check_generate_body(body: bytes, streaming: bool = True, model: str = "ensemble") -> str | None:
    """None if Triton may parse ``body``; else one line naming the field (or the body).
    ``streaming``: the request came to ``generate_stream``; to ``generate``, a ``stream`` of true
    makes the model answer in several responses, which Triton's ``generate`` reports as an error
    under HTTP 200. ``model``: the ``MODEL_FIELDS`` entry whose inputs the body carries."""
    fields = MODEL_FIELDS[model]
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
    unknown = [key for key in doc if key not in fields and key not in PARAMETERS]
    if unknown:
        return (f"{unknown[0]}: not an input of the {model} (nor a request parameter nemospec reads); "
                f"its inputs: {', '.join(sorted(fields))}")
    for name, (kind, one, nested) in fields.items():
        if name in doc and (error := _check(name, kind, doc[name], one, nested)):
            return error
    if "accumulate_tokens" in doc and not isinstance(doc["accumulate_tokens"], bool):
        return f"accumulate_tokens: expected true or false, got {_short(doc['accumulate_tokens'])}"
    if "parameters" in doc and not isinstance(doc["parameters"], dict):
        return f"parameters: expected a JSON object, got {_short(doc['parameters'])}"
    if not streaming and True in (doc.get("stream") if isinstance(doc.get("stream"), list) else [doc.get("stream")]):
        return "stream: true needs the generate_stream endpoint; generate returns one response"
    return None
