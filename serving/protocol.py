"""Wire helpers the ``model_repo`` Python models share, kept here so tests reach them without Triton:
stop/bad word lists (an element a word, and TensorRT-LLM's [2, N] id layout), incremental
detokenization for streaming, and the coalescing of queued token events."""
from __future__ import annotations

import os
import re

#: tokens of already-streamed text sent back with each new chunk: an incomplete UTF-8 character spans
#: at most 3 bytes (3 tokens), so 4 tokens of context always reach back past the held-back bytes
#: (a byte-fallback tokenizer's run of byte tokens: back to its start, see stream_window)
CONTEXT_TOKENS = 4
REPLACEMENT = "\ufffd"


def fault(model: str, error: Exception) -> str:
    """A model's message for a request it failed on through no fault of the request (an exception it
    did not expect), in the one form the OpenAI frontend answers with a 500 rather than a 400."""
    return f"{model}: internal error: {type(error).__name__}: {error}"


FAULT = ": internal error: "
#: the speculative model's answer to the requests a stop cuts short (a 503 for the clients: retry)
STOPPING = "the server is shutting down"


def split_words(values) -> list[str]:
    """The words of a ``stop_words`` / ``bad_words`` tensor: each element is one word, commas and line
    breaks included (TensorRT-LLM's preprocessing since it stopped reading each element as a
    comma-separated list, late 2023: ``","`` and ``", "`` are stop words like any other); empty
    elements are skipped, as it skips words that tokenize to nothing."""
    words = []
    for value in values:
        text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
        if text:
            words.append(text)
    return words


def pack_word_ids(lists):
    """Token-id sequences -> int32 [2, N]: row 0 the ids back to back, row 1 each sequence's end
    offset; padded with 0 / -1 (never empty: N >= 1)."""
    import numpy as np
    flat = [t for ids in lists for t in ids]
    ends, total = [], 0
    for ids in lists:
        total += len(ids)
        ends.append(total)
    n = max(1, len(flat), len(ends))
    out = np.zeros((2, n), dtype=np.int32)
    out[1, :] = -1
    out[0, :len(flat)] = flat
    out[1, :len(ends)] = ends
    return out


def unpack_word_ids(array, name: str = "words", vocab: int | None = None) -> tuple[tuple[int, ...], ...]:
    """[2, N] (``pack_word_ids``' layout, TensorRT-LLM's) -> token-id sequences. A malformed array or an
    id outside ``[0, vocab)`` is a ValueError naming ``name``: the words mask logits in a batched
    step, where a bad id would fail every sequence of the batch."""
    import numpy as np
    a = np.asarray(array)
    if a.size == 0 or a.size % 2 or a.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected int32 [2, N] (ids, then each word's end offset), got {a.dtype} "
                         f"{list(a.shape)}")
    a = a.reshape(2, -1)
    words, start = [], 0
    for end in a[1]:
        end = int(end)
        if end < 0:
            break
        if not start <= end <= a.shape[1]:
            raise ValueError(f"{name}: end offsets must not decrease and stay within the {a.shape[1]} ids, got "
                             f"{end} after {start}")
        if end > start:
            word = tuple(int(t) for t in a[0, start:end])
            bad = [t for t in word if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} outside the vocabulary [0, {vocab})")
            words.append(word)
        start = end
    return tuple(words)


#: the longest run of byte-fallback tokens a window reaches back over to begin where the run does
MAX_RUN_CONTEXT = 512
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")   # a byte-fallback token (SentencePiece-style tokenizers)


_BYTE_IDS: dict[int, tuple] = {}   # id(tokenizer) -> (tokenizer, its byte ids): a server has one or two


def byte_fallback_ids(tokenizer) -> dict[int, int]:
    """id -> byte of each byte-fallback token (<0xXX>); empty for a byte-level BPE. Read once per
    tokenizer."""
    entry = _BYTE_IDS.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:   # the reference held keeps the id from being reused
        out = {}
        for token, token_id in tokenizer.get_vocab().items():
            match = BYTE_TOKEN.fullmatch(token)
            if match:
                out[token_id] = int(match.group(1), 16)
        entry = _BYTE_IDS[id(tokenizer)] = (tokenizer, out)
    return entry[1]


def stream_window(emitted, new, byte_ids=()) -> tuple[list[int], int]:
    """What the speculative model sends with ``new`` tokens after ``emitted`` ones were streamed:
    (the last CONTEXT_TOKENS emitted ids + new ids, how many of them were emitted before).

    A byte-fallback decoder renders a run of byte tokens as a whole (one U+FFFD per byte where the
    run is not valid UTF-8), so a window that began inside a run would show its characters as
    U+FFFD: with the tokenizer's ``byte_ids`` the context reaches back to the run's start (at most
    MAX_RUN_CONTEXT ids)."""
    start = max(0, len(emitted) - CONTEXT_TOKENS) if CONTEXT_TOKENS else len(emitted)
    floor = max(0, len(emitted) - MAX_RUN_CONTEXT)
    while start > floor and start < len(emitted) and emitted[start] in byte_ids and emitted[start - 1] in byte_ids:
        start -= 1
    context = list(emitted[start:])
    return context + list(new), len(context)


def text_history(prompt, emitted) -> list[int]:
    """The ids a response's window (``stream_window``) is cut from: the emitted ones, after the
    prompt's last ids while the window could still reach into the prompt. The first tokens then
    read as they do after the prompt, as vLLM primes its detokenizer with the prompt: a
    SentencePiece-style decoder strips a text's first space, so 'the cat' + '▁a' decoded alone
    read 'a' where the text says ' a'."""
    if len(emitted) >= MAX_RUN_CONTEXT:
        return emitted
    return list(prompt[-MAX_RUN_CONTEXT:]) + list(emitted)


def prompt_context(prompt, byte_ids=()) -> list[int]:
    """The prompt's last ids that a whole answer's text is decoded after (``text_history``'s window
    of the prompt alone)."""
    return stream_window(text_history(prompt, ()), (), byte_ids)[0]


def answer_text(tokenizer, prompt, ids) -> str:
    """The whole text of ``ids`` generated after ``prompt``, as the server answers it."""
    before = prompt_context(prompt, byte_fallback_ids(tokenizer))
    return stream_text(tokenizer, before + [int(t) for t in ids], len(before), finished=True)


def _incomplete_tail(ids, byte_ids) -> int:
    """How many of the trailing byte-fallback tokens of ``ids`` are a character still missing bytes."""
    n = 0
    for token_id in reversed(ids[-4:]):
        value = byte_ids.get(token_id)
        if value is None:
            return 0
        n += 1
        if not 0x80 <= value < 0xC0:   # the character's first byte: how long the character is
            need = 2 if 0xC0 <= value < 0xE0 else 3 if 0xE0 <= value < 0xF0 else 4 if 0xF0 <= value < 0xF8 else 1
            return n if need > n else 0
    return 0


def _stable_text(tokenizer, ids, byte_ids, finished: bool) -> str:
    """The decode of ``ids`` less an incomplete last character. A byte-fallback decoder shows a run of
    byte tokens that is not valid UTF-8 as one U+FFFD per byte, the run's whole characters too, so the
    character's tokens are left out of the decode; a byte-level BPE shows it as one trailing U+FFFD."""
    if finished:
        return tokenizer.decode(ids)
    tail = _incomplete_tail(ids, byte_ids)
    text = tokenizer.decode(ids[:len(ids) - tail])
    if not tail and ids and ids[-1] not in byte_ids and text.endswith(REPLACEMENT):
        return text[:-1]
    return text


def stream_text(tokenizer, ids, prefix_len: int, finished: bool) -> str:
    """The text that ``ids[prefix_len:]`` adds after ``ids[:prefix_len]`` was already streamed (the
    window ``stream_window`` made with the tokenizer's ``byte_fallback_ids``).

    An incomplete UTF-8 character at the end is held back until its remaining bytes arrive, so no
    chunk ever splits a character; ``finished`` flushes it.
    """
    ids = [int(t) for t in ids]
    byte_ids = byte_fallback_ids(tokenizer)
    before = _stable_text(tokenizer, ids[:prefix_len], byte_ids, False) if prefix_len else ""
    full = _stable_text(tokenizer, ids, byte_ids, finished)
    if full.startswith(before):
        return full[len(before):]
    # a decoder that is not prefix-stable (rare): fall back to the common prefix
    common = os.path.commonprefix([before, full])
    return full[len(common):]


def coalesce_events(items):
    """The speculative model's queued token events (entry, new ids, finished, info), one per request:
    events that queued while the dispatcher was sending are joined in order (tokens, and the
    log-probabilities and alternatives that go with them; the later event's other info wins), so a busy server sends
    fewer, larger responses instead of falling behind. String entries (control events) pass as
    they are; an event after a request's finished or failed one starts a new item."""
    out, open_ = [], {}
    for item in items:
        entry, new, finished, info = item
        if isinstance(entry, str):
            out.append(item)
            continue
        index = open_.get(id(entry))
        if index is None:
            out.append((entry, list(new), finished, info))
            if not finished and "error" not in info:
                open_[id(entry)] = len(out) - 1
            continue
        _, tokens, _, merged = out[index]
        joined = {**merged, **info}
        for per_token in ("logprobs", "top_logprobs"):
            if per_token in merged or per_token in info:
                joined[per_token] = list(merged.get(per_token) or []) + list(info.get(per_token) or [])
        out[index] = (entry, tokens + list(new), finished, joined)
        if finished or "error" in info:
            del open_[id(entry)]
    return out
