"""OpenAI request bodies -> one generation request for the ensemble, and the response shapes.

Fields: ``prompt`` (a string or a one-item list), ``messages``, ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop`` (string or list), ``n`` = 1,
``ignore_eos`` (vLLM's), the penalties, ``top_k`` and ``min_tokens`` (vLLM's names), chat's
``add_generation_prompt`` and ``chat_template_kwargs`` (vLLM's), and nemospec's ``speculative``
(false: this request target-only). Unknown fields, which change nothing (``user``, ``metadata``,
...), are ignored; those the server cannot honour (n > 1, tools, echo, vLLM's min_p,
guided decoding, ...: ``fields.REFUSED``) are 400s naming the field unless at their neutral value.
``logprobs`` (completions: N; chat: true, with ``top_logprobs`` N) returns each chosen token's
log-probability and its N most probable alternatives (up to 20). Per-request speculative-decoding metrics use vLLM's shape:
``metrics.speculative_decoding`` with mean_acceptance_length, draft_acceptance_rate,
acceptance_histogram, num_spec_steps, num_accepted_draft_tokens, num_draft_tokens, num_spec_tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from serving.openai.errors import bad, shown
from serving.openai.fields import refuse_unhonoured
from serving.protocol import stream_text

MAX_STOPS = 4                 # OpenAI's limit on stop sequences
MAX_TOP_LOGPROBS = 20   # vLLM's default max_logprobs (runtime.scheduler's, tested equal)
MAX_CHOICES = 128       # OpenAI's most n; each choice is a request in the server's batch or queue
INT32_MAX = (1 << 31) - 1     # the ensemble's INT32 inputs (max_tokens, top_k, min_length): a larger value wraps


@dataclass
class Generation:
    prompt: str
    max_tokens: int | None            # None: the rest of the context (chat)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    speculative: bool = True
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False    # vLLM's stream_options.continuous_usage_stats: usage in every chunk
    logprobs: bool = False            # each chosen token's log-probability in the response
    top_logprobs: int = 0             # and its this many most probable alternatives
    add_special_tokens: bool = True   # vLLM's: chat defaults to false (the template writes its own)
    limit_field: str = "max_tokens"   # the field max_tokens came from (chat: max_completion_tokens), for errors
    n: int = 1                        # choices: a request each (vLLM's parallel sampling)


def _number(body, name, default, low, high, integer=False, where=None):
    """``body[name]`` checked against [low, high], compared exactly before any conversion to float:
    a JSON integer past a double's range (10**400) is a 400 like any other, not an OverflowError."""
    value, where = body.get(name, default), where or name
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (integer and isinstance(value, float) and not value.is_integer()):
        raise bad(where, f"expected {'an integer' if integer else 'a number'}, got {shown(value)}")
    if (isinstance(value, float) and not math.isfinite(value)) or not low <= value <= high:
        raise bad(where, f"expected a value in [{low}, {high}], got {shown(value)}")
    return int(value) if integer else float(value)


def flag(body, name, default=False, where=None):
    """A boolean; ``where`` names it in the error when it sits inside an object (stream_options)."""
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(where or name, f"expected true or false, got {shown(value)}")
    return value


def _unsupported(body, chat: bool):
    n = _number(body, "n", 1, 1, MAX_CHOICES, integer=True)   # typed: JSON true is not 1 choice
    if _number(body, "best_of", n, 1, INT32_MAX, integer=True) != n:
        raise bad("best_of", f"only best_of = n ({n}) is supported (no ranking of extra choices), "
                             f"got {body.get('best_of')!r}")
    logprobs = body.get("logprobs")
    if chat and not (logprobs is None or isinstance(logprobs, bool)):   # 1 == True: it passed, then was dropped
        raise bad("logprobs", f"expected true or false, got {logprobs!r}")
    if not chat and logprobs is not False:   # completions: the alternatives per token, as vLLM (max_logprobs 20)
        _number(body, "logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
    if chat and _number(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, integer=True) and logprobs is not True:
        raise bad("top_logprobs", "needs logprobs: true")
    refuse_unhonoured(body, chat)


def _wants_logprobs(value, chat: bool) -> bool:
    """chat: ``logprobs: true``; completions: ``logprobs: N`` (validated: an integer, null or false)."""
    return value is True if chat else value is not None and not isinstance(value, bool)


def _top_logprobs(body, chat: bool) -> int:
    """Alternatives per token: chat's ``top_logprobs``; completions' ``logprobs`` N."""
    if chat:
        return int(body.get("top_logprobs") or 0) if body.get("logprobs") is True else 0
    value = body.get("logprobs")
    return 0 if value is None or isinstance(value, bool) else int(value)


def generation(body, prompt: str, chat: bool) -> Generation:
    """The settings shared by both endpoints (the prompt already rendered)."""
    if not isinstance(body, dict):
        raise bad("body", "expected a JSON object")
    _unsupported(body, chat)
    limit = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None else None
    name = "max_completion_tokens" if limit is not None else "max_tokens"
    max_tokens = _number(body, name, None if chat else 16, 1, INT32_MAX, integer=True)
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", "expected a non-empty string or a list of them")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", "expected an object")
    stream = flag(body, "stream")
    if options and not stream:   # as vLLM: an empty object asks for nothing
        raise bad("stream_options", "only allowed with stream: true")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < 1 << 64):
        raise bad("seed", f"expected an integer in [-2^63, 2^64), got {seed!r}")
    if seed is not None:
        seed %= 1 << 64   # vLLM takes signed 64-bit seeds; the ensemble's random_seed is unsigned: two's complement
    return Generation(
        prompt=prompt, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=_number(body, "top_k", 0, -1, INT32_MAX, integer=True) if body.get("top_k") != -1 else 0,
        seed=seed, stop=stops, ignore_eos=flag(body, "ignore_eos"),
        min_tokens=_number(body, "min_tokens", 0, 0, INT32_MAX, integer=True),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 1e-6, 100.0),
        speculative=flag(body, "speculative", True), stream=stream,
        include_usage=flag(options, "include_usage", where="stream_options.include_usage"),
        continuous_usage=flag(options, "continuous_usage_stats", where="stream_options.continuous_usage_stats")
        and flag(options, "include_usage", where="stream_options.include_usage"),   # vLLM's: only with include_usage
        logprobs=_wants_logprobs(body.get("logprobs"), chat), top_logprobs=_top_logprobs(body, chat),
        limit_field=name, n=_number(body, "n", 1, 1, MAX_CHOICES, integer=True),
        add_special_tokens=flag(body, "add_special_tokens", not chat))


def chat_options(body) -> tuple[bool, dict]:
    """vLLM's ``add_generation_prompt`` (default true) and ``chat_template_kwargs`` (extra variables
    for the template, checked by ``ChatTemplate.render``)."""
    add = flag(body, "add_generation_prompt", True)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", f"expected an object, got {kwargs!r}")
    return add, kwargs or {}


def lone_surrogate(value, path: str = "body") -> str | None:
    """The field of ``value`` (a parsed JSON body) holding a string or key with a lone UTF-16
    surrogate escape (``"\\ud800"``): valid JSON, but no Unicode text, so the tokenizer and the
    UTF-8 encoder refuse it. None when there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")   # C speed: a long prompt is not walked character by character
            return None
        except UnicodeEncodeError:
            return path
    if isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    elif isinstance(value, dict):
        for key in value:
            if lone_surrogate(key) is not None:
                return f"{'' if path == 'body' else path + '.'}{key.encode('utf-8', 'backslashreplace').decode()}"
        items = ((key if path == "body" else f"{path}.{key}", v) for key, v in value.items())
    else:
        return None
    return next((found for sub, v in items if (found := lone_surrogate(v, sub)) is not None), None)


def completion_prompt(body) -> str:
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad("prompt", "token-id prompts are not supported; send the text")
        if len(prompt) != 1:
            raise bad("prompt", f"expected a string or a one-item list (batches are not supported), got {len(prompt)} items")
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad("prompt", "expected a non-empty string (token-id prompts are not supported)")
    return prompt


def speculative_metrics(stats: dict, draft_len: int) -> dict:
    """vLLM's per-request speculative-decoding metrics from the ensemble's acceptance outputs. The
    histogram always has num_spec_tokens + 1 buckets (0..K drafts kept), trailing zeros included, as
    vLLM's payload and aiperf's reader of it expect. A request no speculative step ran for
    (``speculative: false``, or one that ended at its first token) has none: it reported K draft
    tokens a step and a mean acceptance length of 0, which no run of steps can have."""
    steps, accepted, drafts = stats["steps"], stats["accepted"], stats["drafts"]
    if not steps:
        return {}
    histogram = list(stats["histogram"])
    histogram += [0] * (draft_len + 1 - len(histogram))
    return {"speculative_decoding": {
        "mean_acceptance_length": 1 + accepted / steps,
        "draft_acceptance_rate": accepted / drafts if drafts else 0.0,
        "acceptance_histogram": histogram,
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafts,
        "num_spec_tokens": draft_len,
    }}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class StopMatcher:
    """OpenAI's stop strings on streamed text, read as if one token came at a time (so the answer does
    not depend on how tokens are grouped into responses): text that could still begin a stop string is
    held back; the text ends before the match that completes first, in the first token through which
    any completes (of several ending there, the one beginning earliest), and the stop string is not
    returned. Text fed before ``min_tokens`` armed the stops ends no match, though it is held back
    like any other (a shorter stop inside the start of a longer one: ``[" ", "  "]``)."""

    def __init__(self, stops):
        self.stops = list(stops)
        self.held = ""
        self.unarmed = 0          # how many leading characters of held were fed unarmed
        self.matched = False
        self.match_tokens = None  # the matching response's tokens through the match (given token ends)

    def feed(self, text: str, armed: bool = True, token_ends=None) -> str:
        """The text that can be sent now. Not ``armed`` (fewer than ``min_tokens`` generated), a stop
        string does not end the text. ``token_ends``: a callable giving where each token of the
        response ends, in characters from the start of ``text`` (see ``token_ends``), asked only at a
        match: without it each character counts as a token."""
        if not self.stops:
            return text
        start = len(self.held)
        self.held += text
        if not armed:
            self.unarmed = len(self.held)
        else:
            cut = self._cut(start, token_ends)
            if cut is not None:
                self.matched = True
                out, self.held, self.unarmed = self.held[:cut], "", 0
                return out
        keep = 0
        for s in self.stops:  # the longest tail that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(self.held)), 0, -1):
                if self.held.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        out = self.held[:len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        self.unarmed = max(0, self.unarmed - len(out))
        return out

    def _cut(self, start: int, token_ends) -> int | None:
        """Where the text ends at the first match completing past the unarmed characters (None: no
        match); sets ``match_tokens`` where ``token_ends`` places that completion in a token."""
        matches = [(i, i + len(s)) for s in self.stops
                   if (i := self.held.find(s, max(0, self.unarmed - len(s) + 1))) >= 0]
        if not matches:
            return None
        first = min(end for _, end in matches)
        through = first
        if token_ends is not None:
            ends = [start + e for e in token_ends()]
            n = next((n for n, e in enumerate(ends, 1) if e >= first), None)
            if n is not None:
                self.match_tokens, through = n, ends[n - 1]
        return min(begin for begin, end in matches if end <= through)

    def flush(self) -> str:
        out, self.held, self.unarmed = self.held, "", 0
        return out


def token_ends(tokenizer, context: list[int], ids: list[int], offset: int = 0) -> list[int]:
    """Where each of ``ids`` (a response's tokens) ends in its text, in characters less ``offset``:
    the text through it decoded after ``context`` (the tokens before, as the server streamed them:
    alone, a token that completes a character split across responses decodes to U+FFFD), less a
    character it leaves incomplete (a U+FFFD there would place the character's end a token early)."""
    return [len(stream_text(tokenizer, context + ids[:n], len(context), finished=False)) - offset
            for n in range(1, len(ids) + 1)]
