"""The C allocator of processes that run models: mimalloc, preloaded, instead of glibc's malloc.

Why: a compiled CPU step allocates its intermediate buffers and output tensors on every call
(64-byte aligned, so glibc's ``posix_memalign`` path: ``_int_malloc``, chunk splitting and fastbin
consolidation, 7-12% of an eagle3 draft chain's profile). With mimalloc (the ``cmeel-mimalloc``
wheel) preloaded, two processes timed side by side on the two cores of one machine: eagle3 draft
chain 0.24-0.26 ms against 0.28-0.29, whole generations +8-16% speculative and +4-19% target-only.
A preload is the only way to reach every allocation (torch's, inductor's C++ wrapper's, Python's
larger objects), so the commands that run models re-execute themselves once with ``LD_PRELOAD`` set
(``reexec``), as PyTorch's own CPU launcher does with jemalloc, and ``nemospec serve`` hands the
same variable to ``tritonserver``, whose Python-backend stubs run the models.
``NEMOSPEC_MALLOC=system`` keeps glibc's.
"""
from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

from builder.errors import NemospecError

CHOICES = ("mimalloc", "system")
_MARK = "NEMOSPEC_MALLOC_PRELOADED"   # set by ``reexec`` in the process it starts: never twice


def choice(env=None) -> str:
    """``$NEMOSPEC_MALLOC`` (default mimalloc); a clear error for anything else."""
    value = (env if env is not None else os.environ).get("NEMOSPEC_MALLOC", "mimalloc").strip().lower() or "mimalloc"
    if value not in CHOICES:
        raise NemospecError(f"NEMOSPEC_MALLOC: expected one of {', '.join(CHOICES)}, got {value!r}")
    return value


def library() -> Path | None:
    """The mimalloc shared library the cmeel-mimalloc wheel installed (None where it is absent or
    this is not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        dist = importlib.metadata.distribution("cmeel-mimalloc")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if Path(str(f)).name == "libmimalloc.so":
            path = Path(dist.locate_file(f)).resolve()
            return path if path.is_file() else None
    return None


def preload_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's) with mimalloc first in ``LD_PRELOAD``, unless
    ``NEMOSPEC_MALLOC=system`` or the library is absent; entries already there are kept."""
    env = dict(os.environ if env is None else env)
    lib = library()
    if choice(env) != "mimalloc" or lib is None:
        return env
    kept = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p and Path(p).name != lib.name]
    env["LD_PRELOAD"] = " ".join([str(lib), *kept])
    return env


def active() -> str:
    """The allocator this process runs on: ``mimalloc <version>`` when it is mapped, else ``system``."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    if "libmimalloc" not in maps:
        return "system"
    try:
        return f"mimalloc {importlib.metadata.version('cmeel-mimalloc')}"
    except importlib.metadata.PackageNotFoundError:
        return "mimalloc"


def reexec() -> None:
    """Restarts this process with mimalloc preloaded (same interpreter, arguments and environment
    plus ``LD_PRELOAD``), once; returns where there is nothing to do (already preloaded, tried
    before, ``NEMOSPEC_MALLOC=system``, no library). Call it first thing in an entry point, never
    from library code: it replaces the running process."""
    if os.environ.get(_MARK) or active() != "system":
        return
    env = preload_env()
    if env.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD"):
        return
    env[_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def preload() -> None:
    """``reexec`` for an entry point: a bad ``NEMOSPEC_MALLOC`` is one line on stderr and exit 2."""
    try:
        reexec()
    except NemospecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
