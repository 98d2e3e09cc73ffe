"""OpenAI's Responses API (``POST /v1/responses``) on the chat path: a request's ``instructions``
and ``input`` become chat messages rendered with the checkpoint's template, its answer one assistant
message of output text. Stateless, as a server without a store is: what needs a stored response,
tools or reasoning controls is a 400 naming the field, never a silent drop."""
from __future__ import annotations

import logging
import time
import uuid

from serving.openai.errors import APIError, bad, internal_error, shown
from serving.openai.protocol import speculative_metrics, usage

log = logging.getLogger(__name__)

#: fields that read a stored state or ask for what the server cannot do: accepted only at their
#: neutral value (absent, null, empty, or the value named)
_REFUSED = {
    "previous_response_id": ("no response is stored to continue from", lambda v: v is None),
    "conversation": ("no conversation is stored", lambda v: v is None),
    "prompt": ("no stored prompt templates", lambda v: v is None),
    "background": ("background responses are not supported", lambda v: v in (None, False)),
    "tools": ("tool calling is not supported", lambda v: v in (None, [])),
    "tool_choice": ("tool calling is not supported", lambda v: v in (None, "none", "auto")),
    "max_tool_calls": ("tool calling is not supported", lambda v: v is None),
    "reasoning": ("the server has no reasoning controls", lambda v: v is None),
    "include": ("no extra output data (logprobs, reasoning) is returned", lambda v: v in (None, [])),
    "top_logprobs": ("log-probabilities are not returned here (use chat completions)", lambda v: v in (None, 0)),
    "truncation": ("the input is never truncated", lambda v: v in (None, "disabled")),
    "text": ("only plain text output", lambda v: v is None or v == {} or v == {"format": {"type": "text"}}),
    "context_management": ("context management is not supported", lambda v: v in (None, [])),
    "moderation": ("moderation is not supported", lambda v: v is None),
    "image": ("image output is not supported", lambda v: v is None),
    "n": ("one output per response", lambda v: v in (None, 1)),
}
#: fields that change no answer: read by nothing here (``store``: nothing is stored either way)
_IGNORED = ("model", "metadata", "user", "safety_identifier", "service_tier", "store", "parallel_tool_calls",
            "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "stream_options",
            "access_programs")
#: the chat request's fields a responses request may also send (vLLM's extensions among them)
_CHAT_FIELDS = ("temperature", "top_p", "stream", "seed", "top_k", "min_tokens", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "ignore_eos", "speculative", "chat_template_kwargs",
                "add_generation_prompt")


def _text(part, where: str) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text") \
            and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else None
    raise bad(where, f"only text parts (input_text, output_text) are supported, got {shown(kind or part)}")


def _messages(body) -> list[dict]:
    """``instructions`` (a system message first, as OpenAI inserts it) and ``input``: a string (one
    user message) or a list of messages, each with text content."""
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions", f"expected a string, got {shown(instructions)}")
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        return messages + [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad("input", "expected a string or a non-empty list of messages")
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message" or "role" not in item:
            kind = item.get("type") if isinstance(item, dict) else None
            raise bad(where, f"only messages are supported (no tool calls or outputs), got {shown(kind or item)}")
        if not isinstance(item["role"], str) or item["role"] not in ("user", "assistant", "system", "developer"):
            raise bad(f"{where}.role", f"expected user, assistant, system or developer, got {shown(item['role'])}")
        content = item.get("content")
        if isinstance(content, list):
            content = "\n".join(_text(part, f"{where}.content[{j}]") for j, part in enumerate(content))
        elif not isinstance(content, str):
            raise bad(f"{where}.content", f"expected a string or a list of text parts, got {shown(content)}")
        messages.append({"role": item["role"], "content": content})
    return messages


#: the chat request's names for this API's fields, in errors
_NAMES = (("max_completion_tokens", "max_output_tokens"), ("messages", "input"))


def responses_error(e):
    """An error about the chat request ``chat_request`` made, naming this API's fields instead (the
    limit is ``max_output_tokens``; a message of ``input`` is ``input[i]``, after ``instructions``)."""
    message, param = e.message, e.param
    for chat, own in _NAMES:
        message = message.replace(chat, own)
        param = param.replace(chat, own) if param else param
    return type(e)(e.status, message, param, e.kind)


def chat_request(body: dict) -> dict:
    """The chat completions request that ``body`` (a Responses request) asks for."""
    for name, (why, neutral) in _REFUSED.items():
        if name in body and not neutral(body[name]):
            raise bad(name, f"{why}; got {shown(body[name])}")
    known = set(_REFUSED) | set(_IGNORED) | set(_CHAT_FIELDS) | {"input", "instructions", "max_output_tokens"}
    unknown = sorted(k for k in body if k not in known)
    if unknown:   # the chat checks would read a chat field under this API's name as something else
        raise bad(unknown[0], "not a field of the Responses API that this server reads")
    chat = {k: body[k] for k in _CHAT_FIELDS if k in body}
    chat["messages"] = _messages(body)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    return chat


class ResponseShape:
    """The Response object and its stream's events for one answer: one assistant message of text."""

    def __init__(self, body: dict, model: str):
        self.id, self.item = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created, self.model, self.sequence = int(time.time()), model, 0
        self.fields = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                       "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
                       "metadata": body.get("metadata") or {}, "user": body.get("user"),
                       "store": bool(body.get("store", False)),
                       "tool_choice": body.get("tool_choice") or "none"}

    def response(self, status: str, text: str | None = None, finish_reason: str = "", usage=None,
                 metrics=None) -> dict:
        """The Response: ``in_progress`` with no output, or ``completed`` / ``incomplete`` (the token
        limit: ``finish_reason`` "length") with the message and the usage."""
        out = {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
               "status": status, "error": None, "incomplete_details": None, "output": [],
               "parallel_tool_calls": False, "tools": [], "text": {"format": {"type": "text"}},
               "reasoning": None, "truncation": "disabled", "previous_response_id": None, "usage": None,
               **self.fields}
        if text is not None:
            out["output"] = [self.message(text, "incomplete" if finish_reason == "length" else "completed")]
            if finish_reason == "length":
                out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
            out["usage"] = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                            "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                            "output_tokens_details": {"reasoning_tokens": 0}}
            if metrics:
                out["metrics"] = metrics   # nemospec's: the request's speculative decoding, as chat's
        return out

    def message(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [self.part(text)]
        return {"id": self.item, "type": "message", "role": "assistant", "status": status, "content": content}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def event(self, kind: str, **fields) -> str:
        """One server-sent event of the stream, numbered in order."""
        import json
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def opening(self) -> list[str]:
        where = {"item_id": self.item, "output_index": 0, "content_index": 0}
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress")),
                self.event("response.output_item.added", output_index=0, item=self.message(None, "in_progress")),
                self.event("response.content_part.added", **where, part=self.part(""))]

    def delta(self, text: str) -> str:
        return self.event("response.output_text.delta", item_id=self.item, output_index=0, content_index=0,
                          delta=text, logprobs=[])

    def closing(self, text: str, finish_reason: str, usage, metrics) -> list[str]:
        where = {"item_id": self.item, "output_index": 0, "content_index": 0}
        done = self.response("completed", text, finish_reason, usage, metrics)
        return [self.event("response.output_text.done", **where, text=text, logprobs=[]),
                self.event("response.content_part.done", **where, part=self.part(text)),
                self.event("response.output_item.done", output_index=0, item=done["output"][0]),
                self.event(f"response.{done['status']}", response=done)]

    def error(self, body: dict) -> str:
        error = body.get("error", {})
        return self.event("error", code=error.get("type"), message=error.get("message", ""), param=error.get("param"))

    def failed(self, body: dict, text: str) -> list[str]:
        """A generation that failed mid-stream: the ``error`` event, then OpenAI's terminal event
        ``response.failed`` (the Response failed, its message so far incomplete), without which a
        client waiting for the stream's Response got none."""
        error = body.get("error", {})
        out = self.response("failed")
        code = "rate_limit_exceeded" if error.get("code") == 429 else "server_error"   # OpenAI's codes are names
        out["error"] = {"code": code, "message": error.get("message", "")}
        out["output"] = [self.message(text, "incomplete")] if text else []
        return [self.error(body), self.event("response.failed", response=out)]


async def response_events(d, stream, reader, shape: ResponseShape, prompt_tokens: int, stopped, draft_len: int):
    """A Responses stream: the response and its message opened, the text's deltas, then the
    message and the response done (``response.completed``, or ``response.incomplete`` at the
    token limit); an ``error`` event and ``response.failed`` where the generation failed. ``stopped``: told the response a
    stop string matched in (the server counts the request completed)."""
    pieces = []
    for event in shape.opening():
        yield event
    try:
        async for _, text, _ in reader.follow(d, stream, stopped):
            if text:
                pieces.append(text)
                yield shape.delta(text)
        pieces.append(reader.flush())
        for event in shape.closing("".join(pieces), reader.reason, usage(prompt_tokens, reader.tokens),
                                   speculative_metrics(reader.stats(), draft_len) if reader.stats() else {}):
            yield event
    except APIError as e:
        for event in shape.failed(e.body(), "".join(pieces)):
            yield event
    except Exception as e:      # a bug mid-stream: say so, or the client takes the cut text as whole
        log.exception("OpenAI frontend: a stream failed")
        for event in shape.failed(internal_error(e).body(), "".join(pieces)):
            yield event
    finally:
        await stream.aclose()
