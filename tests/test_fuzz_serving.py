"""Property-based fuzzing (hypothesis) of request fields against a running server, over HTTP generate
and gRPC: wrong types, huge and negative numbers, NaN/inf, empty and very long strings, invalid
UTF-8, unknown fields. Every response is a success or an error naming a field (or, for JSON the
server cannot parse as the input's type, Triton's own parser error: see FIELDLESS); the server stays
up; a good request afterwards returns the same output as before. Example counts are bounded.
"""
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from serving import health, limits
from serving_helpers import (NEEDS_TRITON, PROMPTS, _grpc_inputs, engine_dir, generate, grpc_stream,  # noqa: F401
                          http_post, server)

pytestmark = NEEDS_TRITON
FIELDS = ("text_input", "max_tokens", "temperature", "top_p", "random_seed", "end_id", "stream", "stop_words",
          "bad_words", "speculative", "request", "parameters", "max_seq_len", "max_input_len")
SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

int32s = st.one_of(st.integers(-2**31, 2**31 - 1), st.integers(-3, 8),
                   st.sampled_from([0, -1, 2**31 - 1, -2**31, 2**31, 2**32 + 5, -2**31 - 1]))
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e39, -0.0, 0.5]))
huge = st.one_of(st.integers(-2**70, 2**70), st.sampled_from([2**63, 2**64 - 1, 2**64]))
junk = st.one_of(st.none(), st.booleans(), st.text(max_size=8), st.lists(st.integers(0, 9), max_size=3), numbers,
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
texts = st.one_of(st.text(max_size=40), st.just(""), st.just("x" * 70_000), st.just("é" * 300),
                  st.text(alphabet="ab,\" \n\r", max_size=600))
FIELD_VALUES = {
    "max_tokens": st.one_of(st.integers(1, 4), int32s, huge, junk),
    "temperature": st.one_of(st.floats(0, 2), int32s, huge, junk),
    "top_p": st.one_of(st.floats(0, 1), int32s, junk),
    "random_seed": st.one_of(st.integers(0, 2**64 - 1), int32s, huge, junk),
    "end_id": st.one_of(st.integers(-2, 600), int32s, huge, junk),
    "stream": st.one_of(st.booleans(), junk),
    "stop_words": st.one_of(st.lists(texts, max_size=40), texts, junk),
    "bad_words": st.one_of(st.lists(st.text(max_size=4), max_size=3), junk),
    "unknown_field": junk,
    "parameters": st.one_of(st.fixed_dictionaries({"speculative": junk}), junk),
}


@st.composite
def http_bodies(draw):
    body = {"text_input": draw(st.one_of(texts, junk)), "max_tokens": draw(FIELD_VALUES["max_tokens"]),
            "exclude_input_in_output": True}   # so a success carries at most max_tokens ids
    for name in draw(st.sets(st.sampled_from(sorted(k for k in FIELD_VALUES if k != "max_tokens")), max_size=4)):
        body[name] = draw(FIELD_VALUES[name])
    return body


def _assert_named(status, error, body):
    assert 400 <= status < 500, (status, error, body)
    _assert_not_a_fault(error, body)
    names = FIELDS + tuple(f"'{k}'" for k in body)   # an unknown field is a request parameter to Triton
    assert any(f in error for f in names), (error, body)


def _assert_not_a_fault(error, *request):
    """A bad request's error, not the server failing on it: "speculative" (the model's name and a
    field) would otherwise match the error of a generation that raised."""
    assert "generation failed" not in error, (error, *request)


@pytest.fixture(scope="module")
def before(server):
    status, got = generate(server, text_input=PROMPTS[0], max_tokens=8, exclude_input_in_output=True)
    assert status == 200
    return got["output_ids"]


def _still_serving(server, before):
    assert health.triton_ready(server.http_url)
    status, got = generate(server, text_input=PROMPTS[0], max_tokens=8, exclude_input_in_output=True)
    assert status == 200 and got["output_ids"] == before


@settings(max_examples=60, **SETTINGS)
@given(body=http_bodies())
@example(body={"text_input": "0", "max_tokens": 1, "exclude_input_in_output": True, "stop_words": ["\n0"]})
def test_http_generate_fuzz(server, before, body):
    status, text = http_post(server, "/v2/models/ensemble/generate", body)
    got = json.loads(text)
    if status == 200:
        ids = got["output_ids"] if isinstance(got["output_ids"], list) else [got["output_ids"]]  # one id: a scalar
        limit = max(body["max_tokens"]) if isinstance(body["max_tokens"], list) else body["max_tokens"]
        assert isinstance(got.get("text_output"), str) and 1 <= len(ids) <= limit, got
    else:
        _assert_named(status, got.get("error", ""), body)


def test_http_server_still_serves_the_same_output(server, before):
    _still_serving(server, before)


def test_http_json_types_and_int32_range_are_checked_before_triton(server):
    """Triton 2.51's HTTP JSON parser wraps an integer into INT32 silently (2**32 + 3 arrived as 3) and
    names no field for a wrong JSON type: the guard's check names the field first."""
    for body, needle in [({"max_tokens": 2**32 + 3}, "max_tokens: 4294967299 is outside the INT32 range"),
                         ({"max_tokens": 1.5}, "max_tokens: expected an integer"),
                         ({"end_id": -2**31 - 1}, "end_id: -2147483649 is outside"),
                         ({"random_seed": -1}, "random_seed: -1 is outside the UINT64 range"),
                         ({"temperature": "hot"}, "temperature: expected a number"),
                         ({"stream": 1}, "stream: expected true or false"),
                         ({"stop_words": [["a"]]}, "stop_words: expected a string or a flat list"),
                         ({"text_input": "\ud800"}, "text_input: not valid UTF-8"),
                         ({"parameters": 3}, "parameters: expected a JSON object")]:
        status, got = generate(server, **{"text_input": PROMPTS[0], "max_tokens": 4, **body})
        assert status == 400 and needle in got["error"], (body, got)
    status, text = http_post(server, "/v2/models/ensemble/generate", None)
    assert status == 400 and "request body: expected a JSON object" in text, text


grpc_values = {
    "temperature": st.floats(width=32, allow_nan=True, allow_infinity=True),
    "top_p": st.floats(width=32, allow_nan=True, allow_infinity=True),
    "end_id": st.integers(-2**31, 2**31 - 1),
    "random_seed": st.integers(0, 2**64 - 1),
}


@settings(max_examples=40, **SETTINGS)
@given(text=st.one_of(st.binary(max_size=60), st.just(b"\xff\xfe bad"), st.just("é".encode()[:1]), st.just(b"")),
       max_tokens=st.one_of(st.integers(1, 4), st.integers(-2**31, 2**31 - 1)),
       extra=st.fixed_dictionaries({}, optional=grpc_values),
       stop=st.one_of(st.none(), st.lists(st.binary(max_size=300), max_size=40)),
       wrong_type=st.sampled_from([None, "temperature", "max_tokens"]))
def test_grpc_fuzz(server, before, text, max_tokens, extra, stop, wrong_type):
    fields = dict(extra)
    if stop is not None:
        fields["stop_words"] = (np.array([stop or [b""]], dtype=object), "BYTES")
    if wrong_type == "temperature":
        fields["temperature"] = (np.array([[0.5]], dtype=np.float64), "FP64")
    inputs = _grpc_inputs("", max_tokens, **fields)
    inputs[0].set_data_from_numpy(np.array([[text]], dtype=object))
    if wrong_type == "max_tokens":
        inputs[1] = _typed("max_tokens", np.array([[max_tokens]], dtype=np.int64), "INT64")
    chunks, ids, _, error = grpc_stream(server, None, None, inputs=inputs)
    if error is None:
        assert 1 <= len(ids) <= max_tokens
        assert all(math.isfinite(v) for k, v in extra.items() if k in ("temperature", "top_p"))
    else:
        _assert_not_a_fault(error, text, max_tokens, extra, wrong_type)
        assert any(f in error for f in FIELDS), (error, text, max_tokens, extra, wrong_type)


def _typed(name, array, dtype):
    import tritonclient.grpc as grpcclient
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def test_grpc_server_still_serves_the_same_output(server, before):
    _still_serving(server, before)
    _, ids, _, error = grpc_stream(server, PROMPTS[0], 8)
    assert error is None and ids == before


def test_limits_name_their_flag(server):
    """Each limit over its default: an error naming the field and the flag (max_tokens beyond
    max_seq_len is an error too, never a silent cut)."""
    cases = [({"text_input": "x" * (limits.LIMITS["max_prompt_bytes"][0] + 1)}, "text_input", "--max_prompt_bytes"),
             ({"text_input": "x", "stop_words": ["ab"] * 33}, "stop_words", "--max_stop_words"),
             ({"text_input": "x", "bad_words": ["a" * 257]}, "bad_words", "--max_stop_word_bytes"),
             ({"text_input": "x", "stop_words": ["z" * (1 << 20)]}, "request", "--max_request_bytes"),
             ({"text_input": "x", "max_tokens": 10_000}, "max_tokens", "max_seq_len")]
    for body, field, flag in cases:
        status, got = generate(server, **{"max_tokens": 4, **body})
        assert status == 400 and field in got["error"] and flag in got["error"], got


def test_http_body_over_the_cap_is_refused_before_triton(server, before):
    """Triton 2.51 segfaulted on an HTTP body over ~4 MB (any endpoint): the guard in front of it
    answers 413 naming --max_body_bytes, and the server lives on."""
    for path in ("/v2/models/ensemble/generate", "/v2/models/ensemble/infer"):
        status, text = http_post(server, path, {"text_input": "x", "max_tokens": 4, "junk": "y" * (6 << 20)})
        assert status == 413 and "request body" in text and "--max_body_bytes" in text, text
    _still_serving(server, before)
