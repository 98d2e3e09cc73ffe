"""A gRPC streaming client for the served ensemble (the demo, `nemospec bench`, benchmarks).

Speaks the TensorRT-LLM backend tensor names (``text_input``, ``max_tokens``, ``stream``,
``end_id``) and reads ``text_output`` and ``output_ids`` from each streamed response and
``mean_accepted_tokens`` from the final one; ``speculative=False`` is the per-request parameter that runs target-only.
"""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class StreamResult:
    text: str = ""
    ids: list[int] = field(default_factory=list)
    mean_accepted_tokens: float | None = None
    histogram: list = field(default_factory=list)   # the final response's: steps that kept 0..K drafts
    seconds: float = 0.0                 # send -> final response
    first_token_seconds: float | None = None
    responses: int = 0

    @property
    def tokens_per_second(self) -> float:
        return len(self.ids) / self.seconds if self.seconds else 0.0


def _inputs(prompt: str, max_tokens: int, end_id: int | None):
    import tritonclient.grpc as grpcclient
    values = [("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
              ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
              ("stream", np.array([[True]], dtype=bool), "BOOL")]
    if end_id is not None:
        values.append(("end_id", np.array([[end_id]], dtype=np.int32), "INT32"))
    inputs = []
    for name, array, dtype in values:
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        inputs.append(t)
    return inputs


def stream_generate(url: str, prompt: str, max_tokens: int, *, speculative: bool = True, end_id: int | None = -1,
                    on_text=None, timeout: float = 600.0, model: str = "ensemble", client=None) -> StreamResult:
    """One streaming request; ``on_text(chunk)`` sees the text as it arrives. ``end_id=-1`` ignores
    EOS (a fixed number of tokens, for timing); None uses the model's. ``client``: a
    ``tritonclient.grpc.InferenceServerClient`` to reuse (its channel stays open; default: one made
    and closed for this request). Raises RuntimeError on a server error."""
    import tritonclient.grpc as grpcclient
    own = client is None
    client = grpcclient.InferenceServerClient(url) if own else client
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    out = StreamResult()
    try:
        start = time.perf_counter()
        client.async_stream_infer(model, _inputs(prompt, max_tokens, end_id), enable_empty_final_response=True,
                                  parameters=None if speculative else {"speculative": False})
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(f"{url}: {error}")
            text = result.as_numpy("text_output")
            if text is not None:
                if out.first_token_seconds is None:
                    out.first_token_seconds = time.perf_counter() - start
                chunk = text.reshape(-1)[0].decode()
                out.text += chunk
                out.ids += result.as_numpy("output_ids").reshape(-1).tolist()
                mean = result.as_numpy("mean_accepted_tokens")   # in the final response (or with return_perf_metrics)
                if mean is not None:
                    out.mean_accepted_tokens = float(mean.reshape(-1)[0])
                histogram = result.as_numpy("acceptance_histogram")
                if histogram is not None:
                    out.histogram = histogram.reshape(-1).tolist()
                out.responses += 1
                if on_text is not None and chunk:
                    on_text(chunk)
            if result.get_response().parameters["triton_final_response"].bool_param:
                out.seconds = time.perf_counter() - start
                return out
    finally:
        client.stop_stream()
        if own:
            client.close()
