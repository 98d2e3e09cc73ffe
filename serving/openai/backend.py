"""One OpenAI generation through the Triton ensemble: a gRPC stream (tritonclient's asyncio client)
that yields text deltas as the speculative model accepts tokens. Leaving the iteration early (a
stop string matched, the HTTP client went away) cancels the gRPC call, which frees the sequence
through the ensemble's cancellation relay."""
from __future__ import annotations

import itertools
import logging
import math
import secrets
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from serving.openai.errors import APIError, from_triton, grpc_text
PROMPT_IGNORE_ALL = 1 << 30   # request_fields' prompt_ignore_length at most: every prompt token
GREEDY_BELOW = 1e-5   # runtime.sampling.GREEDY_BELOW (tested equal): under it a request is greedy
from serving.openai.protocol import Generation

log = logging.getLogger(__name__)
OUTPUTS = ("text_output", "output_ids", "finish_reason", "total_draft_tokens", "total_accepted_draft_tokens",
           "acceptance_histogram", "mean_accepted_tokens", "output_log_probs", "output_top_ids",
           "output_top_log_probs", "request_key")


@dataclass
class Delta:
    text: str
    tokens: int
    finish_reason: str = ""                    # "" until the last one
    result: object = field(default=None, repr=False)   # the response (an InferResult): stats on demand

    @cached_property
    def ids(self) -> list[int] | None:
        """This response's token ids (read only where a stop string matched inside it)."""
        return None if self.result is None else [int(t) for t in self.result.as_numpy("output_ids").reshape(-1)]

    @cached_property
    def key(self) -> int | None:
        """The request's key on the server (``serving.cancel``), read when a stop string ends it."""
        values = None if self.result is None else self.result.as_numpy("request_key")
        return None if values is None else int(values.reshape(-1)[0])

    @cached_property
    def logprobs(self) -> list[float]:
        """This response's tokens' log-probabilities (sent with ``return_log_probs``, else empty)."""
        values = None if self.result is None else self.result.as_numpy("output_log_probs")
        return [] if values is None else [float(v) for v in values.reshape(-1)]

    @cached_property
    def alternatives(self) -> list[list[tuple[int, float]]]:
        """This response's tokens' most probable tokens, (id, log-probability) each (sent with
        ``top_log_probs``, else empty)."""
        if self.result is None or self.result.as_numpy("output_top_ids") is None:
            return []
        ids, values = self.result.as_numpy("output_top_ids"), self.result.as_numpy("output_top_log_probs")
        ids, values = ids.reshape(-1, ids.shape[-1]), values.reshape(-1, values.shape[-1])
        return [[(int(t), float(v)) for t, v in zip(row_ids, row_values) if t >= 0]
                for row_ids, row_values in zip(ids, values)]

    @cached_property
    def stats(self) -> dict:
        """steps, drafts, accepted, histogram (the request's so far), read only when asked for: the
        frontend needs them once, at the end, not per streamed response."""
        values = {name: None if self.result is None else self.result.as_numpy(name)
                  for name in ("total_draft_tokens", "total_accepted_draft_tokens", "acceptance_histogram")}
        if any(v is None for v in values.values()):
            return {}
        stats = {"drafts": int(values["total_draft_tokens"].reshape(-1)[0]),
                 "accepted": int(values["total_accepted_draft_tokens"].reshape(-1)[0]),
                 "histogram": [int(v) for v in values["acceptance_histogram"].reshape(-1)]}
        stats["steps"] = sum(stats["histogram"])
        return stats


def _first_string(raw: bytes) -> bytes:
    """The first element of a Triton BYTES tensor's raw content (a 4-byte little-endian length, then
    that many bytes)."""
    return raw[4:4 + int.from_bytes(raw[:4], "little")]


def read_response(result) -> Delta:
    """One streamed response's text, token count and finish reason, read straight from the response's
    raw output contents (as_numpy per output scans the outputs and builds an array each time)."""
    response = result.get_response()
    outputs, raw = response.outputs, response.raw_output_contents
    if len(raw) != len(outputs):        # Triton's gRPC server always sends raw contents
        raise ValueError("a streamed response without raw output contents")
    index = {o.name: i for i, o in enumerate(outputs)}
    text = _first_string(raw[index["text_output"]]).decode("utf-8", "replace")
    tokens = math.prod(outputs[index["output_ids"]].shape) if "output_ids" in index else 0
    reason = _first_string(raw[index["finish_reason"]]).decode() if "finish_reason" in index else ""
    return Delta(text, tokens, reason, result)


def _tensor(name, array, dtype):
    from tritonclient.grpc import InferInput
    t = InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def ensemble_inputs(g: Generation, max_tokens: int):
    one = lambda name, value, np_type, triton: _tensor(name, np.array([[value]], dtype=np_type), triton)  # noqa: E731
    inputs = [_tensor("text_input", np.array([[g.prompt.encode("utf-8")]], dtype=np.object_), "BYTES"),
              one("max_tokens", max_tokens, np.int32, "INT32"),
              one("stream", True, np.bool_, "BOOL"),
              one("temperature", g.temperature, np.float32, "FP32"),
              one("top_p", g.top_p, np.float32, "FP32")]
    if g.top_k:
        inputs.append(one("top_k", g.top_k, np.int32, "INT32"))
    # the ensemble's default seed is TensorRT-LLM's 0 (every unseeded request samples alike); an
    # OpenAI request without one samples afresh, as vLLM's and OpenAI's do
    seed = g.seed if g.seed is not None else secrets.randbits(64)
    inputs.append(one("random_seed", seed, np.uint64, "UINT64"))
    if g.ignore_eos:
        inputs.append(one("end_id", -1, np.int32, "INT32"))
    if g.min_tokens:
        inputs.append(one("min_length", g.min_tokens, np.int32, "INT32"))
    if g.logprobs:
        inputs.append(one("return_log_probs", True, np.bool_, "BOOL"))
    if g.top_logprobs:
        inputs.append(one("top_log_probs", g.top_logprobs, np.int32, "INT32"))
    if not g.add_special_tokens:
        inputs.append(one("add_special_tokens", False, np.bool_, "BOOL"))
    if g.stop:   # a stop string ends the stream before the last response: every one carries the counts
        inputs.append(one("return_acceptance", True, np.bool_, "BOOL"))
    # the server subtracts presence and frequency from the temperature-scaled logits (TensorRT-LLM's
    # l/T - p); OpenAI's and vLLM's come off the logits before the temperature, (l - p)/T = l/T - p/T
    # (decided on the FP32 temperature the server reads: float32(1e-5) is under 1e-5, so greedy there)
    temperature = float(np.float32(g.temperature))
    scale = 1.0 / temperature if temperature >= GREEDY_BELOW else 1.0
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(g, name)
        if value != (1.0 if name == "repetition_penalty" else 0.0):
            inputs.append(one(name, value if name == "repetition_penalty" else value * scale, np.float32, "FP32"))
    if g.presence_penalty or g.frequency_penalty:   # OpenAI's and vLLM's count the generated tokens only
        inputs.append(one("prompt_ignore_length", PROMPT_IGNORE_ALL, np.int32, "INT32"))
    return inputs


async def _ended(call, timeout: float = 2.0) -> bool:
    """Reads a stream whose request has had its final response until Triton ends the call (the
    client sent its one request and closed its side). Cancelled after its final response instead,
    the call left its ensemble request held in Triton 2.51 (3 of 3 runs; read to the end, 0 of 3), and
    a stop then waited for that model until the server was killed at --shutdown_timeout. False when
    it does not end within ``timeout`` seconds."""
    import asyncio

    async def rest():
        async for _ in call:
            pass
    try:
        await asyncio.wait_for(rest(), timeout)
        return True
    except Exception:
        return False


class TritonBackend:
    """``cancel_dir``: a callable giving the served model's side-channel directory (it moves when the
    supervisor restarts the server), through which a request ended at a stop string is reported
    complete; None: such requests count as cancelled on the server."""

    def __init__(self, grpc_url: str, model: str = "ensemble", headers: dict | None = None, cancel_dir=None):
        self.url, self.model, self.headers, self.cancel_dir = grpc_url, model, headers, cancel_dir
        self._client = None
        self._ids = itertools.count()

    @property
    def client(self):
        if self._client is None:  # made inside the serving event loop (grpc.aio binds to it)
            from tritonclient.grpc.aio import InferenceServerClient
            self._client = InferenceServerClient(self.url)
        return self._client

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready(headers=self.headers)
                        and await self.client.is_model_ready(self.model, headers=self.headers))
        except Exception as e:   # not ready, and the log says why (a 503 alone does not)
            log.warning("Triton readiness check failed: %s: %s", type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
            return False

    def stopped(self, delta) -> None:
        """The request of response ``delta`` ended here, complete (a stop string matched in its text):
        tells the model so before the stream's cancellation reaches it (best effort)."""
        from serving.cancel import notify_stopped
        directory = self.cancel_dir() if self.cancel_dir is not None else None
        key = delta.key if directory is not None else None
        if key is not None:
            notify_stopped(directory, key)

    async def close(self):
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def generate(self, g: Generation, max_tokens: int):
        """Yields Delta per streamed response; raises APIError for a refused or failed request."""
        from tritonclient.grpc import InferRequestedOutput
        request = {"model_name": self.model, "inputs": ensemble_inputs(g, max_tokens),
                   "outputs": [InferRequestedOutput(n) for n in OUTPUTS],
                   "request_id": f"openai-{next(self._ids)}"}
        if not g.speculative:
            request["parameters"] = {"speculative": False}

        async def requests():
            yield request

        try:
            call = self.client.stream_infer(requests(), headers=self.headers)
        except Exception as e:
            raise APIError(503, f"the Triton server cannot be reached: {e}") from None
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    raise from_triton(error.message() if hasattr(error, "message") else str(error))
                delta = read_response(result)
                finished = bool(delta.finish_reason)   # before the yield: a reader may stop at it
                yield delta
                if finished:
                    return
        except APIError:
            raise
        except Exception as e:
            if type(e).__name__ in ("CancelledError", "GeneratorExit"):
                raise
            raise from_triton(grpc_text(e)) from None
        finally:
            ended = False
            try:
                ended = finished and await _ended(call)
            finally:
                if not ended:
                    call.cancel()
