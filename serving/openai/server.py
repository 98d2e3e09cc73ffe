"""The OpenAI frontend's HTTP server: uvicorn in a background thread of `nemospec serve`, on a
socket bound before it starts (so port 0 picks a free port and the URL is known at once)."""
from __future__ import annotations

import socket
import threading
import time

from builder.errors import NemospecError
from serving.openai.app import create_app, model_info
from serving.openai.backend import TritonBackend


class OpenAIFrontend:
    def __init__(self, engine_dir, grpc_url: str, host: str = "127.0.0.1", port: int = 9000,
                 api_key: str | None = None, grpc_headers: dict | None = None, ready=None, model_name=None,
                 cancel_dir=None, limits=None, graceful_seconds: float = 3.0, metrics_url=None):
        """``graceful_seconds``: how long a stop lets requests in flight end (``serve`` gives Triton's
        drain, --shutdown_timeout, and a margin: its requests end as Triton ends them);
        ``metrics_url``: Triton's metrics, which its ``/metrics`` serves with vLLM's names added (a
        string, or a callable giving the running server's)."""
        self.info = model_info(engine_dir, model_name)
        self.graceful_seconds = graceful_seconds
        self.app = create_app(self.info, TritonBackend(grpc_url, headers=grpc_headers, cancel_dir=cancel_dir),
                              api_key, ready, limits, metrics_url)
        self.host = host
        try:
            self.socket = socket.create_server((host, port), reuse_port=False)
        except OSError as e:
            raise NemospecError(f"--openai_port: cannot bind {host}:{port}: {e.strerror}") from None
        self.port = self.socket.getsockname()[1]
        self._server = self._thread = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self, timeout: float = 30.0) -> "OpenAIFrontend":
        import uvicorn
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=self.graceful_seconds)
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None   # `nemospec serve` owns the signals
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.socket]},
                                        name="nemospec-openai", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise NemospecError(f"the OpenAI frontend did not start on {self.host}:{self.port}")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True
                self._thread.join(2)
        self.socket.close()
