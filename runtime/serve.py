"""`nemospec serve`: a real Triton Inference Server for an engine directory.

``start_server`` fills the ``model_repo/`` templates for one engine directory into a run directory,
locates ``tritonserver`` (a ``tritonserver`` on PATH where a GPU is present, the NGC image's; the
binary inside the ``nvidia-pytriton`` wheel otherwise, with a python backend directory assembled
from the wheel's backend and the stub for this Python), starts it, and waits until
``/v2/health/ready``. The returned handle stops the server (SIGTERM, then SIGKILL after a grace
period); ``serving(...)`` is the same as a context manager. The child is also killed if this process
dies (``PR_SET_PDEATHSIG``: call from a thread that outlives the server, e.g. the main thread) or
exits (``atexit``).

The rest holds the small helpers the ``model_repo`` Python models share, kept here so tests reach
them without Triton: stop/bad word lists, incremental detokenization for streaming, and the side
channel that carries a client's cancellation from ``postprocessing`` to ``speculative``.
"""
from __future__ import annotations

import atexit
import csv
import json
import os
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from builder.errors import NemospecError
from runtime.draft_policy import POLICY_FLAGS, add_policy_args, policy_from

ROOT = Path(__file__).resolve().parent.parent          # the directory holding runtime/ and model_repo/
TEMPLATES = ROOT / "model_repo"
MODELS = ("ensemble", "preprocessing", "speculative", "postprocessing")
API_KEY_HEADER = "api-key"                              # HTTP header for --api_key
GRPC_API_KEY_HEADER = "triton-grpc-protocol-api-key"    # the same as gRPC metadata (Triton adds the prefix)
RESTRICTED = "model-repository,shared-memory"           # what --api_key protects
BACKENDS = ("auto", "torch", "compiled", "tensorrt")


# --- finding and preparing tritonserver ------------------------------------------------------------
@dataclass
class Tritonserver:
    binary: Path
    backend_dir: Path | None = None      # python backend to assemble (wheel); None: the binary's default
    stub: Path | None = None
    libs: Path | None = None             # LD_LIBRARY_PATH addition (the wheel's bundled libraries)
    source: str = "PATH"


def _gpu_present() -> bool:
    return Path("/dev/nvidiactl").exists()


def _wheel_tritonserver() -> Tritonserver | None:
    try:
        import pytriton
    except ImportError:
        return None
    base = Path(pytriton.__file__).parent / "tritonserver"
    stub = base / "python_backend_stubs" / f"{sys.version_info[0]}.{sys.version_info[1]}" / "triton_python_backend_stub"
    binary = base / "bin" / "tritonserver"
    if not (binary.is_file() and stub.is_file()):
        return None
    return Tritonserver(binary, base / "backends" / "python", stub, base.parent.parent / "nvidia_pytriton.libs",
                        "nvidia-pytriton wheel")


def find_tritonserver() -> Tritonserver:
    """``NEMOSPEC_TRITONSERVER`` if set; on a GPU machine a ``tritonserver`` on PATH (the NGC image);
    otherwise the nvidia-pytriton wheel's binary (CPU-only machines), else PATH."""
    forced = os.environ.get("NEMOSPEC_TRITONSERVER")
    if forced:
        if not Path(forced).is_file():
            raise NemospecError(f"NEMOSPEC_TRITONSERVER: {forced} is not a file")
        return Tritonserver(Path(forced), source="NEMOSPEC_TRITONSERVER")
    on_path = shutil.which("tritonserver")
    wheel = _wheel_tritonserver()
    if on_path and (_gpu_present() or wheel is None):
        return Tritonserver(Path(on_path))
    if wheel is not None:
        return wheel
    raise NemospecError("tritonserver not found: install the nvidia-pytriton wheel (`pip install nvidia-pytriton==0.7.0`, "
                        "CPU-only machines) or run inside the NGC Triton image (docker/Dockerfile)")


def _assemble_backends(server: Tritonserver, run_dir: Path) -> Path | None:
    """The wheel's python backend + the stub for this Python, in one backend directory."""
    if server.backend_dir is None:
        return None
    target = run_dir / "backends" / "python"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(server.backend_dir, target, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(server.stub, target / "triton_python_backend_stub")
    return target.parent


# --- the model repository --------------------------------------------------------------------------
def read_engine_meta(engine_dir) -> dict:
    engine_dir = Path(engine_dir)
    path = engine_dir / "config.json"
    if not path.is_file():
        raise NemospecError(f"--engine_dir: {path} missing; build one with `nemospec build`")
    meta = json.loads(path.read_text())
    if "target" not in meta.get("engines", {}):
        raise NemospecError(f"--engine_dir: {path} has no 'engines.target'; not a nemospec engine directory")
    if not meta.get("tokenizer") or not (engine_dir / meta["tokenizer"]).is_file():
        raise NemospecError(f"--engine_dir: {engine_dir} has no tokenizer.json; the server takes and returns text, "
                            "so build from a checkpoint that has one")
    return meta


def encode_policy(overrides: dict) -> str:
    """Adaptive draft-length flags as one model-config string parameter: 'flag=value;...'."""
    return ";".join(f"{k}={v}" for k, v in overrides.items())


def decode_policy(text: str) -> SimpleNamespace:
    pairs = [item.split("=", 1) for item in text.split(";") if item]
    return SimpleNamespace(**{k: POLICY_FLAGS[k][0](v) for k, v in pairs})


def fill_model_repo(engine_dir, repo_dir, *, backend: str = "auto", max_batch_size: int | None = None,
                    max_queue: int = 64, cancel_dir=None, draft_policy: dict | None = None) -> Path:
    """Writes the four models of ``model_repo/`` for ``engine_dir`` into ``repo_dir`` (replacing them).

    ``cancel_dir`` is where the speculative model listens for cancellations the postprocessing model
    sees (default: a per-user directory under the system temp dir)."""
    if not (TEMPLATES / "ensemble" / "config.pbtxt").is_file():
        raise NemospecError(f"model_repo templates missing at {TEMPLATES}: install nemospec from a source checkout "
                            "(`pip install -e .`)")
    engine_dir = Path(engine_dir).resolve()
    meta = read_engine_meta(engine_dir)
    if backend not in BACKENDS:
        raise NemospecError(f"--backend: expected one of {', '.join(BACKENDS)}, got {backend}")
    if backend == "auto":
        # resolved here: without a GPU the server runs eagerly for now. The compiled path
        # (--backend compiled) compiles its steps inside the first requests, tens of seconds per step
        # on a cold cache, which would stall them (and readiness checks) behind it.
        import torch
        backend = "tensorrt" if torch.cuda.is_available() else "torch"
    engine_batch = int(meta["build"]["max_batch_size"])
    if max_batch_size is not None and not 1 <= max_batch_size <= engine_batch:
        raise NemospecError(f"--max_batch_size: expected 1..{engine_batch} (the engine's max_batch_size), got {max_batch_size}")
    if max_queue < 0:
        raise NemospecError(f"--max_queue: expected >= 0, got {max_queue}")
    cancel_dir = Path(cancel_dir) if cancel_dir else Path(tempfile.gettempdir()) / f"nemospec-cancel-{os.getuid()}"
    cancel_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    overrides = {k: v for k, v in (draft_policy or {}).items() if v is not None}
    if meta.get("speculative"):  # a bad flag exits 2 here, not inside the model
        policy_from(int(meta["build"]["max_draft_len"]), meta["build"], SimpleNamespace(**overrides))
    values = dict(engine_dir=str(engine_dir), backend=backend, nemospec_root=str(ROOT), cancel_dir=str(cancel_dir.resolve()),
                  max_batch_size=str(max_batch_size or engine_batch), max_queue=str(max_queue),
                  draft_policy=encode_policy(overrides))
    repo_dir = Path(repo_dir)
    repo_dir.mkdir(parents=True, exist_ok=True)
    for name in MODELS:
        src, dst = TEMPLATES / name, repo_dir / name
        if dst.exists():
            shutil.rmtree(dst)
        (dst / "1").mkdir(parents=True)
        text = (src / "config.pbtxt").read_text()
        (dst / "config.pbtxt").write_text(string.Template(text).substitute(values))
        if (src / "1" / "model.py").is_file():
            shutil.copy2(src / "1" / "model.py", dst / "1" / "model.py")
    return repo_dir


# --- the server process ----------------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def errors(self) -> str:
        """The server log's error lines (glog ``E...``), e.g. why a model failed to load."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        noise = ("NVML", "DCGM", "insufficient for CUDA runtime")   # a machine without a GPU says so
        return "\n".join(line for line in lines if re.match(r"^E\d{4} ", line) and not any(n in line for n in noise))

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            return r.read().decode()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (Triton finishes in-flight requests), SIGKILL after ``timeout`` seconds. Idempotent."""
        if self.process.poll() is None:
            try:
                self.process.send_signal(signal.SIGTERM)
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
            except ProcessLookupError:
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._temp:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self._temp = False
        atexit.unregister(self.stop)
        return self.process.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_server(engine_dir, *, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, model_repo_dir=None, api_key: str | None = None, backend: str = "auto",
                 max_batch_size: int | None = None, max_queue: int = 64, ready_timeout: float = 600.0,
                 extra_args=(), draft_policy: dict | None = None) -> ServerHandle:
    """Fills the model repository, starts tritonserver and waits until it is ready.

    A temporary run directory holds the assembled backend, the server log and (unless
    ``model_repo_dir`` names one) the model repository; ``stop()`` removes it. Any error, Ctrl-C
    included, kills the child before it propagates.
    """
    server = find_tritonserver()
    run_dir = Path(tempfile.mkdtemp(prefix="nemospec-serve-"))
    handle = None
    try:
        repo_dir = fill_model_repo(engine_dir, Path(model_repo_dir).resolve() if model_repo_dir else run_dir / "models",
                                   backend=backend, max_batch_size=max_batch_size, max_queue=max_queue,
                                   cancel_dir=run_dir / "cancel", draft_policy=draft_policy)
        backend_dir = _assemble_backends(server, run_dir)
        cmd = [str(server.binary), "--model-repository", str(repo_dir), "--model-control-mode", "none",
               "--strict-model-config", "true", "--exit-timeout-secs", "15",
               "--http-address", host, "--http-port", str(http_port),
               "--grpc-address", host, "--grpc-port", str(grpc_port),
               "--allow-metrics", "true", "--metrics-address", host, "--metrics-port", str(metrics_port),
               "--allow-gpu-metrics", "true" if _gpu_present() else "false", "--log-verbose", "0"]
        if backend_dir is not None:
            cmd += ["--backend-directory", str(backend_dir)]
        if api_key:
            cmd += [f"--http-restricted-api={RESTRICTED}:{API_KEY_HEADER}={api_key}",
                    f"--grpc-restricted-protocol={RESTRICTED}:{API_KEY_HEADER}={api_key}"]
        cmd += list(extra_args)
        log_path = run_dir / "tritonserver.log"
        log_file = open(log_path, "wb")
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=_server_env(server), cwd=str(run_dir), start_new_session=True,
                                   preexec_fn=_pdeathsig)
        handle = ServerHandle(process, host, http_port, grpc_port, metrics_port, run_dir, repo_dir, log_path, cmd,
                              True, log_file)
        atexit.register(handle.stop)
        deadline = time.monotonic() + ready_timeout
        while not _ready(handle.http_url):
            if process.poll() is not None:
                raise NemospecError(f"tritonserver exited with code {process.returncode} before it was ready:\n"
                                    f"{handle.errors() or handle.log_tail()}")
            if time.monotonic() > deadline:
                raise NemospecError(f"tritonserver not ready after {ready_timeout:.0f} s; last log lines:\n"
                                    f"{handle.log_tail()}")
            time.sleep(0.25)
        return handle
    except BaseException:
        if handle is not None:
            handle.stop(timeout=10)
        shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _server_env(server: Tritonserver) -> dict:
    env = dict(os.environ)
    # the python backend stub starts the interpreter found first on PATH: this one (and its venv)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    libs = [str(server.libs)] if server.libs else []
    libdir = sysconfig_libdir()
    if libdir and server.libs:
        libs.append(libdir)
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    return env


def sysconfig_libdir() -> str | None:
    """This interpreter's shared libpython directory, for a stub that links it (None if not shared)."""
    import sysconfig
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and sysconfig.get_config_var("Py_ENABLE_SHARED") and Path(libdir).is_dir():
        return libdir
    return None


@contextmanager
def serving(engine_dir, **kwargs):
    """``with serving(engine_dir, http_port=..., ...) as server:`` - always stopped on exit."""
    handle = start_server(engine_dir, **kwargs)
    try:
        yield handle
    finally:
        handle.stop()


# --- the `nemospec serve` command ------------------------------------------------------------------
def add_serve_args(p) -> None:
    p.add_argument("--engine_dir", required=True, help="engine directory built by `nemospec build` (with tokenizer.json)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 to accept other machines)")
    p.add_argument("--http_port", type=int, default=8000)
    p.add_argument("--grpc_port", type=int, default=8001)
    p.add_argument("--metrics_port", type=int, default=8002)
    p.add_argument("--model_repo_dir", default=None, help="where to write the filled model repository (default: a temporary directory)")
    p.add_argument("--api_key", default=None,
                   help=f"require the key on the model-repository and shared-memory endpoints (HTTP header "
                        f"'{API_KEY_HEADER}: KEY', gRPC metadata '{GRPC_API_KEY_HEADER}: KEY')")
    p.add_argument("--backend", default="auto", choices=list(BACKENDS),
                   help="auto: TensorRT on a GPU, else torch; compiled: the compiled CPU path (its first requests "
                        "wait for the compiles)")
    p.add_argument("--max_batch_size", type=int, default=None, help="sequences per step (default: the engine's)")
    p.add_argument("--max_queue", type=int, default=64, help="requests waiting beyond the batch; more are refused")
    add_policy_args(p, build=False)


def cmd_serve(args, out=print) -> int:
    """Runs until SIGINT/SIGTERM (exit 0) or until tritonserver dies (exit 1); bad input raises
    NemospecError (exit 2 from the CLI). The child is stopped on every path out."""
    def on_signal(signum, frame):
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    handle = None
    try:
        out(f"starting tritonserver for {args.engine_dir} ...", file=sys.stderr)
        handle = start_server(args.engine_dir, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                              metrics_port=args.metrics_port, model_repo_dir=args.model_repo_dir, api_key=args.api_key,
                              backend=args.backend, max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                              draft_policy={f: getattr(args, f, None) for f in POLICY_FLAGS})
        for name, url in handle.endpoints().items():
            out(f"{name:16s} {url}")
        out(f"model repository {handle.repo_dir}; server log {handle.log_path}", file=sys.stderr)
        out("ready; Ctrl-C (SIGINT) or SIGTERM stops the server", file=sys.stderr)
        sys.stdout.flush()
        while handle.alive():
            time.sleep(0.5)
        out(f"tritonserver exited with code {handle.process.returncode}; last log lines:\n{handle.log_tail()}",
            file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if handle is not None:
            out("stopping tritonserver ...", file=sys.stderr)
        return 0
    finally:
        if handle is not None:
            handle.stop()
        for s, h in previous.items():
            signal.signal(s, h)


# --- text helpers for the preprocessing / postprocessing models -----------------------------------
#: tokens of already-streamed text sent back with each new chunk: an incomplete UTF-8 character spans
#: at most 3 bytes (3 tokens), so 4 tokens of context always reach back past the held-back bytes
CONTEXT_TOKENS = 4
REPLACEMENT = "\ufffd"


def split_words(values) -> list[str]:
    """Each element may hold several comma-separated words (CSV quoting allowed, as TensorRT-LLM)."""
    words = []
    for value in values:
        text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
        if not text:
            continue
        for row in csv.reader([text]):
            words.extend(w for w in row if w)
    return words


def pack_word_ids(lists):
    """Token-id sequences -> int32 [2, N]: row 0 the ids back to back, row 1 each sequence's end
    offset; padded with 0 / -1 (never empty: N >= 1)."""
    import numpy as np
    flat = [t for ids in lists for t in ids]
    ends, total = [], 0
    for ids in lists:
        total += len(ids)
        ends.append(total)
    n = max(1, len(flat), len(ends))
    out = np.zeros((2, n), dtype=np.int32)
    out[1, :] = -1
    out[0, :len(flat)] = flat
    out[1, :len(ends)] = ends
    return out


def unpack_word_ids(array) -> tuple[tuple[int, ...], ...]:
    import numpy as np
    a = np.asarray(array).reshape(2, -1)
    words, start = [], 0
    for end in a[1]:
        end = int(end)
        if end < 0:
            break
        if end > start:
            words.append(tuple(int(t) for t in a[0, start:end]))
        start = end
    return tuple(words)


def stream_window(emitted, new) -> tuple[list[int], int]:
    """What the speculative model sends with ``new`` tokens after ``emitted`` ones were streamed:
    (the last CONTEXT_TOKENS emitted ids + new ids, how many of them were emitted before)."""
    context = list(emitted[-CONTEXT_TOKENS:]) if CONTEXT_TOKENS else []
    return context + list(new), len(context)


def stream_text(tokenizer, ids, prefix_len: int, finished: bool) -> str:
    """The text that ``ids[prefix_len:]`` adds after ``ids[:prefix_len]`` was already streamed.

    An incomplete UTF-8 character at the end (one trailing U+FFFD from the lossy decode) is held back
    until its remaining bytes arrive, so no chunk ever splits a character; ``finished`` flushes it.
    """
    ids = [int(t) for t in ids]
    before = tokenizer.decode(ids[:prefix_len]) if prefix_len else ""
    if before.endswith(REPLACEMENT):
        before = before[:-1]
    full = tokenizer.decode(ids)
    if not finished and full.endswith(REPLACEMENT):
        full = full[:-1]
    if full.startswith(before):
        return full[len(before):]
    # a decoder that is not prefix-stable (rare): fall back to the common prefix
    common = os.path.commonprefix([before, full])
    return full[len(common):]


# --- cancellation through the ensemble ------------------------------------------------------------
# Triton (2.51) propagates a client's cancellation of an ensemble request only to steps scheduled
# after it: the running decoupled ``speculative`` request never sees ``is_cancelled()``, but the
# ``postprocessing`` request made for its next response does. Each response therefore carries a
# request key (the speculative stub's pid and the scheduler's request id), and postprocessing sends
# the key of a cancelled request as one datagram to that stub's socket in ``cancel_dir``.
def request_key(pid: int, request_id: int) -> int:
    return (int(pid) << 32) | (int(request_id) & 0xFFFFFFFF)


def split_request_key(key: int) -> tuple[int, int]:
    return int(key) >> 32, int(key) & 0xFFFFFFFF


def cancel_socket_path(cancel_dir, pid: int) -> str:
    path = str(Path(cancel_dir) / f"speculative-{pid}.sock")
    if len(path.encode()) < 100:   # sun_path holds 108 bytes
        return path
    import hashlib                 # too long: a Linux abstract socket named after the directory
    return f"\0nemospec-{hashlib.sha256(str(cancel_dir).encode()).hexdigest()[:16]}-{pid}"


def notify_cancel(cancel_dir, key: int) -> bool:
    """Tells the speculative instance that owns ``key`` that its client cancelled (best effort)."""
    pid, request_id = split_request_key(key)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(str(request_id).encode(), cancel_socket_path(cancel_dir, pid))
        return True
    except OSError:
        return False


def cancel_listener(cancel_dir, on_cancel) -> "callable":
    """Binds this process's cancel socket and calls ``on_cancel(request_id)`` for each datagram from
    a daemon thread. Returns a function that closes it."""
    import threading
    path = cancel_socket_path(cancel_dir, os.getpid())
    Path(cancel_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.startswith("\0") and os.path.exists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.5)
    state = {"open": True}

    def run():
        while state["open"]:
            try:
                data = sock.recv(64)
            except socket.timeout:
                continue
            except OSError:
                break
            try:
                on_cancel(int(data.decode()))
            except Exception:  # a malformed datagram or a failing callback must not end the listener
                pass

    thread = threading.Thread(target=run, name="nemospec-cancel", daemon=True)
    thread.start()

    def close():
        state["open"] = False
        thread.join(timeout=2)
        sock.close()
        if not path.startswith("\0"):
            try:
                os.unlink(path)
            except OSError:
                pass

    return close
