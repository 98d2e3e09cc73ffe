"""A server's warm-up in parallel: helper processes compile its steps beside it.

A cold start compiles every step a server's requests run, tens of seconds each on a CPU and minutes
in all, one after another in one process (inductor's code generation is single-threaded Python), while
the machine's other cores idle. The compiled-step store already shares steps between processes: one
process claims a step, compiles and saves it; any other that reaches it waits for the claim and loads
it (``store.claim``). So the warm-up splits nothing: helper processes open the same engine directory
the same way and run the same warm-up units, each starting at another unit, while the server runs them
from the first. Each step is compiled once, by whichever process reaches it first, and loaded by the
others. The server still runs every unit itself, so a helper that dies or lags costs nothing but its
share; once the server's warm-up ends the helpers are stopped.

``NEMOSPEC_WARM_UP_HELPERS``: how many (default: one per idle core, at most 3, fewer where memory
would not hold another copy of the weights three times over; 0: none).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

HELPERS_ENV = "NEMOSPEC_WARM_UP_HELPERS"
MAX_HELPERS = 3
ROOT = Path(__file__).resolve().parents[2]


def _available_memory() -> int | None:
    """Free memory: the host's MemAvailable, or less where a cgroup (a container) limits this
    process (v2 ``memory.max`` less ``memory.current``, else v1's limit and usage)."""
    free = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit, used in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            free.append(int(Path(limit).read_text()) - int(Path(used).read_text()))
            break
        except (OSError, ValueError):   # "max": no limit; or no such cgroup file
            continue
    return min(free) if free else None


def _cores() -> int:
    """The cores this process may run on (its affinity: a container's cpuset), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def helper_count(engine_dir, units: int) -> int:
    """Helpers to start for ``units`` warm-up units of ``engine_dir``: ``NEMOSPEC_WARM_UP_HELPERS``
    if set, else one per core beyond the first, at most ``MAX_HELPERS`` and one fewer than the units,
    each with room for three times the engine directory's bytes (its weights, their packed copy and
    the compile's own)."""
    given = os.environ.get(HELPERS_ENV, "").strip()
    if given:
        try:
            return max(0, min(int(given), units - 1))
        except ValueError:
            raise ValueError(f"{HELPERS_ENV}={given!r}: expected a number of helper processes (0: none)") from None
    count = min(MAX_HELPERS, _cores() - 1, units - 1)
    weights = sum(f.stat().st_size for f in Path(engine_dir).rglob("*") if f.is_file())
    memory = _available_memory()
    if memory is not None and weights:
        count = min(count, memory // (3 * weights) - 1)
    return max(0, count)


def _die_with_parent():   # runs in the child
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def start(reopen: dict, units: list, log=None) -> list[subprocess.Popen]:
    """Starts the helpers for ``units`` (JSON values): helper i runs them last to first, from the
    ``i * len(units) / helpers``-th of that order on, wrapping round. ``reopen``: how the server opened
    its engine (``engine_dir``, ``backend``, ``threads``, ``policy``: its draft-policy flags, name ->
    value, as ``runtime.draft_policy.policy_from`` takes them)."""
    from runtime.compiled import steps
    if not steps._skip_guards():   # steps checked by dynamo's guards are not saved: nothing to share
        return []
    count = helper_count(reopen["engine_dir"], len(units))
    helpers = []
    for i in range(count):   # last unit first: the server's first units are what the later ones reuse
        backwards, first = units[::-1], i * len(units) // count
        spec = {**reopen, "units": backwards[first:] + backwards[:first], "parent": os.getpid()}
        try:   # dies with the server's process (a supervisor's kill -9 leaves no helper compiling on)
            helpers.append(subprocess.Popen([sys.executable, "-m", "runtime.compiled.warm_helper", json.dumps(spec)],
                                            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            preexec_fn=_die_with_parent))
        except OSError as e:   # no helper: the server compiles every step itself, as without them
            if log is not None:
                log(f"warm-up: no helper process ({e})")
            break
    if helpers and log is not None:
        log(f"warm-up: {len(helpers)} helper process(es) compile steps beside this one ({HELPERS_ENV})")
    return helpers


def stop(helpers: list[subprocess.Popen], store_dir: Path | None = None) -> None:
    """Ends the helpers (the server has every step by now) and removes what a killed one left
    half-written in the step store (``store.save`` writes ``NAME.tmpPID`` before renaming it)."""
    for helper in helpers:
        if helper.poll() is None:
            helper.kill()
        helper.wait()
        if store_dir is not None:
            for partial in (Path(store_dir) / "steps").glob(f"*.tmp{helper.pid}"):
                partial.unlink(missing_ok=True)
