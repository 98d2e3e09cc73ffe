"""`nemospec serve` under faults, as an operator meets them: kill -9 of the speculative model's stub,
kill -9 of tritonserver, SIGTERM with streams in flight, a crash loop. Readiness (the supervisor's
/health/ready) goes false within 5 s, in-flight streams get an error, the server serves the same
greedy output again within 60 s, and nothing is left running after it exits.

One `serve` process for the module (the mtp engine of tests/serving_helpers.py, built once); the last
test stops it with SIGTERM.
"""
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from serving import health, launch, readiness_check
from serving_helpers import NEEDS_TRITON, PROMPTS, _grpc_inputs, engine_dir, generate, offline  # noqa: F401

pytestmark = NEEDS_TRITON
MEASURED = {}   # seconds, printed at the end of the module (pytest -s) for the report


def _get(url, timeout=3):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return None, ""


class Serve:
    """A `nemospec serve` child process with its ports; stderr goes to a file (never a full pipe)."""

    def __init__(self, engine_dir, log_path, *extra):
        for attempt in range(3):  # a port picked free may be taken before the server binds it
            self.ports = [launch.free_port() for _ in range(4)]
            self.log_path = log_path
            cmd = [sys.executable, "-m", "nemospec.cli", "serve", "--engine_dir", str(engine_dir),
                   "--http_port", str(self.ports[0]), "--grpc_port", str(self.ports[1]),
                   "--metrics_port", str(self.ports[2]), "--health_port", str(self.ports[3]), "--openai_port", "0", "--backend", "torch", *extra]
            with open(log_path, "w") as log:
                self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
            if self.wait_ready(300) or attempt == 2:
                break
            self.process.wait(timeout=60)
            assert "already in use" in " ".join(self.log().split()), self.log()
        self.http_url, self.grpc_url = f"127.0.0.1:{self.ports[0]}", f"127.0.0.1:{self.ports[1]}"

    @property
    def ready_url(self):
        return f"http://127.0.0.1:{self.ports[3]}/health/ready"

    def log(self):
        return open(self.log_path).read()

    def state(self):
        return json.loads(_get(f"http://127.0.0.1:{self.ports[3]}/health")[1])

    def ready(self):
        return health.is_ready(self.ready_url)

    def wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            if self.ready():
                return True
            time.sleep(0.1)
        return False

    def wait_not_ready(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.ready():
                return True
            time.sleep(0.05)
        return False

    def processes(self):
        s = self.state()
        return [s["tritonserver_pid"], *map(int, s["stub_pids"])]

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def serve(engine_dir, tmp_path_factory):
    # four kills in the module (two probe cycles, two kill tests, each retried if its requests
    # finished first): more than the default 5 restarts in 300 s would end the server as a crash loop
    s = Serve(engine_dir, tmp_path_factory.mktemp("serve") / "serve.log", "--max_restarts", "20")
    try:
        yield s
    finally:
        s.stop()
        if MEASURED:
            print("\nmeasured:", json.dumps({k: round(v, 2) for k, v in MEASURED.items()}))


class Stream:
    """A long gRPC stream in a thread: ``first`` is set at its first response, ``result`` at its end."""

    def __init__(self, server, max_tokens=140):
        import tritonclient.grpc as grpcclient
        self.first, self.done, self.error, self.final = threading.Event(), threading.Event(), None, False
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.results = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))
        self.client.async_stream_infer("ensemble", _grpc_inputs(PROMPTS[0], max_tokens, end_id=-1),
                                       enable_empty_final_response=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            while True:
                result, error = self.results.get(timeout=120)
                self.first.set()
                if error is not None:
                    self.error = str(error)
                    return
                if result.get_response().parameters["triton_final_response"].bool_param:
                    self.final = True
                    return
        except queue.Empty:
            self.error = "no response for 120 s (hung)"
        finally:
            self.done.set()
            try:
                self.client.stop_stream()
                self.client.close()
            except Exception:
                pass


def _active_sequences(serve):
    _, text = _get(f"http://127.0.0.1:{serve.ports[2]}/metrics")
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith("nemospec_active_sequences{")), 0)


def _speculative_metrics(serve):
    """The lines the stall check reads, for a failure message."""
    _, text = _get(f"http://127.0.0.1:{serve.ports[2]}/metrics")
    return "".join(line + "\n" for line in text.splitlines() if line.startswith(
        ("nemospec_steps_total{", "nemospec_active_sequences{", "nemospec_queued_requests{", "nemospec_requests_")))


def _http_generate(serve, max_tokens):
    """(status or exception name, body) of an HTTP generate through the server's guard."""
    request = urllib.request.Request(f"http://{serve.http_url}/v2/models/ensemble/generate", method="POST",
                                     data=json.dumps({"text_input": PROMPTS[1], "max_tokens": max_tokens,
                                                      "end_id": -1, "exclude_input_in_output": True}).encode())
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return type(e).__name__, str(e)


def _kill_and_recover(serve, engine_dir, cause):
    """Kills the process that ``cause`` names while a stream and an HTTP request are both in flight,
    and checks both fail, readiness goes false, the server restarts and serves the same greedy output.
    A 140-token request can finish within a fraction of a second: if either had finished before the
    kill (the stream's final response, the HTTP request's 200), nothing of it was in flight, so after
    the restart the pair starts again."""
    want = offline(engine_dir, PROMPTS[0], 12)["output_ids"]
    for attempt in range(3):
        state = serve.state()
        restarts = state["restarts"]
        pid = (state["tritonserver_pid"] if cause == "tritonserver" else
               next(int(p) for p, model in state["stub_pids"].items() if model == cause))
        shm = health.shared_memory_files([state["tritonserver_pid"], *map(int, state["stub_pids"])])
        assert len(shm) == len(state["stub_pids"]), shm     # one region per stub
        stream = Stream(serve)
        assert stream.first.wait(60), "the stream started"
        http_result = {}
        http = threading.Thread(target=lambda: http_result.update(r=_http_generate(serve, 140)), daemon=True)
        http.start()
        deadline = time.monotonic() + 20
        while _active_sequences(serve) < 2 and time.monotonic() < deadline and not stream.done.is_set():
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        assert serve.wait_not_ready(5), "readiness false within 5 s"
        MEASURED[f"{cause}_not_ready_s"] = time.monotonic() - killed
        assert stream.done.wait(30), "the in-flight stream ended (no hang)"
        http.join(30)
        assert not http.is_alive(), "the HTTP request ended (no hang)"
        assert serve.wait_ready(60), f"serving again within 60 s:\n{serve.log()[-2000:]}"
        MEASURED[f"{cause}_serving_again_s"] = time.monotonic() - killed
        if not stream.final and http_result["r"][0] != 200:
            break
        # one of them finished before the kill (a killed process sends nothing after it): again
    assert stream.error is not None and not stream.final, \
        f"the in-flight stream got an error (3 tries):\n{_speculative_metrics(serve)}"
    assert http_result["r"][0] != 200, http_result    # an error, not a hang
    status, got = generate(SimpleNamespace(http_url=serve.http_url), text_input=PROMPTS[0], max_tokens=12,
                           exclude_input_in_output=True)
    assert status == 200 and got["output_ids"] == want, got
    state = serve.state()
    assert state["restarts"] == restarts + 1 and cause in state["last_cause"], state
    assert not health.process_alive(pid)
    assert not [f for f in shm if os.path.exists(f)], "the killed server's shared memory was removed"
    _, text = _get(f"http://127.0.0.1:{serve.ports[3]}/metrics")
    assert f"nemospec_supervisor_restarts_total {restarts + 1}" in text and cause in text, text
    assert f"supervisor: {state['last_cause']}; restarting" in serve.log()
    deadline = time.monotonic() + 10   # written just after the phase turns to serving
    while "supervisor: serving again" not in serve.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "supervisor: serving again" in serve.log()


def test_ready_endpoint_tells_the_state(serve, engine_dir):
    status, body = _get(serve.ready_url)
    state = json.loads(body)
    assert status == 200 and state["ready"] and state["restarts"] == 0 and state["last_cause"] is None
    assert sorted(state["stub_pids"].values()) == ["postprocessing", "preprocessing", "speculative"]
    assert _get(f"http://127.0.0.1:{serve.ports[3]}/health/live")[0] == 200
    assert "nemospec_supervisor_ready 1" in _get(f"http://127.0.0.1:{serve.ports[3]}/metrics")[1]
    deadline = time.monotonic() + 30     # the endpoints are printed once the OpenAI frontend is up too
    while not any(line.split()[:2] == ["ready", serve.ready_url] for line in serve.log().splitlines()):
        assert time.monotonic() < deadline, serve.log()
        time.sleep(0.1)
    status, got = generate(SimpleNamespace(http_url=serve.http_url), text_input=PROMPTS[0], max_tokens=12,
                           exclude_input_in_output=True)
    assert status == 200 and got["output_ids"] == offline(engine_dir, PROMPTS[0], 12)["output_ids"]


def test_speculative_stub_killed(serve, engine_dir):
    _kill_and_recover(serve, engine_dir, "speculative")


def test_tritonserver_killed(serve, engine_dir):
    _kill_and_recover(serve, engine_dir, "tritonserver")


def test_no_probe_answers_ready_while_a_killed_stub_cannot_serve(serve, engine_dir):
    """Readiness is read at the moment of the probe (issue 40): three probers ask every ~10 ms (the
    supervisor's /health/ready, Triton's /v2/health/ready and the ensemble's ready through the HTTP
    guard, the OpenAI frontend's /health/ready and vLLM's /health) while short requests go back to back, and the speculative
    stub is killed, twice (``serving.readiness_check``; ``benchmarks/readiness_soak.py`` runs more
    cycles). No probe that began once the stub was gone answered 200 before a request that then failed;
    each cycle serves again."""
    guard = f"http://{serve.http_url}"
    urls = [serve.ready_url, f"{guard}/v2/health/ready", f"{guard}/v2/models/ensemble/ready",
            readiness_check.openai_ready_url(serve.log), readiness_check.openai_ready_url(serve.log)[:-len("/ready")]]
    for cycle in range(2):
        assert serve.wait_ready(60)
        result = readiness_check.kill_cycle(
            urls, lambda: _http_generate(serve, 2)[0] == 200, ready=serve.ready,
            find_pid=lambda: next(int(p) for p, model in serve.state()["stub_pids"].items() if model == "speculative"))
        assert result.served_before and not result.failed_before, "requests were served before the kill"
        assert result.ready_again_s is not None, serve.log()[-2000:]
        assert result.failed_after, "some request failed while the stub was dead (else the test saw nothing)"
        assert not result.lies, f"cycle {cycle}: ready answered while requests failed after it: {result.lies[:5]}"
        assert result.said_not_ready == set(urls), \
            f"every endpoint said not ready after the kill: {sorted(set(urls) - result.said_not_ready)}"
        MEASURED[f"probe_cycle{cycle}_probes"] = result.probes
        MEASURED[f"probe_cycle{cycle}_ready_again_s"] = result.ready_again_s


def test_sigterm_with_streams_in_flight(serve):
    """The last test of the module: it stops the server."""
    processes = serve.processes()
    streams = [Stream(serve) for _ in range(2)]
    assert all(s.first.wait(60) for s in streams)
    serve.process.send_signal(signal.SIGTERM)
    start = time.monotonic()
    assert serve.process.wait(timeout=20) == 0   # ~6 s at most in the server's stop, the rest exiting
    MEASURED["sigterm_exit_s"] = time.monotonic() - start
    assert all(s.done.wait(10) for s in streams), "every stream ended"
    assert all(s.error is not None or s.final for s in streams)
    assert not [pid for pid in processes if health.process_alive(pid)], "no process left behind"


def test_crash_loop_exits_3(engine_dir, tmp_path):
    serve = Serve(engine_dir, tmp_path / "serve.log", "--max_restarts", "0")
    try:
        processes = serve.processes()
        os.kill(next(int(p) for p, m in serve.state()["stub_pids"].items() if m == "preprocessing"), signal.SIGKILL)
        assert serve.process.wait(timeout=20) == 3
        assert "crash loop" in serve.log() and "--max_restarts 0" in serve.log()
        assert not [pid for pid in processes if health.process_alive(pid)], "no process left behind"
    finally:
        serve.stop()


def test_stopped_stub_is_restarted(engine_dir, tmp_path):
    """A stub alive but stopped (SIGSTOP): Triton fails every request to it while its own readiness
    stays 200, so the supervisor counts it dead at once (a stuck but running stub is the stall
    watch's, tests/test_supervisor_policy.py): not ready, restarted, the stream gets an error."""
    serve = Serve(engine_dir, tmp_path / "serve.log", "--stall_timeout", "120")
    try:
        for attempt in range(3):
            pid = next(int(p) for p, m in serve.state()["stub_pids"].items() if m == "speculative")
            stream = Stream(serve)
            assert stream.first.wait(60)
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            assert serve.wait_not_ready(30), "not ready within a few checks:\n" + serve.log()[-2000:]
            MEASURED["stopped_not_ready_s"] = time.monotonic() - stopped
            assert stream.done.wait(30), "the in-flight stream ended (no hang)"
            assert serve.wait_ready(60)
            if not stream.final:
                break
            # a stopped stub sends nothing, so a final response was sent before the stop: the stream
            # (140 tokens, ~0.3 s on a warm machine) finished between its first response and the
            # SIGSTOP, and nothing was in flight to fail; the restarted stub is stopped again
        assert stream.error is not None and not stream.final, "the in-flight stream got an error in 3 tries"
        assert "is stopped" in serve.state()["last_cause"] and not health.process_alive(pid)
        status, got = generate(SimpleNamespace(http_url=serve.http_url), text_input=PROMPTS[0], max_tokens=12,
                               exclude_input_in_output=True)
        assert status == 200 and got["output_ids"] == offline(engine_dir, PROMPTS[0], 12)["output_ids"]
    finally:
        serve.stop()


def test_stop_after_a_stub_died_is_quick(engine_dir):
    """Without the supervisor (the launch API): a stub dead with a request in flight at it used to
    keep the stop waiting its full timeout (30 s); now the process group goes after shutdown_timeout."""
    for attempt in range(3):
        handle = launch.start_server(engine_dir, **{k: launch.free_port() for k in ("http_port", "grpc_port", "metrics_port")},
                                     shutdown_timeout=4, ready_timeout=300)
        try:
            stream = Stream(handle)
            assert stream.first.wait(60)
            pids = [handle.process.pid, *handle.stubs]
            os.kill(next(p for p, m in handle.stubs.items() if m == "speculative"), signal.SIGKILL)
            start = time.monotonic()
            handle.stop()
            assert time.monotonic() - start < 10
            assert stream.done.wait(10)
            assert not [pid for pid in pids if health.process_alive(pid)], "no process left behind"
        finally:
            handle.kill()
        if not stream.final:
            break   # a final response means the stream finished before the kill: nothing was in flight
    assert stream.error is not None and not stream.final, "the in-flight stream got an error in 3 tries"
