"""OpenAI's log-probability objects for the tokens a request generated. The server returns each
emitted token's log-probability under the distribution it was drawn from (``return_log_probs``) and,
when asked (chat's ``top_logprobs``, completions' ``logprobs`` N), that many most probable tokens of
the same distribution (``top_log_probs``).

A token of a byte-level BPE can be part of a character (one byte of a 2-byte UTF-8 sequence): its
``bytes`` are that byte, not the replacement character its lone decode shows, so a client can join
split characters again, and ``text_offset`` counts the characters of the text before the token."""
from __future__ import annotations

import codecs

from serving.protocol import BYTE_TOKEN   # SentencePiece's byte fallback


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 bytes stand for
    themselves, the other 68 take the code points from 256 upwards, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    others = iter(range(256, 512))
    return {chr(b if b in printable else next(others)): b for b in range(256)}


_BYTE_OF = _byte_alphabet()


def _byte_level(tokenizer) -> bool:
    decoder = getattr(tokenizer, "decoder", None)
    try:
        return decoder is not None and b'"ByteLevel"' in decoder.__getstate__()
    except Exception:   # a tokenizer object without the library's serialised state
        return False


_FACTS: dict[int, tuple] = {}   # id(tokenizer) -> (tokenizer, byte-level?, added ids, anchor); the server has one


def _anchor(tokenizer, added) -> int | None:
    """A plain word token (its text alone is itself, twice is twice) to decode a token after: a
    SentencePiece-style decoder strips the text's first space, so a lone '\u2581the' reads 'the'."""
    for token_id in range(min(tokenizer.get_vocab_size(), 4096)):
        if token_id in added or BYTE_TOKEN.fullmatch(tokenizer.id_to_token(token_id) or ""):
            continue   # a byte token joins a run of byte tokens after it, which decodes as a whole
        text = tokenizer.decode([token_id])
        if text.isalnum() and tokenizer.decode([token_id, token_id]) == text * 2:
            return token_id
    return None


def _facts(tokenizer) -> tuple[bool, frozenset, int | None]:
    """Whether ``tokenizer`` is byte-level, its added tokens' ids and its anchor, read once per
    tokenizer (the library copies its added-tokens table on every call)."""
    entry = _FACTS.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:   # the reference held keeps the id from being reused
        added = frozenset(getattr(tokenizer, "get_added_tokens_decoder", dict)())
        byte_level = _byte_level(tokenizer)
        entry = _FACTS[id(tokenizer)] = (tokenizer, byte_level, added, None if byte_level else _anchor(tokenizer, added))
    return entry[1:]


def token_text(tokenizer, token_id: int, first: bool = False) -> str:
    """The text ``token_id`` adds inside a text: its leading space too, which decoding it alone
    drops where the decoder strips the text's first space (SentencePiece-style tokenizers); as the
    ``first`` token of the text, what decoding it alone gives, as the text itself begins."""
    byte_level, added, anchor = _facts(tokenizer)
    token_id = int(token_id)
    if first or byte_level or anchor is None or token_id in added:
        return tokenizer.decode([token_id])
    head, both = tokenizer.decode([anchor]), tokenizer.decode([anchor, token_id])
    return both[len(head):] if both.startswith(head) else tokenizer.decode([token_id])


def token_bytes(tokenizer, token_id: int, first: bool = False) -> bytes:
    """The UTF-8 bytes ``token_id`` contributes to a decoded text (``first``: as its first token)."""
    byte_level, added, _ = _facts(tokenizer)
    piece = tokenizer.id_to_token(int(token_id))
    if piece is None or int(token_id) in added:
        return tokenizer.decode([int(token_id)]).encode("utf-8")
    if byte_level and all(c in _BYTE_OF for c in piece):
        return bytes(_BYTE_OF[c] for c in piece)
    fallback = BYTE_TOKEN.fullmatch(piece)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    return token_text(tokenizer, token_id, first).encode("utf-8")


class TextOffsets:
    """Characters of the decoded text before each token, across a response's chunks: a character
    split over tokens counts once it is whole. ``tokens``: how many came before. With
    ``begins_text`` the first token reads as it begins a text (decoded alone); else as it reads
    after the prompt (with its leading space), as the answer's text does."""

    def __init__(self, tokenizer, offset: int = 0, begins_text: bool = True):
        self.tokenizer, self.offset, self.tokens, self.begins_text = tokenizer, offset, 0, begins_text
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def firsts(self, ids) -> list[bool]:
        """For each of ``ids``, the chunk's tokens, whether it is the text's first token; then counts them."""
        out = [self.begins_text and self.tokens + i == 0 for i in range(len(ids))]
        self.tokens += len(ids)
        return out

    def take(self, data: bytes) -> int:
        """The offset before ``data``; then moves past it."""
        before = self.offset
        self.offset += len(self._decoder.decode(data))
        return before


def completion_logprobs(tokenizer, ids, logprobs, alternatives=(), offsets: TextOffsets | None = None) -> dict:
    """The legacy completions shape; ``offsets`` carries ``text_offset`` over a stream's chunks. Each
    ``top_logprobs`` entry holds the chosen token and its alternatives, as vLLM's do; keyed by text,
    it keeps one value per text (the chosen token's, else the most probable: two byte-level tokens
    can both decode to the replacement character)."""
    offsets = offsets or TextOffsets(tokenizer)
    firsts = offsets.firsts(ids)
    tokens = [token_text(tokenizer, t, first) for t, first in zip(ids, firsts)]
    tops = list(alternatives) or [()] * len(ids)

    def entry(piece, lp, top, first):
        out = {piece: lp}
        for t, v in top:
            out.setdefault(token_text(tokenizer, t, first), v)
        return out
    return {"tokens": tokens, "token_logprobs": list(logprobs),
            "top_logprobs": [entry(*row) for row in zip(tokens, logprobs, tops, firsts)],
            "text_offset": [offsets.take(token_bytes(tokenizer, t, first)) for t, first in zip(ids, firsts)]}


def chat_logprobs(tokenizer, ids, logprobs, alternatives=(), offsets: TextOffsets | None = None) -> dict:
    """The chat shape: one entry per token, with its ``top_logprobs`` alternatives (most probable
    first); ``offsets`` counts a stream's tokens across its chunks."""
    firsts = (offsets or TextOffsets(tokenizer)).firsts(ids)
    tops = list(alternatives) or [()] * len(ids)

    def entry(token_id, lp, first):
        return {"token": token_text(tokenizer, token_id, first), "logprob": lp,
                "bytes": list(token_bytes(tokenizer, token_id, first))}
    return {"content": [{**entry(t, lp, first), "top_logprobs": [entry(a, v, first) for a, v in top]}
                        for t, lp, top, first in zip(ids, logprobs, tops, firsts)]}
