"""Request fields that OpenAI, vLLM or SGLang define and nemospec cannot honour: accepted at their
neutral value (absent, null, or the value that changes nothing), refused otherwise with a 400 naming
the field. Silently dropping one would answer a different request than the one sent (a JSON
schema not enforced, a stop string returned by vLLM but not here, a min_p cut not made), and the
answer would look as if it had been honoured.

Fields in no table here and not read by ``protocol`` are ignored: they are the ones that do not change
the answer (``user``, ``metadata``, ``store``, ``service_tier``, ``priority``, ``parallel_tool_calls``,
...). OpenAI's own API refuses unknown fields; vLLM ignores them (and logs a warning).
"""
from __future__ import annotations

from serving.openai.errors import bad, shown


def _absent(v) -> bool:
    return v is None


def _empty(v) -> bool:
    """null or an empty list, object or string (``logit_bias: {}`` and ``tools: []`` ask for nothing)."""
    return v is None or (isinstance(v, (list, dict, str)) and not v)


def _false(v) -> bool:
    return v is None or v is False


def _true(v) -> bool:
    return v is None or v is True


def _number_is(target):
    """A numeric neutral value; ``true`` is not 1 here (JSON booleans are not numbers)."""
    return lambda v: v is None or (not isinstance(v, bool) and isinstance(v, (int, float)) and v == target)


def _none_choice(v) -> bool:
    return v is None or v == "none"


_GUIDED = "guided decoding (structured output) is not supported"

#: name -> (is it neutral?, why the server cannot honour another value, the neutral value to name)
REFUSED = {
    # OpenAI's API
    "tools": (_empty, "tool calling is not supported", "[]"),
    "functions": (_empty, "function calling is not supported", "[]"),
    "tool_choice": (_none_choice, "tool calling is not supported", '"none"'),
    "function_call": (_none_choice, "function calling is not supported", '"none"'),
    "logit_bias": (_empty, "logit bias is not supported", "{}"),
    "suffix": (_empty, "insertion after a suffix is not supported", "null"),
    "echo": (_false, "echoing the prompt is not supported", "false"),
    "prompt_logprobs": (_absent, "the prompt's log-probabilities are not returned", "null"),
    "response_format": (lambda v: v is None or v == {"type": "text"}, _GUIDED, '{"type": "text"}'),
    "modalities": (lambda v: v is None or v == ["text"], "only text output", '["text"]'),
    "audio": (_absent, "audio output is not supported", "null"),
    "reasoning_effort": (_absent, "the server has no reasoning-effort control", "null"),
    "verbosity": (_absent, "the server has no verbosity control", "null"),
    "web_search_options": (_absent, "web search is not supported", "null"),
    # vLLM's extensions
    "use_beam_search": (_false, "beam search is not supported", "false"),
    "length_penalty": (_number_is(1), "length penalty (beam search) is not supported", "1"),
    "min_p": (_number_is(0), "min-p sampling is not supported", "0"),
    "stop_token_ids": (_empty, "stop token ids are not supported (use stop strings)", "[]"),
    "include_stop_str_in_output": (_false, "the matched stop string is never returned", "false"),
    "skip_special_tokens": (_true, "special tokens are always left out of the text", "true"),
    "spaces_between_special_tokens": (_true, "special tokens are always left out of the text", "true"),
    "truncate_prompt_tokens": (_absent, "prompts are never truncated", "null"),
    "allowed_token_ids": (_empty, "restricting the vocabulary is not supported", "null"),
    "bad_words": (_empty, "bad words are not supported", "[]"),
    "continue_final_message": (_false, "continuing the final message is not supported", "false"),
    "chat_template": (_absent, "the server renders with the checkpoint's chat template only", "null"),
    "documents": (_empty, "documents for the chat template are not supported", "null"),
    "guided_json": (_absent, _GUIDED, "null"),
    "guided_regex": (_absent, _GUIDED, "null"),
    "guided_choice": (_absent, _GUIDED, "null"),
    "guided_grammar": (_absent, _GUIDED, "null"),
    "structured_outputs": (_absent, _GUIDED, "null"),
    "logits_processors": (_empty, "custom logits processors are not supported", "null"),
    "return_tokens_as_token_ids": (_false, "tokens are returned as text", "false"),
    "return_token_ids": (_false, "token ids are not returned", "false"),
    "thinking_token_budget": (_absent, "the server has no thinking-token budget", "null"),
    "repetition_detection": (_absent, "repetition detection is not supported", "null"),
    "prompt_embeds": (_absent, "prompts are text only", "null"),
    "vllm_xargs": (_empty, "extra sampling arguments are not supported", "null"),
    # SGLang's extensions
    "regex": (_absent, _GUIDED, "null"),
    "ebnf": (_absent, _GUIDED, "null"),
    "json_schema": (_absent, _GUIDED, "null"),
    "no_stop_trim": (_false, "the matched stop string is never returned", "false"),
    "lora_path": (_absent, "LoRA adapters are not supported", "null"),
    "stop_regex": (_empty, "stop regular expressions are not supported (use stop strings)", "null"),
    "custom_logit_processor": (_absent, "custom logits processors are not supported", "null"),
    "custom_params": (_absent, "custom logits processors are not supported", "null"),
    "return_hidden_states": (_false, "hidden states are not returned", "false"),
}

#: fields of the other endpoint, which a client may send to this one expecting them to apply
COMPLETIONS_ONLY_REFUSED = {
    "max_completion_tokens": "a chat field: completions take max_tokens",
}


def refuse_unhonoured(body: dict, chat: bool) -> None:
    """400 naming the first field in ``REFUSED`` (or a chat-only limit sent to completions) that is
    not at its neutral value."""
    for name, (neutral, why, value) in REFUSED.items():
        if name in body and not neutral(body[name]):
            raise bad(name, f"{why}; leave it out or send {value}, got {shown(body[name])}")
    if not chat:
        for name, why in COMPLETIONS_ONLY_REFUSED.items():
            if body.get(name) is not None:
                raise bad(name, why)

