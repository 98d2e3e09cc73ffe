"""Compiled steps kept on disk whole (dynamo's trace, the AOT graph and inductor's code), so that a
later process loads a step in about a second instead of tracing it again: inductor's own cache
skips only code generation, and re-tracing a step took 3-24 s here (a server's whole warm-up
125-160 s with a warm inductor cache).

A step's file is named by a digest of everything its graph depends on: nemospec's and torch's code,
the CPU's instruction set, the torch thread count, the compile options, which ops trace as Triton kernels
(builder.backends.gpu.graph_state), the step's key and the
shapes of its inputs (dims marked dynamic left out), and the modules it runs, weights included
(weights are graph inputs, but a digest over their bytes keeps a graph from ever meeting a model it
was not traced for). A file that fails to load is ignored and the step compiles as before.

The store is bounded: a step whose weights are baked in as constants is as large as its model (the
wide benchmark target's: ~95 MB each; one machine's store had grown to 39 GB), and every change of
code names new files, so after each save the least recently used steps go until the store is within
``$NEMOSPEC_COMPILE_CACHE_GB`` (default 16) and the disk keeps ``$NEMOSPEC_COMPILE_CACHE_RESERVE_GB``
(default 4) free. A load marks a step used.

Processes sharing a store (a test run's workers, a server beside a benchmark) compile a step once:
``claim`` holds a lock per step file while one process looks for it and compiles it, and another
that needs the same step waits for the file instead of compiling it again (the suite's workers had
compiled the same eagle3 steps twice, 6-9 s each). A wait is bounded (``CLAIM_WAIT_S``) and a
process takes one claim at a time, so no two can wait on each other for long.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
import time
import warnings
import weakref
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]   # the repository
_CODE_DIRS = ("builder", "runtime", "plugins")
_code_digest: list[str] = []


def code_digest() -> str:
    """nemospec's sources (Python and the C++ kernel), torch, Python and the CPU capability."""
    if not _code_digest:
        h = hashlib.sha256()
        for d in _CODE_DIRS:
            for p in sorted((ROOT / d).rglob("*")):
                if p.suffix in (".py", ".cpp") and "__pycache__" not in p.parts:
                    h.update(str(p.relative_to(ROOT)).encode())
                    h.update(p.read_bytes())
        h.update(f"{torch.__version__} {sys.version} {torch.backends.cpu.get_cpu_capability()} "
                 f"{os.environ.get('NEMOSPEC_SMALL_LINEAR', '1')}".encode())
        _code_digest.append(h.hexdigest())
    return _code_digest[0]


def _walk(obj, h, seen: set, depth: int = 0) -> None:
    """Feeds ``h`` with every tensor (dtype, shape, bytes) and plain value reachable from ``obj``
    through attributes, lists, tuples and dicts, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.device.type != "meta" and t.numel():
            t = t.cpu().contiguous().view(-1)
            h.update((t if t.dtype == torch.bool else t.view(torch.uint8)).numpy().tobytes())
        return
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        h.update(repr(obj).encode())
        return
    if id(obj) in seen or depth > 12:
        h.update(b"<seen>")
        return
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        h.update(f"[{len(obj)}".encode())
        for item in obj:
            _walk(item, h, seen, depth + 1)
    elif isinstance(obj, dict):
        h.update(f"{{{len(obj)}".encode())
        for k in sorted(obj, key=repr):
            h.update(repr(k).encode())
            _walk(obj[k], h, seen, depth + 1)
    elif hasattr(obj, "__dict__") and not callable(obj):
        h.update(type(obj).__qualname__.encode())
        for k in sorted(vars(obj)):
            h.update(k.encode())
            _walk(vars(obj)[k], h, seen, depth + 1)
    else:
        h.update(type(obj).__qualname__.encode())


_PLAIN = (bool, int, float, str, type(None), torch.Tensor)


_module_digests: dict = {}   # id(module) -> (weak ref, digest): a model's weights never change once built


def _module_digest(module) -> str:
    """One module's digest, computed once per process while it lives (a target's five step kinds
    share it)."""
    hit = _module_digests.get(id(module))
    if hit is not None and hit[0]() is module:
        return hit[1]
    h = hashlib.sha256()
    _walk(module, h, set())
    try:
        _module_digests[id(module)] = (weakref.ref(module), h.hexdigest())
    except TypeError:   # not weakly referable: not kept
        pass
    return h.hexdigest()


def fingerprint(objs) -> str:
    """A digest of the modules a step runs (its leading arguments and closure cells: a model module,
    or a runtime wrapper such as a draft stepper, whose ``module`` and plain attributes count, not
    its state of graphs and call counts)."""
    h = hashlib.sha256()
    for obj in objs:
        if hasattr(obj, "module") and not isinstance(obj, torch.Tensor):
            h.update(type(obj).__qualname__.encode())
            _walk({k: v for k, v in vars(obj).items() if isinstance(v, _PLAIN)}, h, set())
            h.update(_module_digest(obj.module).encode())
        elif hasattr(obj, "__dict__") and not callable(obj):   # a model module
            h.update(_module_digest(obj).encode())
        else:
            _walk(obj, h, set())
    return h.hexdigest()


def _signature(x) -> str:
    if isinstance(x, torch.Tensor):
        dynamic = getattr(x, "_dynamo_weak_dynamic_indices", set()) | getattr(x, "_dynamo_dynamic_indices", set())
        return f"T{x.dtype}{tuple(-1 if i in dynamic else d for i, d in enumerate(x.shape))}"
    if isinstance(x, dict):
        return "{" + ",".join(f"{k!r}:{_signature(v)}" for k, v in sorted(x.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(_signature(v) for v in x) + "]"
    return repr(x)


def step_path(directory: Path, what: str, key, options: dict, lead_digest: str, args, kwargs) -> Path:
    """The file of one step's graph."""
    h = hashlib.sha256()
    from builder.backends import gpu
    for part in (code_digest(), what, repr(key), repr(sorted(options.items(), key=lambda kv: kv[0])), lead_digest,
                 _signature(args), _signature(kwargs), str(torch.get_num_threads()), gpu.graph_state()):
        h.update(part.encode())
        h.update(b"\0")
    return Path(directory) / "steps" / f"{h.hexdigest()}.bin"


def load(path: Path):
    """The step saved at ``path``, guards off, or None (absent or unreadable: it compiles)."""
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            fn = torch.compiler.load_compiled_function(f)
        fn.disable_guard_check()
        os.utime(path)   # used: the last to go when the store is pruned
        return fn
    except Exception as e:  # another torch, a truncated file: compile instead
        warnings.warn(f"{path}: compiled step not loaded ({type(e).__name__}: {str(e)[:120]}); compiling it",
                      stacklevel=3)
        return None


CLAIM_WAIT_S = 240.0       # longer than any one step's compile measured here (Zen 1: ~90 s)
_claimed: list = []        # this process's claim, while it holds one


@contextlib.contextmanager
def claim(path: Path):
    """While held, no other process that claims ``path`` compiles it: the caller loads the step if it
    is there, else compiles and saves it. Waits (polling, at most CLAIM_WAIT_S) while another process
    holds the claim; a nested claim, or one that cannot lock, goes ahead without waiting."""
    if _claimed:
        yield
        return
    lock = Path(path).parent.parent / "claims" / (Path(path).stem + ".lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        os.utime(lock)   # in use: prune keeps it
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + CLAIM_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        _claimed.append(path)
        try:
            yield
        finally:
            _claimed.pop()
    finally:
        os.close(fd)   # releases the lock; the empty lock file stays (prune removes old ones)


def _gigabytes(variable: str, default: float) -> int:
    try:
        return int(float(os.environ.get(variable) or default) * 2**30)
    except ValueError:
        raise ValueError(f"${variable}: expected a number of gigabytes, got {os.environ[variable]!r}") from None


def prune(directory: Path, keep: Path | None = None) -> list[Path]:
    """Removes the least recently used saved steps under ``directory`` until the rest fit in
    ``$NEMOSPEC_COMPILE_CACHE_GB`` and the disk has ``$NEMOSPEC_COMPILE_CACHE_RESERVE_GB`` free;
    ``keep`` (the step just saved) stays. Returns what it removed."""
    limit = _gigabytes("NEMOSPEC_COMPILE_CACHE_GB", 16)
    reserve = _gigabytes("NEMOSPEC_COMPILE_CACHE_RESERVE_GB", 4)
    files = []
    for p in (Path(directory) / "steps").glob("*.bin"):
        try:
            st = p.stat()
        except FileNotFoundError:   # another process pruned it
            continue
        files.append((st.st_mtime, st.st_size, p))
    files.sort(key=lambda f: f[0])
    total = sum(size for _, size, _ in files)
    free = shutil.disk_usage(directory).free
    removed = []
    for _, size, p in files:
        if total <= limit and free >= reserve:
            break
        if keep is not None and p == keep:
            continue
        try:
            p.unlink()
        except FileNotFoundError:
            continue
        total -= size
        free += size
        removed.append(p)
    for lock in (Path(directory) / "claims").glob("*.lock"):   # claims nobody has taken for a day
        with contextlib.suppress(OSError):
            if time.time() - lock.stat().st_mtime > 86400:
                lock.unlink()
    return removed


def save(captured, path: Path) -> None:
    """Writes a freshly compiled step (atomically), then prunes the store; a step that cannot be
    saved (a full disk) stays in memory only, and its partial file is removed."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        captured.save_compiled_function(str(tmp))
        os.replace(tmp, path)
    except Exception as e:
        tmp.unlink(missing_ok=True)
        warnings.warn(f"{path}: compiled step not saved ({type(e).__name__}: {str(e)[:120]})", stacklevel=3)
    removed = prune(path.parent.parent, keep=path)
    if removed:
        print(f"compiled-step store: removed {len(removed)} least recently used step(s) "
              "($NEMOSPEC_COMPILE_CACHE_GB bounds it)", file=sys.stderr, flush=True)
