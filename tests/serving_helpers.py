"""What the serving test files share: the small MTP engine directory (a random checkpoint with a
tokenizer) and a REAL Triton Inference Server on it (the nvidia-pytriton wheel's tritonserver on a
CPU-only machine), module-scoped; the clients the tests send requests with; `nemospec generate`
offline for the greedy answer; the model's Prometheus metrics."""
import contextlib
import importlib.util
import io
import json
import queue
import re
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from builder.engine import BuildOptions, build
from builder.random_checkpoint import add_mtp_layers, write_random_checkpoint
from nemospec import cli
from serving import launch, tritonserver

OPTIONS = dict(max_batch_size=4, max_input_len=40, max_seq_len=160, max_draft_len=3)
API_KEY = "test-secret"
MAX_QUEUE = 16
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "naïve café — 世界 🙂", "class Parser(object):"]

try:
    tritonserver.find_tritonserver()
    HAVE_TRITON = importlib.util.find_spec("tritonclient") is not None
except Exception:  # pragma: no cover - depends on the environment
    HAVE_TRITON = False
NEEDS_TRITON = pytest.mark.skipif(not HAVE_TRITON, reason="needs tritonserver and tritonclient "
                                  "(pip install -e '.[dev]': nvidia-pytriton==0.7.0, tritonclient[all]==2.73.0)")


# --- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    checkpoint = write_random_checkpoint(root / "checkpoint", "M*-", seed=0, tokenizer=True)
    add_mtp_layers(checkpoint, "*-", seed=1)
    build(checkpoint, root / "engine", BuildOptions(**OPTIONS, speculative_decoding_mode="mtp"), log=lambda m: None)
    return root / "engine"


@pytest.fixture(scope="module")
def draft_target_engine_dir(engine_dir):
    """The same target with a draft_target draft (a noisy copy of its layers, same tokenizer)."""
    from builder.random_checkpoint import write_layer_subset_draft
    root = engine_dir.parent
    draft = write_layer_subset_draft(root / "checkpoint", root / "draft", [0, 1, 2], noise=0.05, seed=3)
    build(root / "checkpoint", root / "engine_dt", BuildOptions(**OPTIONS, speculative_decoding_mode="draft_target"),
          log=lambda m: None, draft_dir=draft)
    return root / "engine_dt"


def free_ports():
    return dict(http_port=launch.free_port(), grpc_port=launch.free_port(), metrics_port=launch.free_port())


@pytest.fixture(scope="module")
def server(engine_dir):
    for attempt in range(3):  # a port picked free may be taken by another process before the server binds it
        try:
            handle = launch.start_server(engine_dir, **free_ports(), api_key=API_KEY, max_queue=MAX_QUEUE,
                                        ready_timeout=300)
            break
        except Exception as e:
            if "already in use" not in str(e) or attempt == 2:
                raise
    try:
        yield handle
    finally:
        start = time.monotonic()
        handle.stop()
        stopped = time.monotonic() - start
    assert not handle.alive()
    # Triton waits up to its exit timeout (15 s) for requests still in flight: none may be left
    # behind by cancellations, errors or refusals
    assert stopped < 12, f"tritonserver took {stopped:.1f} s to stop: a request was left in flight"


@pytest.fixture(scope="module")
def tokenizer(engine_dir):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(engine_dir / "tokenizer.json"))


_OFFLINE = {}
_EAGER = {}


def assert_margin(engine_dir, prompt, output_ids):
    """The target's greedy answer to ``prompt`` has no near-tie that batching or verify chunks could
    decide otherwise (speculative_fixtures.assert_greedy_margin on the eager runner)."""
    from tokenizers import Tokenizer

    from runtime.loading import open_engine_dir
    from speculative_fixtures import assert_greedy_margin
    if str(engine_dir) not in _EAGER:
        _EAGER[str(engine_dir)] = (open_engine_dir(engine_dir, backend="torch").runner,
                                   Tokenizer.from_file(str(engine_dir / "tokenizer.json")))
    runner, tok = _EAGER[str(engine_dir)]
    assert_greedy_margin(runner, [tok.encode(prompt).ids], [list(output_ids)], OPTIONS["max_draft_len"], repr(prompt))


def offline(engine_dir, prompt, max_tokens, *extra):
    """`nemospec generate --json` in this process (cached); greedy, so checked for near-ties."""
    key = (str(engine_dir), prompt, max_tokens, extra)
    if key not in _OFFLINE:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = cli.main(["generate", "--engine_dir", str(engine_dir), "--prompt", prompt,
                             "--max_new_tokens", str(max_tokens), "--json", *extra])
        assert code == 0
        _OFFLINE[key] = json.loads(out.getvalue().strip().splitlines()[-1])
        assert_margin(engine_dir, prompt, _OFFLINE[key]["output_ids"])
    return _OFFLINE[key]


# --- clients -----------------------------------------------------------------------------------------
def http_post(server, path, body, headers=None):
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def generate(server, **body):
    status, text = http_post(server, "/v2/models/ensemble/generate", body)
    return status, json.loads(text)


def _grpc_inputs(text, max_tokens, stream=True, **fields):
    import tritonclient.grpc as grpcclient
    values = {"text_input": (np.array([[text.encode()]], dtype=object), "BYTES"),
              "max_tokens": (np.array([[max_tokens]], dtype=np.int32), "INT32"),
              "stream": (np.array([[stream]], dtype=bool), "BOOL")}
    kinds = {"temperature": (np.float32, "FP32"), "top_p": (np.float32, "FP32"), "end_id": (np.int32, "INT32"),
             "random_seed": (np.uint64, "UINT64")}
    for name, value in fields.items():
        values[name] = value if isinstance(value, tuple) else (np.array([[value]], dtype=kinds[name][0]), kinds[name][1])
    inputs = []
    for name, (array, dtype) in values.items():
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        inputs.append(t)
    return inputs


def grpc_stream(server, text, max_tokens, parameters=None, inputs=None, **fields):
    """One request over a gRPC stream: (text chunks, ids, mean accepted tokens, error or None);
    ``inputs``: prepared InferInputs instead of text, max_tokens and fields."""
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("ensemble", inputs or _grpc_inputs(text, max_tokens, **fields), parameters=parameters,
                                  enable_empty_final_response=True)
        chunks, ids, mean = [], [], None
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                return chunks, ids, mean, str(error)
            response = result.get_response()
            if result.as_numpy("text_output") is not None:
                chunks.append(result.as_numpy("text_output").reshape(-1)[0].decode())
                ids += result.as_numpy("output_ids").reshape(-1).tolist()
                got = result.as_numpy("mean_accepted_tokens")   # the final response's (every one's with perf metrics)
                mean = mean if got is None else float(got.reshape(-1)[0])
            if response.parameters["triton_final_response"].bool_param:
                return chunks, ids, mean, None
    finally:
        client.stop_stream()
        client.close()


def metrics(server) -> dict:
    values = {}
    for line in server.metrics().splitlines():
        m = re.match(r"^(nemospec_[a-z0-9_]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            values[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return values


def metric(server, name, **labels):
    return metric_in(metrics(server), name, **labels)


def settled_metrics(server, ready=lambda m: True, timeout=10.0) -> dict:
    """A scrape once ``ready(scrape)`` holds and the scrape 0.15 s later is the same: the model
    publishes its counters at most every 0.1 s (METRICS_SECONDS), so a request's last counts arrive
    after its last response."""
    deadline = time.monotonic() + timeout
    m = metrics(server)
    while time.monotonic() < deadline:
        time.sleep(0.15)
        m, previous = metrics(server), m
        if ready(m) and m == previous:
            break
    return m


def metric_in(values, name, **labels):
    """One metric of a scrape (``metrics(server)``): read several from one scrape to compare them (the
    model publishes its counters every ~0.1 s, so two scrapes can straddle an update)."""
    want = {"model": "speculative", **labels}
    for key, value in values.items():
        base, _, rest = key.partition("{")
        found = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if base == name and found == want:
            return value
    raise KeyError(name)
