"""OpenAI's log-probability objects for the tokens a request generated. The server returns each
emitted token's log-probability under the distribution it was drawn from (``return_log_probs``) and,
when asked (chat's ``top_logprobs``, completions' ``logprobs`` N), that many most probable tokens of
the same distribution (``top_log_probs``).

A token of a byte-level BPE can be part of a character (one byte of a 2-byte UTF-8 sequence): its
``bytes`` are that byte, not the replacement character its lone decode shows, so a client can join
split characters again, and ``text_offset`` counts the characters of the text before the token."""
from __future__ import annotations

import codecs
import re


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 bytes stand for
    themselves, the other 68 take the code points from 256 upwards, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    others = iter(range(256, 512))
    return {chr(b if b in printable else next(others)): b for b in range(256)}


_BYTE_OF = _byte_alphabet()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")   # SentencePiece's byte fallback


def _byte_level(tokenizer) -> bool:
    decoder = getattr(tokenizer, "decoder", None)
    try:
        return decoder is not None and b'"ByteLevel"' in decoder.__getstate__()
    except Exception:   # a tokenizer object without the library's serialised state
        return False


_FACTS: dict[int, tuple] = {}   # id(tokenizer) -> (tokenizer, byte-level?, added token ids); the server has one


def _facts(tokenizer) -> tuple[bool, frozenset]:
    """Whether ``tokenizer`` is byte-level and its added tokens' ids, read once per tokenizer (the
    library copies its added-tokens table on every call)."""
    entry = _FACTS.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:   # the reference held keeps the id from being reused
        added = frozenset(getattr(tokenizer, "get_added_tokens_decoder", dict)())
        entry = _FACTS[id(tokenizer)] = (tokenizer, _byte_level(tokenizer), added)
    return entry[1], entry[2]


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The UTF-8 bytes ``token_id`` contributes to a decoded text."""
    byte_level, added = _facts(tokenizer)
    piece = tokenizer.id_to_token(int(token_id))
    if piece is None or int(token_id) in added:
        return tokenizer.decode([int(token_id)]).encode("utf-8")
    if byte_level and all(c in _BYTE_OF for c in piece):
        return bytes(_BYTE_OF[c] for c in piece)
    fallback = _BYTE_TOKEN.fullmatch(piece)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    return tokenizer.decode([int(token_id)]).encode("utf-8")


class TextOffsets:
    """Characters of the decoded text before each token, across a response's chunks: a character
    split over tokens counts once it is whole."""

    def __init__(self, tokenizer, offset: int = 0):
        self.tokenizer, self.offset = tokenizer, offset
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def bytes_of(self, token_id) -> bytes:
        return token_bytes(self.tokenizer, token_id)

    def take(self, data: bytes) -> int:
        """The offset before ``data``; then moves past it."""
        before = self.offset
        self.offset += len(self._decoder.decode(data))
        return before


def _pieces(tokenizer, ids) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


def completion_logprobs(tokenizer, ids, logprobs, alternatives=(), offsets: TextOffsets | None = None) -> dict:
    """The legacy completions shape; ``offsets`` carries ``text_offset`` over a stream's chunks. Each
    ``top_logprobs`` entry holds the chosen token and its alternatives, as vLLM's do; keyed by text,
    it keeps one value per text (the chosen token's, else the most probable: two byte-level tokens
    can both decode to the replacement character)."""
    offsets = offsets or TextOffsets(tokenizer)
    tokens = _pieces(tokenizer, ids)
    tops = list(alternatives) or [()] * len(ids)

    def entry(piece, lp, top):
        out = {piece: lp}
        for t, v in top:
            out.setdefault(tokenizer.decode([t]), v)
        return out
    return {"tokens": tokens, "token_logprobs": list(logprobs),
            "top_logprobs": [entry(piece, lp, top) for piece, lp, top in zip(tokens, logprobs, tops)],
            "text_offset": [offsets.take(offsets.bytes_of(t)) for t in ids]}


def chat_logprobs(tokenizer, ids, logprobs, alternatives=()) -> dict:
    """The chat shape: one entry per token, with its ``top_logprobs`` alternatives (most probable first)."""
    tops = list(alternatives) or [()] * len(ids)

    def entry(token_id, piece, lp):
        return {"token": piece, "logprob": lp, "bytes": list(token_bytes(tokenizer, token_id))}
    return {"content": [{**entry(t, piece, lp), "top_logprobs": [entry(a, tokenizer.decode([a]), v) for a, v in top]}
                        for t, piece, lp, top in zip(ids, _pieces(tokenizer, ids), logprobs, tops)]}
