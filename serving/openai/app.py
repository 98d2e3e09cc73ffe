"""The FastAPI application: routes, the API key, errors as OpenAI's JSON, server-sent events."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from serving.openai.backend import TritonBackend
from serving.openai.chat_template import ChatTemplate
from serving.openai.errors import APIError
from serving.openai.logprobs import chat_logprobs, completion_logprobs
from serving.openai.protocol import (StopMatcher, completion_prompt, generation, speculative_metrics, usage)

READY_SECONDS = 0.5


def _ended() -> APIError:
    """A generation whose stream closed without a finish reason: the server ended it (an error while
    answering it), so its text is partial; never a 200 with finish_reason "stop"."""
    return APIError(500, "the server ended the generation without finishing it (see the server's log)")


@dataclass
class ModelInfo:
    name: str
    tokenizer: object               # tokenizers.Tokenizer: usage counts (the ensemble tokenizes the same way)
    max_seq_len: int
    draft_len: int
    chat: ChatTemplate | None
    created: int


def model_info(engine_dir, name: str | None = None) -> ModelInfo:
    from pathlib import Path

    from tokenizers import Tokenizer
    engine_dir = Path(engine_dir)
    meta = json.loads((engine_dir / "config.json").read_text())
    build = meta.get("build", {})
    return ModelInfo(name or engine_dir.resolve().name, Tokenizer.from_file(str(engine_dir / meta["tokenizer"])),
                     int(build.get("max_seq_len", 0)), int(build.get("max_draft_len", 0) or 0),
                     ChatTemplate.from_engine_dir(engine_dir), int((engine_dir / "config.json").stat().st_mtime))


def create_app(info: ModelInfo, backend: TritonBackend, api_key: str | None = None, ready=None):
    """``ready``: an optional extra readiness check (a callable returning bool), e.g. the supervisor's."""
    checked = {"at": -1.0, "ready": False, "refresh": None}   # Triton's readiness on file; its refresh task

    @asynccontextmanager
    async def lifespan(app):
        yield
        if checked["refresh"] is not None:
            checked["refresh"].cancel()
        await backend.close()

    app = FastAPI(title="nemospec OpenAI-compatible API", docs_url=None, redoc_url=None, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    def authorise(request: Request):
        if api_key and request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'")

    async def refresh():
        checked["ready"], checked["at"] = await backend.ready(), time.monotonic()

    async def is_ready(fresh: bool = False) -> bool:
        """Triton's readiness (two gRPC round trips), asked at most every READY_SECONDS: while it was
        ready the answer on file serves the request and a refresh runs beside it, off the request's
        path; awaited while it was not ready and always for /health/ready. The supervisor's check
        (``ready``) every time."""
        if ready is not None and not ready():
            return False
        if fresh or not checked["ready"]:
            await refresh()
        elif time.monotonic() - checked["at"] > READY_SECONDS and checked["refresh"] is None:
            task = asyncio.ensure_future(refresh())
            task.add_done_callback(lambda _: checked.update(refresh=None))
            checked["refresh"] = task
        return checked["ready"]

    async def body_of(request: Request) -> dict:
        authorise(request)
        try:
            body = json.loads(await request.body() or b"null")
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON", "body") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", "body")
        model = body.get("model")
        if model is not None and model != info.name:
            raise APIError(404, f"model '{model}' does not exist; this server serves '{info.name}'", "model")
        if not await is_ready():
            raise APIError(503, "the model is not ready to serve")
        return body

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"})

    @app.get("/health/ready")
    async def health_ready():
        if await is_ready(fresh=True):
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready"}, status_code=503)

    @app.get("/v1/models")
    async def models(request: Request):
        authorise(request)
        return {"object": "list", "data": [{"id": info.name, "object": "model", "created": info.created,
                                             "owned_by": "nemospec", "max_model_len": info.max_seq_len}]}

    def budget(g, prompt_tokens: int) -> int:
        room = info.max_seq_len - prompt_tokens
        if g.max_tokens is None:
            if room < 1:
                raise APIError(400, f"prompt of {prompt_tokens} tokens leaves no room in max_seq_len "
                                    f"{info.max_seq_len}", "messages")
            return room
        return g.max_tokens     # beyond the room the ensemble refuses it naming max_seq_len

    async def run(request: Request, chat: bool):
        body = await body_of(request)
        if chat:
            if info.chat is None:
                raise APIError(400, f"model '{info.name}' has no chat template (tokenizer_config.json "
                                    "chat_template); use /v1/completions", "messages")
            prompt = info.chat.render(body.get("messages"))
        else:
            prompt = completion_prompt(body)
        g = generation(body, prompt, chat)
        prompt_tokens = len(info.tokenizer.encode(prompt).ids)
        stream = backend.generate(g, budget(g, prompt_tokens))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        base = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": info.name}
        if g.stream:
            first = await _first(stream)      # errors before the first byte keep their status
            return StreamingResponse(_events(first, stream, g, base, chat, prompt_tokens),
                                     media_type="text/event-stream")
        text, tokens, reason, last, ids, logprobs = [], 0, "", None, [], []
        stops = StopMatcher(g.stop)
        try:
            async for d in stream:
                held = stops.held
                text.append(stops.feed(d.text))
                n = _counted(d, held, stops)
                tokens, reason, last = tokens + n, d.finish_reason, d
                if g.logprobs:
                    ids, logprobs = ids + (d.ids or [])[:n], logprobs + d.logprobs[:n]
                if stops.matched:
                    reason = "stop"
                    break
        finally:
            await stream.aclose()
        if not reason:
            raise _ended()
        text.append(stops.flush() if not stops.matched else "")
        out, stats = "".join(text), last.stats if last is not None else {}
        chosen = _logprobs(chat, ids, logprobs) if g.logprobs else None
        choice = ({"index": 0, "message": {"role": "assistant", "content": out}, "logprobs": chosen,
                   "finish_reason": reason or "stop"} if chat else
                  {"index": 0, "text": out, "logprobs": chosen, "finish_reason": reason or "stop"})
        return {**base, "choices": [choice], "usage": usage(prompt_tokens, tokens),
                "metrics": speculative_metrics(stats, info.draft_len) if stats else {}}

    def _logprobs(chat: bool, ids, logprobs, offset: int = 0):
        if chat:
            return chat_logprobs(info.tokenizer, ids, logprobs)
        return completion_logprobs(info.tokenizer, ids, logprobs, offset)

    def _counted(d, held: str, stops: StopMatcher) -> int:
        """The tokens of response ``d`` the request generated up to its end: all of them, or where a
        stop string matched inside it, those up to the one that completes the match (a speculative
        response holds a whole step; vLLM counts up to the stop as well). ``held``: the text held back
        before ``d``."""
        if not stops.matched or not d.ids:
            return d.tokens
        for n in range(1, len(d.ids) + 1):
            seen = held + info.tokenizer.decode(d.ids[:n])
            if any(s in seen for s in stops.stops):
                return n
        return d.tokens

    async def _first(stream):
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            return None

    async def _events(first, stream, g, base, chat, prompt_tokens):
        chunk_object = "chat.completion.chunk" if chat else "text_completion"

        def event(choice, **extra):
            return f"data: {json.dumps({**base, 'object': chunk_object, 'choices': [choice] if choice else [], **extra})}\n\n"

        def choice(text, reason=None, logprobs=None):
            if chat:
                return {"index": 0, "delta": {"content": text} if text or reason is None else {}, "logprobs": logprobs,
                        "finish_reason": reason}
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}

        # a text chunk is the same JSON every time but for its text: encoded once, the text spliced in
        head, _, tail = event(choice("\0")).partition(json.dumps("\0"))

        if chat:
            yield event({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
        stops, tokens, reason, last, offset = StopMatcher(g.stop), 0, "", None, 0
        try:
            d = first
            while d is not None:
                held = stops.held
                text = stops.feed(d.text)
                n = _counted(d, held, stops)
                tokens, reason, last = tokens + n, d.finish_reason, d
                if stops.matched:
                    reason = "stop"
                if g.logprobs and n:    # the tokens' log-probabilities ride with the text they make
                    chosen = _logprobs(chat, (d.ids or [])[:n], d.logprobs[:n], offset)
                    offset += sum(len(piece) for piece in chosen.get("tokens", ()))
                    yield event(choice(text, logprobs=chosen))
                elif text:
                    yield head + json.dumps(text) + tail
                if reason:
                    break
                try:
                    d = await stream.__anext__()
                except StopAsyncIteration:
                    d = None
            if not reason:
                raise _ended()
            tail_text = "" if stops.matched else stops.flush()
            if tail_text:
                yield event(choice(tail_text))
            stats = last.stats if last is not None else {}
            metrics = speculative_metrics(stats, info.draft_len) if stats else {}
            yield event(choice("", reason or "stop"), **({} if g.include_usage else {"metrics": metrics}))
            if g.include_usage:
                yield event(None, usage=usage(prompt_tokens, tokens), metrics=metrics)
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            await stream.aclose()
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, chat=True)

    return app
