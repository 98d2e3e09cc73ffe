"""The FastAPI application: routes, the API key, errors as OpenAI's JSON, server-sent events."""
from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from serving.openai.backend import TritonBackend
from serving.openai.chat_template import ChatTemplate
from serving.openai.errors import APIError, internal_error, shown
from serving.openai.choice import ChoiceReader, merged, summed_stats
from serving.openai.responses import ResponseShape, chat_request, response_events, responses_error
from serving.openai.tokenize import detokenized, tokenized
from serving.openai.vllm_metrics import CONTENT_TYPE, metrics_text
from serving.openai.protocol import (chat_options, completion_prompt, generation, lone_surrogate,
                                     speculative_metrics, usage)
from serving.http_guard import DRAIN_BYTES
from serving.limits import limits_from

READY_SECONDS = 0.5
METRICS_SECONDS = 5.0            # the longest /metrics waits for Triton's
DISCONNECT_POLL_SECONDS = 0.25   # how often a non-streamed request looks for its client having gone
log = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    name: str
    tokenizer: object               # tokenizers.Tokenizer: usage counts (the ensemble tokenizes the same way)
    max_seq_len: int
    draft_len: int
    chat: ChatTemplate | None
    created: int
    max_input_len: int = 0          # the engine's longest prompt (0: not known, not checked here)


def _scrape(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=METRICS_SECONDS) as answer:
        return answer.read().decode()


def model_info(engine_dir, name: str | None = None) -> ModelInfo:
    from pathlib import Path

    from tokenizers import Tokenizer
    engine_dir = Path(engine_dir)
    meta = json.loads((engine_dir / "config.json").read_text())
    build = meta.get("build", {})
    return ModelInfo(name or engine_dir.resolve().name, Tokenizer.from_file(str(engine_dir / meta["tokenizer"])),
                     int(build.get("max_seq_len", 0)), int(build.get("max_draft_len", 0) or 0),
                     ChatTemplate.from_engine_dir(engine_dir), int((engine_dir / "config.json").stat().st_mtime),
                     int(build.get("max_input_len", 0) or 0))


def create_app(info: ModelInfo, backend: TritonBackend, api_key: str | None = None, ready=None, limits=None,
               metrics_url=None):
    """``ready``: an optional extra readiness check (a callable returning bool), e.g. the supervisor's;
    ``limits``: the request limits of ``serving.limits`` (the body's and the prompt's bytes apply here,
    before anything is tokenized: tokenizing holds the GIL, so a 30 MB prompt stalled every endpoint);
    ``metrics_url``: Triton's metrics URL (or a callable giving it: a restart may move it), which
    ``/metrics`` serves with vLLM's names added (``serving.openai.vllm_metrics``)."""
    limits = limits_from(limits)
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

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        """An unknown path or method: OpenAI's error JSON too, not FastAPI's {"detail": ...}, which
        OpenAI clients read no message from."""
        return JSONResponse(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}").body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request, e: Exception):
        """A bug while answering: a 500 in OpenAI's error JSON (Starlette logs the traceback), not a
        plain-text "Internal Server Error"."""
        return JSONResponse(internal_error(e).body(), status_code=500)

    def authorise(request: Request):
        if api_key and not hmac.compare_digest(request.headers.get("authorization", "").encode(),
                                               f"Bearer {api_key}".encode()):   # constant time: no timing oracle
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

    async def read_body(request: Request) -> bytes:
        """The body, refused with 413 past --max_body_bytes (by its Content-Length, or as it arrives).
        The rest of a refused body is read and dropped (up to DRAIN_BYTES), so that the client, still
        sending, sees the 413 rather than a broken pipe."""
        most, raw, seen = limits["max_body_bytes"], bytearray(), 0
        length = request.headers.get("content-length", "")
        over = length.isdigit() and int(length) > most
        async for chunk in request.stream():
            seen += len(chunk)
            over = over or seen > most
            if over and seen > DRAIN_BYTES:
                break
            if not over:
                raw += chunk
        if over:
            told = f"{length} bytes exceed" if length.isdigit() else "more bytes than"
            raise APIError(413, f"request body: {told} --max_body_bytes {most}", "body")
        return bytes(raw)

    async def body_of(request: Request, generating: bool = True) -> dict:
        """The request's JSON object, checked; ``generating``: it asks the model for tokens, so the key
        (``--api_key``) and a ready model are needed (vLLM's tokenizer endpoints need neither)."""
        if generating:
            authorise(request)
        try:
            body = json.loads(await read_body(request) or b"null")
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON", "body") from None
        except RecursionError:      # nested deeper than the parser goes: a bad body, not a server error
            raise APIError(400, "the request body is nested too deeply", "body") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", "body")
        where = lone_surrogate(body)
        if where is not None:
            raise APIError(400, f"{where}: not valid Unicode text (a lone surrogate escape \\ud800-\\udfff)", where)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise APIError(400, f"model: expected a string, got {shown(model)}", "model")
        if model is not None and model != info.name:
            raise APIError(404, f"model '{model}' does not exist; this server serves '{info.name}'", "model")
        if generating and not await is_ready():
            raise APIError(503, "the model is not ready to serve")
        return body

    def check_prompt_bytes(prompt: str, field: str) -> None:
        size = len(prompt.encode())
        if size > limits["max_prompt_bytes"]:   # as the ensemble refuses text_input, but before tokenizing it
            raise APIError(400, f"{field}: prompt of {size} bytes exceeds --max_prompt_bytes {limits['max_prompt_bytes']}",
                           field)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return tokenized(await body_of(request, generating=False), info.tokenizer, info.chat, info.max_seq_len,
                         check_prompt_bytes)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return detokenized(await body_of(request, generating=False), info.tokenizer)

    @app.get("/version")
    async def version():
        try:
            return {"version": importlib.metadata.version("nemospec")}
        except importlib.metadata.PackageNotFoundError:   # a checkout on sys.path, not installed
            return {"version": "unknown"}

    @app.get("/health")
    async def health():
        """vLLM's: 503 once the engine cannot serve (vLLM's engine dead; here the supervisor's
        answer, read from the process table at this moment, no Triton round trip), else 200. A
        readiness probe copied from a vLLM deployment routed requests into a restart's 503s."""
        if ready is not None and not ready():
            return JSONResponse({"status": "not ready"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/health/ready")
    async def health_ready():
        if await is_ready(fresh=True):
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready"}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        """vLLM's ``/metrics`` on the same port (open, as vLLM's is): the server's metrics with the
        families that mean what vLLM's do under vLLM's names. 503 while Triton's cannot be read
        (a scrape then fails, as it should)."""
        url = metrics_url() if callable(metrics_url) else metrics_url
        if not url:
            return Response("no metrics endpoint: the frontend was started without one\n", status_code=503,
                            media_type="text/plain")
        try:
            text = await asyncio.to_thread(_scrape, url)
        except OSError as e:
            return Response(f"{url}: {e}\n", status_code=503, media_type="text/plain")
        return Response(metrics_text(text, info.name), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": info.name, "object": "model", "created": info.created, "owned_by": "nemospec",
                "max_model_len": info.max_seq_len}

    @app.get("/v1/models")
    async def models(request: Request):
        authorise(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        """OpenAI's retrieve (``client.models.retrieve``): the served model, or a 404."""
        authorise(request)
        if model_id != info.name:
            raise APIError(404, f"model '{model_id}' does not exist; this server serves '{info.name}'", "model")
        return model_card()

    def budget(g, prompt_tokens: int, prompt_field: str) -> int:
        """The tokens the request may generate: its limit, or the rest of max_seq_len. A limit past
        that room is refused here, naming the field the client sent: the ensemble takes max_tokens as
        INT32 (a larger one wrapped to a negative number in its answer) and names only max_tokens."""
        room = info.max_seq_len - prompt_tokens
        if info.max_input_len and prompt_tokens > info.max_input_len:   # the ensemble's error names its own field
            raise APIError(400, f"{prompt_field}: prompt of {prompt_tokens} tokens exceeds the engine's max_input_len "
                                f"{info.max_input_len}", prompt_field)
        if room < 1:
            raise APIError(400, f"{prompt_field}: prompt of {prompt_tokens} tokens leaves no room in max_seq_len "
                                f"{info.max_seq_len}", prompt_field)
        limit = room if g.max_tokens is None else g.max_tokens
        if limit > room:
            raise APIError(400, f"{g.limit_field}: prompt ({prompt_tokens} tokens) + {g.limit_field} ({limit}) "
                                f"exceeds max_seq_len {info.max_seq_len}", g.limit_field)
        if g.min_tokens > limit:    # as vLLM: a minimum the request can never reach is a contradiction
            raise APIError(400, f"min_tokens: {g.min_tokens} is more than the {limit} tokens the request may "
                                "generate", "min_tokens")
        return limit

    def start(body: dict, chat: bool):
        """A request's generation settings, prompt ids, and its choices' Triton streams and readers."""
        if chat:
            if info.chat is None:
                raise APIError(400, f"model '{info.name}' has no chat template (tokenizer_config.json "
                                    "chat_template); use /v1/completions", "messages")
            prompt = info.chat.render(body.get("messages"), *chat_options(body))
        else:
            prompt = completion_prompt(body)
        field = "messages" if chat else "prompt"
        check_prompt_bytes(prompt, field)
        g = generation(body, prompt, chat)
        prompt_ids = info.tokenizer.encode(prompt, add_special_tokens=g.add_special_tokens).ids
        limit = budget(g, len(prompt_ids), field)
        # vLLM's parallel sampling: a request per choice, choice i seeded seed + i where a seed is given
        each = [g if g.seed is None or not i else replace(g, seed=(g.seed + i) % (1 << 64)) for i in range(g.n)]
        streams = [backend.generate(one, limit) for one in each]
        readers = [ChoiceReader(info.tokenizer, one, prompt_ids, chat, i) for i, one in enumerate(each)]
        return g, prompt_ids, streams, readers

    async def opened(streams):
        """Each stream's first response: errors before the first byte keep their status. Where one
        fails (a choice refused by a full queue), the others' first reads are cancelled before every
        stream is closed (a stream cannot be closed while a read of it runs)."""
        tasks = [asyncio.ensure_future(_first(s)) for s in streams]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await _close(streams)
            raise

    async def run(request: Request, chat: bool):
        g, prompt_ids, streams, readers = start(await body_of(request), chat)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        base = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": info.name}
        if g.stream:
            return StreamingResponse(_events(await opened(streams), streams, readers, g, base, chat, len(prompt_ids)),
                                     media_type="text/event-stream")
        return await unless_gone(request, _whole(streams, readers, g, base, chat, len(prompt_ids)))

    @app.post("/v1/responses")
    async def responses(request: Request):
        """OpenAI's Responses API on the chat path (``serving.openai.responses``)."""
        body = await body_of(request)
        shape = ResponseShape(body, info.name)
        chat_body = chat_request(body)
        try:
            g, prompt_ids, (stream,), (reader,) = start(chat_body, chat=True)
        except APIError as e:   # named as the chat request it became: named as this API's fields
            raise responses_error(e) from None
        if g.stream:
            (first,) = await opened([stream])
            return StreamingResponse(response_events(first, stream, reader, shape, len(prompt_ids),
                                                     backend.stopped, info.draft_len),
                                     media_type="text/event-stream")
        whole = await unless_gone(request, _whole([stream], [reader], g, {}, True, len(prompt_ids)))
        if isinstance(whole, Response):   # the client left
            return whole
        choice = whole["choices"][0]
        return shape.response("completed", choice["message"]["content"], choice["finish_reason"], whole["usage"],
                              whole["metrics"])


    async def unless_gone(request: Request, work):
        """Awaits ``work``, or cancels it once the client has disconnected (a client's timeout left a
        full-length generation holding a batch slot): leaving the stream cancels the gRPC call."""
        task = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return Response(status_code=499)   # nobody reads it: nginx's "client closed request"

    async def _close(streams):
        """Closes each stream (which cancels its request on the server), the rest after one that fails."""
        for stream in streams:
            try:
                await stream.aclose()
            except Exception:
                log.exception("OpenAI frontend: closing a stream failed")

    def _metrics(stats: dict) -> dict:
        return speculative_metrics(stats, info.draft_len) if stats else {}

    async def _whole(streams, readers, g, base, chat: bool, prompt_tokens: int) -> dict:
        """A non-streamed answer: every response of each choice's stream read, stop strings applied."""
        tasks = [asyncio.ensure_future(_whole_choice(s, r, g, chat)) for s, r in zip(streams, readers)]
        try:
            choices = await asyncio.gather(*tasks)
        except BaseException:   # one choice failed (or the client left): the others end too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return {**base, "choices": list(choices), "usage": usage(prompt_tokens, sum(r.tokens for r in readers)),
                "metrics": _metrics(summed_stats([r.stats() for r in readers]))}

    async def _whole_choice(stream, reader: ChoiceReader, g, chat: bool) -> dict:
        text, ids, logprobs, alternatives = [], [], [], []
        try:
            async for d, piece, n in reader.follow(await _first(stream), stream, backend.stopped):
                text.append(piece)
                if g.logprobs:
                    ids.extend((d.ids or [])[:n])
                    logprobs.extend(d.logprobs[:n])
                    alternatives.extend(d.alternatives[:n])
        finally:
            await stream.aclose()
        out = "".join(text) + reader.flush()
        chosen = reader.logprobs(ids, logprobs, alternatives) if g.logprobs else None
        if chat:
            return {"index": reader.index, "message": {"role": "assistant", "content": out}, "logprobs": chosen,
                    "finish_reason": reader.reason}
        return {"index": reader.index, "text": out, "logprobs": chosen, "finish_reason": reader.reason}

    async def _first(stream):
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            return None

    async def _events(firsts, streams, readers, g, base, chat, prompt_tokens):
        chunk_object = "chat.completion.chunk" if chat else "text_completion"

        def event(choice, reader=None, **extra):
            """One chunk; with vLLM's ``continuous_usage_stats`` each carries its choice's usage so far
            (``reader``'s tokens, as vLLM counts each choice's own), and with ``include_usage`` alone a
            null one (OpenAI's chunks before the usage chunk, which sums the choices)."""
            so_far = ({"usage": usage(prompt_tokens, reader.tokens if reader is not None else 0)}
                      if g.continuous_usage else {"usage": None} if g.include_usage else {})
            chunk = {**base, "object": chunk_object, "choices": [choice] if choice else [], **so_far, **extra}
            return f"data: {json.dumps(chunk)}\n\n"

        def choice(index, text, reason=None, logprobs=None):
            if chat:
                return {"index": index, "delta": {"content": text} if text or reason is None else {},
                        "logprobs": logprobs, "finish_reason": reason}
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

        async def chunks(d, stream, reader: ChoiceReader):
            """One choice's chunks, its finish reason's last."""
            i = reader.index
            # a text chunk is the same JSON every time but for its text: encoded once, the text spliced
            # in (not with usage in every chunk: that changes from chunk to chunk)
            head, _, tail = event(choice(i, "\0"), reader).partition(json.dumps("\0"))
            if chat:
                yield event({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}, reader)
            async for d, text, n in reader.follow(d, stream, backend.stopped):
                if g.logprobs and n:    # the tokens' log-probabilities ride with the text they make
                    chosen = reader.logprobs((d.ids or [])[:n], d.logprobs[:n], d.alternatives[:n])
                    yield event(choice(i, text, logprobs=chosen), reader)
                elif text:
                    yield event(choice(i, text), reader) if g.continuous_usage else head + json.dumps(text) + tail
            tail_text = reader.flush()
            if tail_text:
                yield event(choice(i, tail_text), reader)
            yield event(choice(i, "", reader.reason), reader, **({} if g.include_usage else {"metrics": _metrics(reader.stats())}))

        parts = [chunks(d, s, r) for d, s, r in zip(firsts, streams, readers)]
        source = parts[0] if len(parts) == 1 else merged(parts)
        try:
            async for chunk in source:
                yield chunk
            if g.include_usage:
                yield event(None, usage=usage(prompt_tokens, sum(r.tokens for r in readers)),
                            metrics=_metrics(summed_stats([r.stats() for r in readers])))
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception as e:      # a bug mid-stream: say so, or the client takes the cut text as whole
            log.exception("OpenAI frontend: a stream failed")
            yield f"data: {json.dumps(internal_error(e).body())}\n\n"
        finally:   # the choices' readers before their streams (a client gone mid-stream ends here)
            await source.aclose()
            await _close(streams)
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, chat=True)

    return app
