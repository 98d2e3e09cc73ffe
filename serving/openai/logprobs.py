"""OpenAI's log-probability objects for the tokens a request generated. The server returns each
emitted token's log-probability under the distribution it was drawn from (``return_log_probs``), not
alternatives: completions take ``logprobs: 0`` and chat ``logprobs: true`` with no ``top_logprobs``."""
from __future__ import annotations


def _pieces(tokenizer, ids) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


def completion_logprobs(tokenizer, ids, logprobs, offset: int = 0) -> dict:
    """The legacy completions shape; ``text_offset`` counts from ``offset`` (the characters of the
    completion before these tokens)."""
    tokens, offsets = _pieces(tokenizer, ids), []
    for piece in tokens:
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": list(logprobs),
            "top_logprobs": [{piece: lp} for piece, lp in zip(tokens, logprobs)], "text_offset": offsets}


def chat_logprobs(tokenizer, ids, logprobs) -> dict:
    """The chat shape: one entry per token, no alternatives."""
    return {"content": [{"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8", "replace")),
                         "top_logprobs": []} for piece, lp in zip(_pieces(tokenizer, ids), logprobs)]}
