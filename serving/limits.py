"""Bounded input: request limits the ``preprocessing`` model enforces before tokenizing anything.

Triton 2.51 has no flag for the HTTP body or gRPC message size (its gRPC server accepts up to 2 GiB;
``--http-max-input-size`` came in later releases) and segfaults on an HTTP body over ~4 MB, so
``max_body_bytes`` is enforced in front of it (``serving.http_guard``); the others apply to the
tensors a request carries: all its text (``text_input`` + ``stop_words`` + ``bad_words``), the prompt's bytes, and the
number and length of stop/bad words. The prompt's tokens are bounded by the engine's
``max_input_len`` and prompt + ``max_tokens`` by ``max_seq_len`` (errors, never a silent cut).
Each refusal is one line naming the field and the limit's flag; the server keeps serving.
"""
from __future__ import annotations

from builder.errors import NemospecError

#: flag -> (default, help)
LIMITS = {
    "max_body_bytes": (2 << 20, "bytes in an HTTP request body, answered 413 before Triton (Triton 2.51 crashed on "
                                "bodies over ~4 MB: keep it under that)"),
    "max_request_bytes": (1 << 20, "bytes of text in a request: text_input + stop_words + bad_words"),
    "max_prompt_bytes": (64 << 10, "bytes in text_input (checked before tokenizing)"),
    "max_stop_words": (32, "words in stop_words, and in bad_words"),
    "max_stop_word_bytes": (256, "bytes in one stop or bad word"),
}


class LimitError(ValueError):
    """A request over a limit: one line naming the field and the flag."""


def add_limit_args(p) -> None:
    for flag, (default, text) in LIMITS.items():
        p.add_argument(f"--{flag}", type=int, default=default, help=f"at most this many {text} (default {default})")


def limits_from(values: dict | None) -> dict:
    """The limits with defaults filled in; NemospecError naming a flag that is not a positive integer."""
    out = {flag: default for flag, (default, _) in LIMITS.items()}
    for flag, value in (values or {}).items():
        if flag not in LIMITS:
            raise NemospecError(f"limits: unknown limit {flag!r}; known: {', '.join(LIMITS)}")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise NemospecError(f"--{flag}: expected a positive integer, got {value!r}")
        out[flag] = value
    return out


def encode_limits(limits: dict) -> str:
    """As one model-config string parameter: 'flag=value;...'."""
    return ";".join(f"{k}={v}" for k, v in limits_from(limits).items())


def decode_limits(text: str) -> dict:
    return limits_from({k: int(v) for k, v in (item.split("=", 1) for item in (text or "").split(";") if item)})


def _size(value) -> int:
    return len(value) if isinstance(value, (bytes, str)) else len(str(value))


def check_text(limits: dict, text, stop_words=(), bad_words=()) -> None:
    """Raw tensor elements (bytes) of one request, before decoding or tokenizing."""
    total = _size(text) + sum(_size(v) for v in stop_words) + sum(_size(v) for v in bad_words)
    if total > limits["max_request_bytes"]:
        raise LimitError(f"request: {total} bytes of text_input, stop_words and bad_words exceed --max_request_bytes "
                         f"{limits['max_request_bytes']}")
    if _size(text) > limits["max_prompt_bytes"]:
        raise LimitError(f"text_input: {_size(text)} bytes exceed --max_prompt_bytes {limits['max_prompt_bytes']}")


def check_words(limits: dict, field: str, words: list) -> None:
    """``words``: one list (stop_words or bad_words), an element a word."""
    if len(words) > limits["max_stop_words"]:
        raise LimitError(f"{field}: {len(words)} words exceed --max_stop_words {limits['max_stop_words']}")
    longest = max((len(w.encode()) for w in words), default=0)
    if longest > limits["max_stop_word_bytes"]:
        raise LimitError(f"{field}: a word of {longest} bytes exceeds --max_stop_word_bytes "
                         f"{limits['max_stop_word_bytes']}")
