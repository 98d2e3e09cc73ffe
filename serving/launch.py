"""Starting and stopping ``tritonserver`` for an engine directory.

``start_server`` fills the model repository into a run directory, starts the server and waits until
``/v2/health/ready``. The returned handle stops it (SIGTERM, then SIGKILL of its whole process group,
the Python stubs included, after ``shutdown_timeout``) or kills it at once (``kill``, for a restart);
``serving(...)`` is the same as a context manager. The child is also killed if this process dies
(``PR_SET_PDEATHSIG``: call from a thread that outlives the server, e.g. the main thread) or exits
(``atexit``).
"""
from __future__ import annotations

import atexit
import collections
import errno
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from builder.errors import NemospecError
from serving.cancel import notify_drain, notify_shutdown
from serving.health import StallWatch, shared_memory_files, start_time, stub_processes, triton_ready, what_died
from serving.http_guard import HttpGuard
from serving.limits import limits_from
from serving.repository import fill_model_repo
from serving.tritonserver import assemble_backends, gpu_present, server_env, find_tritonserver

API_KEY_HEADER = "api-key"                              # HTTP header for --api_key
GRPC_API_KEY_HEADER = "triton-grpc-protocol-api-key"    # the same as gRPC metadata (Triton adds the prefix)
RESTRICTED = "model-repository,shared-memory"           # what --api_key protects
ABORT_SECONDS = 2.5      # the last part of a stop: requests still in flight are ended with an error
DRAIN_SETTLE = 0.2       # after the model's last final response of a drain, before Triton is signalled


_handed_out: collections.deque = collections.deque(maxlen=256)   # free_port's recent answers


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and none this process was given lately: nothing binds a port
    between two calls (``{flag: free_port() for flag in ...}``), so a random pick could repeat and
    hand one server the same port twice (its gRPC and metrics: it exited). Triton binds its ports
    only after its models load, so a port from the kernel's ephemeral range can meanwhile become
    another socket's outgoing port: ``$NEMOSPEC_PORT_RANGE`` (``LO-HI``, below that range) picks from
    a range of the caller's own instead (the test suite gives each xdist worker one)."""
    span = os.environ.get("NEMOSPEC_PORT_RANGE", "")
    candidates = []
    if span:
        low, high = (int(v) for v in span.split("-"))
        candidates = [random.randint(low, high) for _ in range(256)]
    for port in candidates + [0] * 64:   # 0: the kernel picks
        if port and port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.append(port)
            return port
    raise NemospecError(f"no free port on {host}")


def check_port_free(host: str, port: int, flag: str) -> None:
    """Refuses a port another socket listens on before anything starts: tritonserver binds its gRPC
    and metrics ports only after every model has loaded (minutes of warm-up for a compiled draft).
    SO_REUSEADDR as a server binds, so a port whose old connections linger in TIME_WAIT passes."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise NemospecError(f"{flag}: {host}:{port} is already in use") from None
            raise NemospecError(f"{flag}: cannot bind {host}:{port}: {e.strerror or e}") from None


def _pdeathsig():  # runs in the child: die with the parent
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


@dataclass
class ServerHandle:
    process: subprocess.Popen
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    run_dir: Path
    repo_dir: Path
    log_path: Path
    command: list
    _temp: bool = False
    _log_file: object = field(default=None, repr=False)
    shutdown_timeout: float = 6.0
    stubs: dict = field(default_factory=dict)    # {pid: model} of the Python stubs when it became ready
    stub_starts: dict = field(default_factory=dict, repr=False)   # {pid: start_time}: the same processes later
    _group_killed: bool = field(default=False, repr=False)
    guard: object = field(default=None, repr=False)   # serving.http_guard.HttpGuard on http_port, if any
    shm_files: set = field(default_factory=set)     # its stubs' shared memory, removed once it is gone
    stopping: str | None = None                     # set when stop() begins: the drain refuses new requests

    @property
    def http_url(self) -> str:
        return f"{_client_host(self.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{_client_host(self.host)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{_client_host(self.host)}:{self.metrics_port}/metrics"

    def endpoints(self) -> dict:
        return {"http": f"http://{self.http_url}", "grpc": self.grpc_url, "metrics": self.metrics_url,
                "generate": f"http://{self.http_url}/v2/models/ensemble/generate",
                "generate_stream": f"http://{self.http_url}/v2/models/ensemble/generate_stream"}

    def alive(self) -> bool:
        return self.process.poll() is None

    def dead_now(self) -> str | None:
        """What of this server died, read from the process table at this moment (tritonserver, or a
        model's Python stub seen at readiness); None while all live. A few /proc reads: cheap
        enough for every readiness probe."""
        return what_died(self.process, self.stubs)

    def not_ready_now(self) -> str | None:
        """Why a request sent now would not be served: the stop under way (its drain refuses new
        requests while Triton itself still says ready), or what died; None while it can serve."""
        return self.stopping or self.dead_now()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def started(self, *ports: int) -> bool:
        """Whether this server's own log says it starts every one of ``ports`` (Triton logs "Started
        HTTPService at HOST:PORT" per service once the models are loaded). A ready answer on the HTTP
        port alone can come before the metrics service binds, or from another server that took the
        loopback port picked for this one's Triton HTTP before it could bind it."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return False
        bound = set(re.findall(r'"Started \w+(?: \w+)? at [^"]*:(\d+)\s*"', text))
        return all(str(port) in bound for port in ports)

    def metrics_answer(self) -> bool:
        """Whether the metrics port answers: Triton logs "Started Metrics Service" before it binds the
        port, and exits after, when the port was taken."""
        try:
            self.metrics()
            return True
        except OSError:   # refused, reset, timed out (a foreign listener that never answers)
            return False

    def errors(self) -> str:
        """The server log's error lines (glog ``E...``), e.g. why a model failed to load."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        noise = ("NVML", "DCGM", "insufficient for CUDA runtime", "CudaDriverHelper")   # a machine without a GPU says so
        return "\n".join(line for line in lines if re.match(r"^E\d{4} ", line) and not any(n in line for n in noise))

    def exit_reason(self) -> str:
        """Why this server ended before it was ready: its exit (a signal named), its error lines, and,
        when it was killed or aborted (no error line says why), the end of its log."""
        code = self.process.returncode
        how = f"code {code}"
        if code is not None and code < 0:
            try:
                how = f"signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"signal {-code}"
        errors = self.errors()
        detail = errors if errors and (code is None or code >= 0) else "\n".join(filter(None, [
            errors, "the end of its log:", self.log_tail(15)]))
        return f"tritonserver exited with {how} before it was ready:\n{detail}"

    def metrics(self, timeout: float = 10.0) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=timeout) as r:
            return r.read().decode()

    def _own_stubs(self) -> list[int]:
        """The stubs seen at readiness that are still those processes: once a stub exits and is reaped,
        its pid goes to another process (another test's Triton, say), which must not be signalled."""
        return [pid for pid in self.stubs if start_time(pid) is not None and start_time(pid) == self.stub_starts.get(pid)]

    def _kill_group(self) -> None:
        """SIGKILL to the server's process group (it leads one: start_new_session) while its pid is still
        its own (not reaped), and to every stub seen that is still the same process, so no child
        outlives it; then reap the server. Once only."""
        if self._group_killed:
            return
        self._group_killed = True
        stubs = self._own_stubs()
        if self.process.poll() is None:   # a server killed before it was ready: its files now
            self.shm_files |= shared_memory_files([self.process.pid, *stubs, *stub_processes(self.process.pid)])
        # a reaped server's pid (its group's id) may already lead another process group
        group = [(os.killpg, self.process.pid)] if self.process.returncode is None else []
        for kill, pid in group + [(os.kill, pid) for pid in stubs]:
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> int | None:
        """At once, no grace (a server that cannot serve any more): requests in flight get a
        connection error. Then cleans up as ``stop``."""
        self._kill_group()
        return self.stop()

    def stop(self, timeout: float | None = None) -> int | None:
        """Drains, then SIGTERM, within ``timeout`` seconds (default ``shutdown_timeout``), then SIGKILL
        of the process group. Idempotent.

        Draining comes before Triton is signalled: Triton 2.51's gRPC endpoint delivers no stream
        response once it is (the OpenAI frontend's streams, and a gRPC client's, hung until the kill,
        then read as a crash), while its HTTP endpoint goes on. The speculative model refuses new
        requests with the stop's error and serves those it holds; ABORT_SECONDS before the end it
        ends what is left with that error, while every endpoint still delivers it."""
        timeout = self.shutdown_timeout if timeout is None else timeout
        if self.process.poll() is None:
            self.stopping = "the server is shutting down"
            end = time.monotonic() + timeout
            self._drain(end - ABORT_SECONDS)
            try:
                self.process.send_signal(signal.SIGTERM)   # what the drain left: other models' requests
                self.process.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        self._kill_group()       # stubs left behind (e.g. after the server was killed) go too
        for path in self.shm_files:   # a server that exits removes its own; a killed one cannot
            with suppress(OSError):
                os.unlink(path)
        self.shm_files = set()
        if self.guard is not None:
            self.guard.close()
            self.guard = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._temp:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self._temp = False
        atexit.unregister(self.stop)
        return self.process.returncode

    def _drain(self, until: float) -> None:
        """Tells the speculative stubs to refuse new requests and waits until they hold none, or until
        ``until``; then tells them to end what is left with the stop's error and waits for that, up to
        ABORT_SECONDS / 2 more. Returns at once when no stub took the word or the metrics do not
        answer (a server that cannot serve); each scrape waits at most until the deadline."""
        cancel_dir = self.run_dir / "cancel"
        stubs = [pid for pid in self._own_stubs() if self.stubs[pid] == "speculative" and notify_drain(cancel_dir, pid)]

        def held(deadline: float) -> float | None:
            try:
                return StallWatch.in_flight(self.metrics(timeout=min(1.0, max(0.1, deadline - time.monotonic()))))[1]
            except Exception:   # refused, timed out, cut mid-answer: nothing to wait for
                return None
        busy = held(until) if stubs else None
        if busy is None:
            return
        while busy and time.monotonic() < until:
            time.sleep(0.05)
            busy = held(until)
        if busy:
            for pid in stubs:
                notify_shutdown(cancel_dir, pid)
            until += ABORT_SECONDS / 2
            while busy and time.monotonic() < until:
                time.sleep(0.05)
                busy = held(until)
        # the last responses pass postprocessing to their clients, and a request that reached Triton
        # just before the word gets its refusal, before Triton stops delivering gRPC responses
        time.sleep(DRAIN_SETTLE)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _triton_command(server, repo_dir, backend_dir, triton_http: int, host: str, grpc_port: int, metrics_port: int,
                    shutdown_timeout: float, api_key: str | None, extra_args) -> list[str]:
    """tritonserver's command line: its HTTP on a loopback port (behind the guard), gRPC and metrics on
    ``host``."""
    cmd = [str(server.binary), "--model-repository", str(repo_dir), "--model-control-mode", "none",
           "--strict-model-config", "true",
           "--exit-timeout-secs", str(int(shutdown_timeout) + 10),   # ours comes first (stop())
           "--http-address", "127.0.0.1", "--http-port", str(triton_http),
           "--grpc-address", host, "--grpc-port", str(grpc_port),
           "--allow-metrics", "true", "--metrics-address", host, "--metrics-port", str(metrics_port),
           "--allow-gpu-metrics", "true" if gpu_present() else "false", "--log-verbose", "0"]
    if backend_dir is not None:
        cmd += ["--backend-directory", str(backend_dir)]
    return cmd + restricted_api_args(api_key) + list(extra_args)


def restricted_api_args(api_key: str | None) -> list[str]:
    """tritonserver's flags that ask for the key on the endpoints it protects (``RESTRICTED``), over
    HTTP and gRPC."""
    if not api_key:
        return []
    return [f"--http-restricted-api={RESTRICTED}:{API_KEY_HEADER}={api_key}",
            f"--grpc-restricted-protocol={RESTRICTED}:{API_KEY_HEADER}={api_key}"]


TRITON_PORT_TRIES = 3   # launches of Triton when the loopback port picked for its HTTP was taken meanwhile


def start_server(engine_dir, *, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, model_repo_dir=None, api_key: str | None = None, backend: str = "auto",
                 torch_threads: int = 0, warm_up: str = "all", max_batch_size: int | None = None, max_queue: int = 64,
                 logprobs_mode: str = "processed_logprobs", ready_timeout: float = 600.0,
                 extra_args=(), draft_policy: dict | None = None, shutdown_timeout: float = 6.0,
                 limits: dict | None = None) -> ServerHandle:
    """Fills the model repository, starts tritonserver and waits until it is ready.

    A temporary run directory holds the assembled backend, the server log and (unless
    ``model_repo_dir`` names one) the model repository; ``stop()`` removes it. Any error, Ctrl-C
    included, kills the child before it propagates. ``shutdown_timeout``: how long ``stop()`` lets
    in-flight requests run (the last ABORT_SECONDS of it, the speculative model ends what is left with an
    error; Triton's own exit timeout is longer: once expired, it left Triton 2.51 hanging).
    ``limits``: request limits (``serving.limits``). Triton's own HTTP port is a free loopback port
    behind an ``HttpGuard`` on ``host:http_port`` that refuses bodies over ``max_body_bytes``.
    """
    server = find_tritonserver()
    limits = limits_from(limits)
    run_dir = Path(tempfile.mkdtemp(prefix="nemospec-serve-"))
    handle = guard = None
    try:
        triton_http = free_port()
        try:
            guard = HttpGuard(host, http_port, triton_http, limits["max_body_bytes"],
                              alive=lambda: handle.not_ready_now() if handle is not None else None)
        except OSError as e:
            raise NemospecError(f"--http_port: cannot bind {host}:{http_port}: {e.strerror or e}") from None
        for port, flag, service in ((grpc_port, "--grpc_port", "grpc"), (metrics_port, "--metrics_port", "metrics")):
            if not re.search(rf"--allow-{service}[= ]false", " ".join(extra_args)):
                check_port_free(host, port, flag)
        repo_dir = fill_model_repo(engine_dir, Path(model_repo_dir).resolve() if model_repo_dir else run_dir / "models",
                                   backend=backend, torch_threads=torch_threads, warm_up=warm_up,
                                   max_batch_size=max_batch_size,
                                   max_queue=max_queue, logprobs_mode=logprobs_mode,
                                   cancel_dir=run_dir / "cancel", draft_policy=draft_policy, limits=limits)
        backend_dir = assemble_backends(server, run_dir)
        deadline = time.monotonic() + ready_timeout
        for attempt in range(TRITON_PORT_TRIES):
            cmd = _triton_command(server, repo_dir, backend_dir, triton_http, host, grpc_port, metrics_port,
                                  shutdown_timeout, api_key, extra_args)
            log_path = run_dir / ("tritonserver.log" if attempt == 0 else f"tritonserver.{attempt}.log")
            log_file = open(log_path, "wb")
            process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=server_env(server), cwd=str(run_dir), start_new_session=True,
                                       preexec_fn=_pdeathsig)
            # the run directory and the guard go with the handle once this Triton is ready
            handle = ServerHandle(process, host, http_port, grpc_port, metrics_port, run_dir, repo_dir, log_path, cmd,
                                  False, log_file, shutdown_timeout)
            atexit.register(handle.stop)
            ports = [triton_http] + [port for port, service in ((grpc_port, "grpc"), (metrics_port, "metrics"))
                                     if not re.search(rf"--allow-{service}[= ]false", " ".join(extra_args))]
            while not (handle.started(*ports) and triton_ready(handle.http_url)
                       and (metrics_port not in ports or handle.metrics_answer())):
                if process.poll() is not None:
                    break
                if any(f":{port}' already in use" in handle.errors() for port in ports):
                    # fatal to Triton, which then unloads its models and exits; under load 2.51 can hang
                    # in that shutdown past its exit timeout (a start waited out ready_timeout, 300 s)
                    handle._kill_group()
                    break
                if time.monotonic() > deadline:
                    raise NemospecError(f"tritonserver not ready after {ready_timeout:.0f} s; last log lines:\n"
                                        f"{handle.log_tail()}")
                # its stubs' shared memory as they start: a Triton that then exits on its own before it
                # is ready (its HTTP port taken) leaves them behind
                handle.shm_files |= shared_memory_files([process.pid, *stub_processes(process.pid)])
                time.sleep(0.25)
            else:
                handle.guard, handle._temp = guard, True
                break
            # the loopback port picked for Triton's own HTTP was taken while the models loaded: another one
            if f":{triton_http}' already in use" in handle.errors() and attempt + 1 < TRITON_PORT_TRIES:
                handle.kill()
                triton_http = free_port()
                guard.retarget(triton_http)
                continue
            for port, flag in ((grpc_port, "--grpc_port"), (metrics_port, "--metrics_port")):
                if f":{port}' already in use" in handle.errors():
                    raise NemospecError(f"{flag}: {host}:{port} is already in use (tritonserver could not bind it)")
            if f":{triton_http}' already in use" in handle.errors():   # killed by us, not a crash
                raise NemospecError(f"tritonserver's own HTTP port: each of the {TRITON_PORT_TRIES} free loopback "
                                    f"ports picked for it was taken before it bound it (the last {triton_http})")
            raise NemospecError(handle.exit_reason())
        handle.stubs = stub_processes(process.pid)
        handle.stub_starts = {pid: start_time(pid) for pid in handle.stubs}
        handle.shm_files |= shared_memory_files([process.pid, *handle.stubs])
        return handle
    except BaseException:
        owned = handle is not None and handle.guard is not None
        if handle is not None:
            handle.kill()
        if guard is not None and not owned:
            guard.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        raise



@contextmanager
def serving(engine_dir, **kwargs):
    """``with serving(engine_dir, http_port=..., ...) as server:`` - always stopped on exit."""
    handle = start_server(engine_dir, **kwargs)
    try:
        yield handle
    finally:
        handle.stop()
