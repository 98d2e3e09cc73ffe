"""vLLM's ``/tokenize`` and ``/detokenize``: a prompt or a chat as the server's tokenizer reads it
(a chat rendered with the checkpoint's template, as a chat request is), and ids back to text, so that
a client counts tokens as the server does."""
from __future__ import annotations

from serving.openai.errors import bad
from serving.openai.protocol import chat_options, completion_prompt, flag


def tokenized(body: dict, tokenizer, chat_template, max_model_len: int, check_size=None) -> dict:
    """``body``: vLLM's tokenize request, ``prompt`` or ``messages`` (with ``add_generation_prompt``,
    ``chat_template_kwargs``), ``add_special_tokens`` (default: true for a prompt, false for a chat,
    as the completions and chat endpoints tokenize), ``return_token_strs``. ``check_size``: called
    with the text and its field before it is tokenized."""
    if "messages" in body:
        if chat_template is None:
            raise bad("messages", "the model has no chat template (tokenizer_config.json chat_template)")
        text, field = chat_template.render(body.get("messages"), *chat_options(body)), "messages"
    else:
        text, field = completion_prompt(body), "prompt"
    if check_size is not None:
        check_size(text, field)
    ids = tokenizer.encode(text, add_special_tokens=flag(body, "add_special_tokens", field == "prompt")).ids
    strs = [tokenizer.id_to_token(t) for t in ids] if flag(body, "return_token_strs") else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenized(body: dict, tokenizer) -> dict:
    """``body["tokens"]``: a list of ids of the vocabulary; the text they decode to (special tokens
    left out, as the answers' text leaves them)."""
    tokens, vocab = body.get("tokens"), tokenizer.get_vocab_size()
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad("tokens", "expected a list of token ids")
    outside = next((t for t in tokens if not 0 <= t < vocab), None)
    if outside is not None:
        raise bad("tokens", f"token id {outside} outside the vocabulary [0, {vocab})")
    return {"prompt": tokenizer.decode(tokens)}
