"""A request-body cap in front of Triton's HTTP port.

Triton 2.51 (the nvidia-pytriton wheel's) dies with SIGSEGV on an HTTP request whose body is over
about 4 MB, on any endpoint (``/generate``, ``/infer``, an unknown JSON field: measured 3 MiB refused
cleanly by the model, 4 MiB and more a segfault), and has no flag to cap the body
(``--http-max-input-size`` came in later releases). So ``nemospec serve`` binds the HTTP port itself:
this guard refuses a body over ``max_body_bytes`` with 413 and a JSON error naming the limit, and
forwards everything else to Triton's HTTP port on loopback, streaming responses through
(``generate_stream``'s server-sent events arrive as Triton sends them). The ensemble's generate
requests get their JSON fields checked first (``serving.generate_fields``: Triton wraps INT32
silently and names no field for a wrong JSON type). A connection lost to Triton
(it died) answers 502, or ends a response already under way. A body sent with ``Content-Encoding:
gzip`` or ``deflate`` (tritonclient's ``request_compression_algorithm``) is decompressed here, within
the same cap, checked and forwarded plain: the cap on its compressed size alone let a small body
inflate past the size that crashes Triton.
"""
from __future__ import annotations

import http.client
import json
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from serving import protocol
from serving.generate_fields import GENERATE_PATH, check_generate_body

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
              "content-length", "expect"}   # (the guard answers 100-continue itself)
CHUNK = 64 << 10
BUSY = b"server busy: "   # runtime.scheduler's full queue (a retry can succeed): 429, as the OpenAI API answers it
STOPPING = protocol.STOPPING.encode()   # the speculative model's answer to requests a stop cut short
FAULT = protocol.FAULT.encode()   # a model failed through no fault of the request


def _model_error_status(data: bytes) -> tuple[int, str]:
    """A model error's status, which Triton's HTTP frontend answers 400 whatever it was: a full queue
    429, a stopping server 503, a model's own failure 500 (clients retry those, never a 400); a
    refused field stays 400."""
    if BUSY in data:
        return 429, "Too Many Requests"
    if STOPPING in data:
        return 503, "Service Unavailable"
    if FAULT in data:
        return 500, "Internal Server Error"
    return 400, "Bad Request"
DRAIN_BYTES = 256 << 20  # an oversized body is read and dropped up to this much, so the client sees the 413


class TooLarge(Exception):
    pass


def _read_chunked(rfile, limit: int) -> bytes:
    body = bytearray()
    while True:
        size = int(rfile.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while rfile.readline() not in (b"\r\n", b"\n", b""):   # trailers
                pass
            return bytes(body)
        if len(body) + size > limit:
            raise TooLarge(len(body) + size)
        body += rfile.read(size)
        rfile.readline()


class BadEncoding(Exception):
    """A body the guard cannot decode: ``status`` 415 for an encoding it does not take, 400 for data
    that is not what its header says."""
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS}


def _decoded(body: bytes, encoding: str, limit: int) -> bytes:
    """``body`` decompressed per its Content-Encoding (none or identity: as it is), at most ``limit``
    bytes (TooLarge past it); BadEncoding for an encoding Triton does not take or data that is not it."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in WBITS:
        raise BadEncoding(415, f"Content-Encoding {encoding!r}: expected gzip, deflate or identity")
    inflate = zlib.decompressobj(WBITS[encoding])
    try:
        out = inflate.decompress(body, limit + 1)
    except zlib.error as e:
        raise BadEncoding(400, f"request body: not {encoding} data ({e})") from None
    if len(out) > limit or inflate.unconsumed_tail:
        raise TooLarge(limit)
    if not inflate.eof:
        raise BadEncoding(400, f"request body: truncated {encoding} data")
    return out


# Triton's readiness endpoints: the server's, and any model's (the ensemble's is what clients probe)
READY_PATHS = ("/v2/health/ready",)
READY_MODEL_SUFFIX = "/ready"


def make_handler(upstream: tuple[str, int], max_body_bytes: int, alive=None):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _error(self, status: int, message: str, close: bool = False):
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> bytes:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                return _read_chunked(self.rfile, max_body_bytes)
            length = int(self.headers.get("Content-Length") or 0)
            if length > max_body_bytes:
                raise TooLarge(length)
            return self.rfile.read(length) if length > 0 else b""

        def _drain(self):
            left = min(int(self.headers.get("Content-Length") or 0), DRAIN_BYTES)
            while left > 0 and (data := self.rfile.read(min(CHUNK, left))):
                left -= len(data)

        def _forward(self):
            try:
                body = self._body()
            except TooLarge as e:
                self._drain()
                return self._error(413, f"request body: {e.args[0]} bytes exceed --max_body_bytes {max_body_bytes}",
                                   close=True)
            except ValueError:
                return self._error(400, "request body: malformed Content-Length or chunk size", close=True)
            try:   # read whole: nothing is left to drain
                body = _decoded(body, self.headers.get("Content-Encoding", ""), max_body_bytes)
            except BadEncoding as e:
                return self._error(e.status, str(e))
            except TooLarge:
                return self._error(413, f"request body: more than {max_body_bytes} bytes once decompressed exceed "
                                        f"--max_body_bytes {max_body_bytes}")
            generate = GENERATE_PATH.match(self.path) if self.command == "POST" else None
            if generate:
                error = check_generate_body(body, streaming=bool(generate.group(3)), model=generate.group(1))
                if error:
                    return self._error(400, error)
            path = self.path.split("?")[0].rstrip("/")
            if self.command in ("GET", "HEAD") and (path in READY_PATHS or (
                    path.startswith("/v2/models/") and path.endswith(READY_MODEL_SUFFIX))):
                reason = alive() if alive is not None else None
                if reason:   # Triton 2.51 answers 200 with a model's stub dead: the probe is told now
                    return self._error(503, f"not ready: {reason}")
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP | {"content-encoding"}}
            headers["Content-Length"] = str(len(body))
            upstream_conn = http.client.HTTPConnection(*upstream, timeout=None)
            started = False
            try:
                upstream_conn.request(self.command, self.path, body=body, headers=headers)
                response = upstream_conn.getresponse()
                status, reason, data = response.status, response.reason, None
                # an error is read whole: Triton sends generate's answers chunked, errors included
                if response.length is not None or self.command == "HEAD" or status >= 400:
                    data = response.read()
                    if status == 400:   # Triton's HTTP answers every model error 400: the server's own are 5xx
                        status, reason = _model_error_status(data)
                self.send_response(status, reason)
                started = True
                for k, v in response.getheaders():
                    if k.lower() not in HOP_BY_HOP and k.lower() not in ("server", "date"):
                        self.send_header(k, v)
                if status == 429:
                    self.send_header("Retry-After", "1")
                if data is not None:
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_header("Transfer-Encoding", "chunked")      # streamed (server-sent events)
                self.end_headers()
                while data := response.read1(CHUNK):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except (OSError, http.client.HTTPException) as e:
                if not started:
                    self._error(502, f"tritonserver: connection lost ({type(e).__name__}: {e})", close=True)
                else:
                    self.close_connection = True
            finally:
                upstream_conn.close()

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _forward

        def log_message(self, *args):
            pass

    return Handler


class HttpGuard:
    """Listens on ``(host, port)`` and forwards to ``127.0.0.1:upstream_port``; ``close()`` stops it.
    ``alive()``: None while the server can serve, else why not (what died, or the stop under way); a
    readiness probe (``READY_PATHS``) answers 503 naming it, at the moment of the probe."""

    def __init__(self, host: str, port: int, upstream_port: int, max_body_bytes: int, alive=None):
        self.max_body_bytes, self.alive = max_body_bytes, alive
        self.server = ThreadingHTTPServer((host, port), make_handler(("127.0.0.1", upstream_port), max_body_bytes,
                                                                     alive))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1},
                                       name="nemospec-http-guard", daemon=True)
        self.thread.start()

    def retarget(self, upstream_port: int):
        """Forwards new connections to ``127.0.0.1:upstream_port`` (Triton started again on another port)."""
        self.server.RequestHandlerClass = make_handler(("127.0.0.1", upstream_port), self.max_body_bytes, self.alive)

    def close(self):
        self.server.shutdown()
        self.server.server_close()
