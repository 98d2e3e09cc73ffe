"""Request checks without a server: the generate JSON check, the limits, and the HTTP guard in front
of a stand-in upstream (413 over the body cap, forwarding, streamed responses, 502 when the upstream
is gone)."""
import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from serving import limits
from serving.generate_fields import GENERATE_PATH, check_generate_body
from serving.http_guard import HttpGuard
from serving.protocol import fault
from serving.launch import free_port


@pytest.mark.parametrize("body,needle", [
    (b'{"text_input": "x", "max_tokens": 4}', None),
    (b'{"text_input": ["x"], "max_tokens": [4], "stop_words": ["a", "b"], "parameters": {"y": 1}}', None),
    (b'{"id": "7", "text_input": "x", "speculative": false}', None),
    (b'{"text_input": "x", "accumulate_tokens": true}', None),    # vLLM's and SGLang's TensorRT-LLM clients send it
    (b'{"text_input": "x", "accumulate_tokens": 1}', "accumulate_tokens: expected true or false"),
    (b'{"text_input": "x", "min_tokens": 30, "seed": 3, "return_num_input_tokens": true}', None),  # the backend's names
    (b'{"text_input": "x", "min_length": 30, "random_seed": 3}', None),                           # and its older ones
    (b'{"text_input": "x", "end_id": [1, 2]}', "end_id: expected one int32, got a list of 2"),
    (b'{"text_input": "x", "temperature": 1e400}', "temperature: expected a finite number"),
    (b'{"text_input": "x", "runtime_top_k": 1}', "runtime_top_k: not an input of the ensemble"),
    (b'{"text_input": "x", "temperature": "hot", "temperature": 1}', "temperature: given twice"),
    (b'{"text_input": "x", "max_tokens": NaN}', "max_tokens: expected an integer"),
    (b'{"text_input": "x", "max_tokens": 4294967301}', "max_tokens: 4294967301 is outside the INT32 range"),
    (b'{"text_input": "x", "max_tokens": true}', "max_tokens: expected an integer"),
    (b'{"text_input": "x", "random_seed": 18446744073709551616}', "random_seed: 18446744073709551616 is outside"),
    (b'{"text_input": "x", "temperature": Infinity}', "temperature: expected a finite number"),
    (b'{"text_input": "\\ud800"}', "text_input: not valid UTF-8"),
    (b'{"text_input": "x", "stop_words": [["a"]]}', "stop_words: expected a string or a flat list"),
    (b'{"text_input": "x", "parameters": []}', "parameters: expected a JSON object"),
    (b'[1]', "request body: expected a JSON object"),
    (b'\xff{', "request body: not valid JSON"),
])
def test_check_generate_body(body, needle):
    error = check_generate_body(body)
    assert (error is None) if needle is None else (needle in error), error


def test_the_speculative_models_generate_is_checked_over_its_own_inputs():
    """A client may call the speculative model with token ids, as the TensorRT-LLM backend's
    tensorrt_llm model is called: its INT32 inputs wrap silently in Triton as the ensemble's do."""
    check = lambda body: check_generate_body(body, model="speculative")  # noqa: E731
    assert check(b'{"input_ids": [446, 283], "max_tokens": 4, "stop_words_ids": [[5], [1]]}') is None
    assert "max_tokens: 4294967301 is outside the INT32 range" in check(b'{"input_ids": [446], "max_tokens": 4294967301}')
    assert "text_input: not an input of the speculative" in check(b'{"text_input": "x", "max_tokens": 4}')
    assert "input_ids: expected an integer" in check(b'{"input_ids": ["a"], "max_tokens": 4}')


def test_stream_true_is_for_generate_stream():
    """Triton's ``generate`` answers a ``stream: true`` request with HTTP 200 and an error body (the
    ensemble sends several responses): refused as a 400 naming the field, before Triton sees it."""
    for stream in (b"true", b"[true]"):
        body = b'{"text_input": "x", "stream": ' + stream + b"}"
        assert "stream: true needs the generate_stream endpoint" in check_generate_body(body, streaming=False)
        assert check_generate_body(body, streaming=True) is None
    assert check_generate_body(b'{"text_input": "x", "stream": false}', streaming=False) is None


def test_generate_path_is_the_ensembles():
    assert GENERATE_PATH.match("/v2/models/ensemble/generate") and GENERATE_PATH.match("/v2/models/ensemble/generate_stream")
    assert GENERATE_PATH.match("/v2/models/ensemble/versions/1/generate")
    assert GENERATE_PATH.match("/v2/models/speculative/generate_stream").group(1, 3) == ("speculative", "_stream")
    assert not GENERATE_PATH.match("/v2/models/preprocessing/generate") and not GENERATE_PATH.match("/v2/models/ensemble/infer")


def test_limits():
    assert limits.decode_limits(limits.encode_limits({"max_stop_words": 3}))["max_stop_words"] == 3
    with pytest.raises(Exception, match="--max_prompt_bytes: expected a positive integer"):
        limits.limits_from({"max_prompt_bytes": 0})
    with pytest.raises(limits.LimitError, match="request: 12 bytes"):
        limits.check_text(limits.limits_from({"max_request_bytes": 11}), b"x" * 10, [b"ab"])
    with pytest.raises(limits.LimitError, match="text_input: 10 bytes exceed --max_prompt_bytes 9"):
        limits.check_text(limits.limits_from({"max_prompt_bytes": 9}), b"x" * 10)
    with pytest.raises(limits.LimitError, match="bad_words: 3 words exceed --max_stop_words 2"):
        limits.check_words(limits.limits_from({"max_stop_words": 2}), "bad_words", ["a", "b", "c"])
    with pytest.raises(limits.LimitError, match="a word of 4 bytes exceeds --max_stop_word_bytes 3"):
        limits.check_words(limits.limits_from({"max_stop_word_bytes": 3}), "stop_words", ["é" * 2])


class Upstream(BaseHTTPRequestHandler):
    """Echoes POST bodies (length-delimited) and streams three chunks for /stream."""
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/stream":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            return
        reply = json.dumps({"path": self.path, "bytes": len(body), "key": self.headers.get("api-key"),
                            **({"encoding": self.headers["Content-Encoding"]} if "Content-Encoding" in self.headers else {})
                            }).encode()
        if self.path.startswith("/busy"):   # what Triton's HTTP answers for the scheduler's full queue
            reply = b'{"error":"in ensemble \'ensemble\', server busy: 4 requests queued beyond the batch"}'
        model_errors = {"/fault": fault("speculative", RuntimeError("boom")),    # Triton answers each 400
                        "/stopping": "speculative: the server is shutting down", "/refused": "top_k: expected 0..100"}
        if self.path in model_errors:
            reply = json.dumps({"error": f"in ensemble 'ensemble', {model_errors[self.path]}"}).encode()
        self.send_response(400 if self.path.startswith("/busy") or self.path in model_errors else 200)
        if self.path == "/busy_chunked":    # as Triton 2.51 sends generate's answers, errors too
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(reply), reply))
            return
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def guard():
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    g = HttpGuard("127.0.0.1", free_port(), upstream.server_address[1], max_body_bytes=1000)
    yield g, upstream
    g.close()
    upstream.shutdown()
    upstream.server_close()


def _post(g, path, body, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", g.server.server_address[1], timeout=10)
    conn.request("POST", path, body=body, headers=headers or {})
    response = conn.getresponse()
    return response.status, response.read()


def test_guard_forwards_caps_and_streams(guard):
    g, upstream = guard
    status, body = _post(g, "/v2/x", b"a" * 1000, {"api-key": "k"})
    assert status == 200 and json.loads(body) == {"path": "/v2/x", "bytes": 1000, "key": "k"}
    status, body = _post(g, "/v2/x", b"a" * 5000)
    assert status == 413 and "request body: 5000 bytes exceed --max_body_bytes 1000" in json.loads(body)["error"]
    status, body = _post(g, "/stream", b"{}")
    assert status == 200 and body == b"data: 1\n\ndata: 2\n\ndata: 3\n\n"
    status, body = _post(g, "/v2/models/ensemble/generate", b'{"text_input": "x", "max_tokens": 4294967296}')
    assert status == 400 and "max_tokens" in json.loads(body)["error"]
    for path in ("/busy", "/busy_chunked"):
        conn = http.client.HTTPConnection("127.0.0.1", g.server.server_address[1], timeout=10)
        conn.request("POST", path, body=b"{}")
        busy = conn.getresponse()
        assert busy.status == 429 and busy.getheader("Retry-After") == "1" and b"server busy" in busy.read(), path
    status, body = _post(g, "/v2/models/ensemble/generate", b'{"text_input": "x", "stream": true}')
    assert status == 400 and "generate_stream" in json.loads(body)["error"]
    # Triton's 400 for every model error: a model's own failure is the server's (500), a stop's 503
    assert [_post(g, p, b"{}")[0] for p in ("/fault", "/stopping", "/refused")] == [500, 503, 400]
    upstream.shutdown()
    upstream.server_close()
    status, body = _post(g, "/v2/x", b"{}")
    assert status == 502 and "tritonserver: connection lost" in json.loads(body)["error"]


def test_guard_decompresses_what_it_checks_and_caps(guard):
    """tritonclient's request_compression_algorithm (gzip, deflate): the guard checks and forwards the
    decompressed body, plain; a small body that inflates past the cap is 413 before Triton sees it (a
    body over ~4 MB crashes Triton 2.51), other encodings 415, data that is not what it says 400."""
    import gzip
    import zlib
    g, _ = guard
    for name, pack in (("gzip", gzip.compress), ("deflate", zlib.compress)):
        status, body = _post(g, "/v2/x", pack(b"a" * 900), {"Content-Encoding": name})
        assert status == 200 and json.loads(body) == {"path": "/v2/x", "bytes": 900, "key": None}, (name, body)
        status, body = _post(g, "/v2/models/ensemble/generate",
                             pack(b'{"text_input": "x", "max_tokens": 4294967296}'), {"Content-Encoding": name})
        assert status == 400 and "max_tokens" in json.loads(body)["error"], (name, body)
        bomb = pack(b" " * 100_000)
        assert len(bomb) < 1000
        status, body = _post(g, "/v2/x", bomb, {"Content-Encoding": name})
        assert status == 413 and "once decompressed exceed --max_body_bytes 1000" in json.loads(body)["error"]
    status, body = _post(g, "/v2/x", b"{}", {"Content-Encoding": "br"})
    assert status == 415 and "Content-Encoding 'br': expected gzip, deflate or identity" in json.loads(body)["error"]
    status, body = _post(g, "/v2/x", b"not gzip at all", {"Content-Encoding": "gzip"})
    assert status == 400 and "not gzip data" in json.loads(body)["error"]
    status, body = _post(g, "/v2/x", gzip.compress(b"a" * 900)[:-12], {"Content-Encoding": "gzip"})
    assert status == 400 and "truncated gzip data" in json.loads(body)["error"]
    status, body = _post(g, "/v2/x", b"{}", {"Content-Encoding": "identity"})
    assert status == 200 and json.loads(body)["bytes"] == 2


def test_test_servers_pick_ports_from_their_workers_own_range():
    """xdist's workers inherit the controller's environment, so conftest assigns each worker's range
    (a default left both workers on gw0's, where a supervisor test's restarted server met the other
    worker's); free_port picks inside it."""
    import os
    from conftest import port_range
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        assert os.environ["NEMOSPEC_PORT_RANGE"] == port_range(worker)
    assert len({port_range(f"gw{k}") for k in range(6)}) == 6
    low, high = map(int, os.environ["NEMOSPEC_PORT_RANGE"].split("-"))
    assert all(low <= free_port() <= high for _ in range(8))


def test_free_port_never_hands_out_a_port_twice_in_a_row(monkeypatch):
    """Nothing binds a port between two calls, so a random pick could repeat: a server was given one
    port for its gRPC and its metrics and exited. A pick this process was just given is passed over."""
    import random
    from serving import launch
    low = int(launch.os.environ["NEMOSPEC_PORT_RANGE"].split("-")[0])
    monkeypatch.setattr(random, "randint", lambda a, b: low + 7)   # every pick the same port
    ports = [launch.free_port() for _ in range(3)]
    assert len(set(ports)) == 3 and ports[0] == low + 7, ports


@pytest.mark.parametrize("how, code, named", [("abort", -6, "signal SIGABRT"), ("exit", 1, "code 1")])
def test_a_server_that_ended_before_ready_says_why(tmp_path, how, code, named):
    """An aborted tritonserver writes no error line that says why: the message names the signal and
    shows the end of its log, not the line every CPU-only Triton writes about CUDA (all a user saw of
    a start aborted under load)."""
    import subprocess
    import sys
    from serving import launch
    log = tmp_path / "tritonserver.log"
    log.write_text('E1207 10:15:28.448367 26526 server.cc:241] "CudaDriverHelper has not been initialized."\n'
                   'I1207 10:15:29.000000 26526 python_be.cc:2000] "TRITONBACKEND_ModelInstanceInitialize: x_0"\n'
                   + ('E1207 10:15:30.000000 26526 model_lifecycle.cc:654] "failed to load \'speculative\'"\n'
                      if how == "exit" else ""))
    act = "import os, signal; os.kill(os.getpid(), signal.SIGABRT)" if how == "abort" else "raise SystemExit(1)"
    process = subprocess.Popen([sys.executable, "-c", act], stderr=subprocess.DEVNULL)
    assert process.wait(timeout=30) == code
    reason = launch.ServerHandle(process, "127.0.0.1", 1, 2, 3, tmp_path, tmp_path, log, []).exit_reason()
    assert reason.startswith(f"tritonserver exited with {named} before it was ready:\n"), reason
    assert "CudaDriverHelper" not in reason.split("the end of its log:")[0]
    if how == "abort":
        assert reason.endswith("TRITONBACKEND_ModelInstanceInitialize: x_0\"")
    else:
        assert reason.endswith("failed to load 'speculative'\"") and "the end of its log" not in reason
