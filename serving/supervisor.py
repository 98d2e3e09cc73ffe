"""``nemospec serve`` supervises the tritonserver it started: truthful readiness and self-healing.

Every ``check_interval`` seconds (0.5) the supervisor checks what it started
(``serving.health.check_server``: the server process, each Python stub process, Triton's readiness).
``is_ready()`` / ``state()`` are that answer, and the readiness endpoint serves it
(``http://HOST:HEALTH_PORT/health/ready``: 200 while a request can be served, else 503 with the
reason). This is the URL a load balancer or Kubernetes readiness probe should use: Triton 2.51's own
``/v2/health/ready`` stays 200 after a stub died.

A stub that is alive but stuck (requests in flight, no scheduler step for ``stall_timeout`` seconds,
read from the metrics port) counts as dead too. When a stub or the server dies, the whole server is killed (its process group: requests in flight
get a connection error at once, never a hang) and started again on the same ports. Triton 2.51's
explicit model control can reload the model (``--model-control-mode explicit`` +
``POST /v2/repository/models/speculative/load`` served new requests ~4 s later), but the requests in
flight at the dead stub then hang forever and keep the server's shutdown waiting its full exit
timeout, so a restart of the server is what this does. More than ``max_restarts`` restarts within
``restart_window`` seconds is a crash loop: ``run()`` returns EXIT_CRASH_LOOP instead of spinning.

An in-process frontend (the OpenAI one) calls ``serving.supervisor.is_ready()`` (the supervisor
``nemospec serve`` runs in this process; False when there is none) or ``supervisor.state()``;
another process calls ``serving.health.is_ready("http://HOST:HEALTH_PORT/health/ready")``.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from builder.errors import NemospecError
from serving.health import Health, StallWatch, check_server

EXIT_RESTART_FAILED = 1      # the server could not be started again within restart_timeout
EXIT_CRASH_LOOP = 3          # more than max_restarts restarts within restart_window seconds
KEPT_LOGS = 5                # the server logs of the last crashed runs kept (a restart removes its run dir)
HTTP_GRACE_SECONDS = 15.0    # Triton's readiness failing this long with its processes alive: restart too
_current = None              # the Supervisor started last in this process


def current():
    """The supervisor started last in this process (``nemospec serve``'s), or None."""
    return _current


def is_ready(target=None, timeout: float = 2.0) -> bool:
    """True only while a request can be served: ``target`` None asks this process's supervisor;
    else as ``serving.health.is_ready`` (a Supervisor, or a readiness URL)."""
    from serving.health import is_ready as ask
    target = _current if target is None else target
    return target is not None and ask(target, timeout)


class Supervisor:
    def __init__(self, start, *, check_interval: float = 0.5, max_restarts: int = 5, restart_window: float = 300.0,
                 restart_timeout: float = 60.0, stall_timeout: float = 120.0, log=None, check=check_server):
        """``start(ready_timeout=...)``: starts a server and returns its ``serving.launch.ServerHandle``
        once ready (a restart passes what is left of ``restart_timeout``);
        ``check(handle, stubs, timeout) -> Health`` (``serving.health.check_server``);
        ``stall_timeout``: seconds without a scheduler step while requests are in flight that count
        as a hung model (``serving.health.StallWatch``; 0: not watched)."""
        if max_restarts < 0:
            raise NemospecError(f"--max_restarts: expected >= 0, got {max_restarts}")
        if stall_timeout < 0:
            raise NemospecError(f"--stall_timeout: expected >= 0 seconds (0: off), got {stall_timeout}")
        if restart_window <= 0:
            raise NemospecError(f"--restart_window: expected > 0 seconds, got {restart_window}")
        self._start = start
        self.check_interval, self.max_restarts, self.restart_window = check_interval, max_restarts, restart_window
        self.restart_timeout, self._check = restart_timeout, check
        self.stall_timeout = stall_timeout
        self._stall = StallWatch(stall_timeout)
        self._log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self.handle = None
        self._lock = threading.Lock()
        self._health = Health(False, "starting")
        self._phase = "starting"
        self.restarts = 0
        self.last_cause: str | None = None
        self.last_recovery_seconds: float | None = None
        self._recent: deque = deque()
        self._unready_since: float | None = None
        self._stop = threading.Event()

    # --- the state a frontend reads ------------------------------------------------------------------
    def is_ready(self) -> bool:
        """True only while a request can be served: the last check (every ``check_interval`` seconds:
        Triton's readiness, a stall) passed, and at this moment no process of the server has died
        (``ServerHandle.dead_now``: a probe right after a kill -9 is told, not the check before it)."""
        return self.state()["ready"]

    def _dead_now(self) -> None:
        """Records a death the process table shows now (the loop's next check restarts the server)."""
        with self._lock:
            handle, ready = self.handle, self._phase == "serving" and self._health.ready
        dead = handle.dead_now() if ready and handle is not None and hasattr(handle, "dead_now") else None
        if dead:
            self._set(health=Health(False, dead))

    def state(self) -> dict:
        self._dead_now()
        with self._lock:
            handle = self.handle
            return {"ready": self._phase == "serving" and self._health.ready, "phase": self._phase,
                    "reason": self._health.reason, "restarts": self.restarts, "last_cause": self.last_cause,
                    "last_recovery_seconds": self.last_recovery_seconds,
                    "tritonserver_pid": handle.process.pid if handle is not None else None,
                    "stub_pids": {str(pid): model for pid, model in handle.stubs.items()} if handle else {}}

    def metrics_text(self) -> str:
        s = self.state()
        lines = ["# HELP nemospec_supervisor_ready 1 while a request can be served", "# TYPE nemospec_supervisor_ready gauge",
                 f"nemospec_supervisor_ready {int(s['ready'])}",
                 "# HELP nemospec_supervisor_restarts_total Restarts of tritonserver after a crash",
                 "# TYPE nemospec_supervisor_restarts_total counter", f"nemospec_supervisor_restarts_total {s['restarts']}"]
        if s["last_cause"] is not None:
            cause = s["last_cause"].replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
            lines += ["# HELP nemospec_supervisor_last_restart_info The last restart's cause",
                      "# TYPE nemospec_supervisor_last_restart_info gauge",
                      f'nemospec_supervisor_last_restart_info{{cause="{cause}"}} 1']
        if s["last_recovery_seconds"] is not None:
            lines += ["# HELP nemospec_supervisor_last_recovery_seconds Seconds from detecting the last crash to ready",
                      "# TYPE nemospec_supervisor_last_recovery_seconds gauge",
                      f"nemospec_supervisor_last_recovery_seconds {s['last_recovery_seconds']:.3f}"]
        return "\n".join(lines) + "\n"

    def _set(self, phase=None, health=None):
        with self._lock:
            if phase is not None:
                self._phase = phase
            if health is not None:
                self._health = health

    # --- the loop ------------------------------------------------------------------------------------
    def start(self):
        """The first start: its errors (bad input, a port in use) propagate to the caller."""
        global _current
        self.handle = self._start()
        self._set("serving", Health(True))
        _current = self
        return self.handle

    def request_stop(self):
        self._stop.set()

    def run(self) -> int:
        """Checks and heals until ``request_stop()`` (returns 0) or a crash loop / a failed restart."""
        if self.handle is None:
            self.start()
        while not self._stop.wait(self.check_interval):
            health = self._check(self.handle, self.handle.stubs, timeout=max(2.0, self.check_interval * 2))
            if health.ready and self.stall_timeout:
                health = self._stalled() or health
            process_died = not health.reason.startswith("tritonserver: /v2/health/ready")   # or stalled
            if health.ready:
                self._unready_since = None
                self._set(health=health)
                continue
            now = time.monotonic()
            if not process_died and self._unready_since is None and self.is_ready():
                # one probe missing its timeout on a loaded machine is not a server that cannot serve (it
                # flapped readiness while requests succeeded): a second miss in a row says so
                self._unready_since = now
                continue
            self._set(health=health)
            self._unready_since = self._unready_since or now
            if process_died or now - self._unready_since >= HTTP_GRACE_SECONDS:
                code = self._restart(health.reason)
                if code is not None:
                    return code
        return 0

    def _stalled(self) -> Health | None:
        try:
            text = self.handle.metrics()
        except Exception:            # OSError, or http.client's IncompleteRead from a server dying mid-answer:
            return None              # Triton's readiness check covers an unreachable server
        reason = self._stall.update(text)
        return Health(False, reason) if reason else None

    def _restart(self, cause: str) -> int | None:
        detected = time.monotonic()
        self._recent.append(detected)
        while self._recent and detected - self._recent[0] > self.restart_window:
            self._recent.popleft()
        with self._lock:
            self.last_cause = cause
            self._phase = "restarting"
        if len(self._recent) > self.max_restarts:
            self._set("crash loop")
            self.handle.kill()
            self._log(f"supervisor: crash loop: {len(self._recent)} crashes within {self.restart_window:.0f} s "
                      f"(--max_restarts {self.max_restarts}); last: {cause}; stopping (exit {EXIT_CRASH_LOOP})")
            return EXIT_CRASH_LOOP
        self.restarts += 1
        self._log(f"supervisor: {cause}; restarting tritonserver on the same ports (restart {self.restarts})")
        tail = self.handle.log_tail(5)
        kept = self._keep_log(self.handle)
        self.handle.kill()
        if tail.strip():
            self._log(f"supervisor: last server log lines:\n{tail}")
        if kept:
            self._log(f"supervisor: the crashed server's whole log: {kept}")
        deadline = detected + self.restart_timeout
        error = None
        while time.monotonic() < deadline and not self._stop.is_set():
            try:
                self.handle = self._start(ready_timeout=max(1.0, deadline - time.monotonic()))
                break
            except (NemospecError, OSError) as e:   # a port not free yet, fork or disk failing under the
                error = e                            # pressure that killed the server: again until the deadline
                self._log(f"supervisor: restart failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}; "
                          "retrying")
                self._stop.wait(1.0)
        else:
            if self._stop.is_set():
                return 0
            self._set("failed")
            self._log(f"supervisor: tritonserver not serving {self.restart_timeout:.0f} s after the crash ({error}); "
                      f"stopping (exit {EXIT_RESTART_FAILED})")
            return EXIT_RESTART_FAILED
        self._stall = StallWatch(self.stall_timeout)
        with self._lock:
            self.last_recovery_seconds = time.monotonic() - detected
            self._phase, self._health = "serving", Health(True)
        self._unready_since = None
        where = getattr(self.handle, "log_path", None)
        self._log(f"supervisor: serving again {self.last_recovery_seconds:.1f} s after: {cause}"
                  + (f"; server log {where}" if where else ""))
        return None

    def _keep_log(self, handle) -> Path | None:
        """A copy of the crashed run's server log (its stub tracebacks too) outside the run directory,
        which the kill removes, in the user's crash-log directory, which keeps the last KEPT_LOGS."""
        source = getattr(handle, "log_path", None)
        if source is None or not Path(source).is_file():
            return None
        where = Path(tempfile.gettempdir()) / f"nemospec-crash-logs-{os.getuid()}"
        kept = where / f"{time.strftime('%Y%m%d-%H%M%S')}-pid{os.getpid()}-restart{self.restarts}.log"
        try:
            where.mkdir(mode=0o700, exist_ok=True)
            shutil.copyfile(source, kept)
            for old in sorted(where.glob("*.log"), key=lambda p: p.stat().st_mtime)[:-KEPT_LOGS]:
                old.unlink(missing_ok=True)
        except OSError:
            return None
        return kept

    def stop(self):
        self._stop.set()
        with self._lock:
            self._phase = "stopping"
        if self.handle is not None:
            self.handle.stop()


# --- the readiness endpoint ----------------------------------------------------------------------------
def serve_health(supervisor: Supervisor, host: str, port: int) -> ThreadingHTTPServer:
    """``/health/ready`` (200 / 503 + JSON state), ``/health/live`` (200 while the supervisor runs),
    ``/health`` (the state, always 200), ``/metrics`` (restart count, last cause, readiness) from a
    daemon thread. ``server.shutdown()`` stops it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?", 1)[0].rstrip("/")
            if path == "/metrics":
                body, status, kind = supervisor.metrics_text().encode(), 200, "text/plain; version=0.0.4"
            elif path in ("/health/ready", "/health/live", "/health"):
                state = supervisor.state()
                status = 503 if path == "/health/ready" and not state["ready"] else 200
                body, kind = json.dumps(state).encode(), "application/json"
            else:
                body, status, kind = b'{"error": "not found: /health/ready, /health/live, /health, /metrics"}', 404, \
                    "application/json"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="nemospec-health", daemon=True).start()
    return server
