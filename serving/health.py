"""Whether a running tritonserver can serve a request, told truthfully.

Triton 2.51 keeps ``/v2/health/ready`` and ``/v2/models/<model>/ready`` at 200 after a Python-backend
model's stub process died (``kill -9``, an OOM kill, a segfault): every request then fails with
``Stub process '<model>_0_0' is not healthy.`` and no Triton endpoint says so. ``check_server``
therefore looks at the processes too: the server alive, every model's stub process alive (a killed
stub stays a zombie, state ``Z``, until the server reaps it: that counts as dead), and Triton's own
readiness. ``is_ready(target)`` is the one call a frontend makes (see ``serving.supervisor``).
"""
from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

STUB_NAME = "triton_python_backend_stub"


@dataclass(frozen=True)
class Health:
    ready: bool
    reason: str = ""           # why not ready ("" when ready)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of a process, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None if it is gone. With the pid it names
    one process for good: a pid alone is reused once its process is reaped (pid_max is 32768 on
    these machines, and a test run wraps it in minutes)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[19])


def process_alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def process_stopped(pid: int) -> bool:
    """Stopped by a signal (state T) or by a tracer (t): alive, but it answers nothing until resumed."""
    stat = _stat(pid)
    return stat is not None and stat[0] in ("T", "t")


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[1] == pid:
                out.append(int(entry))
    return out


def stub_processes(server_pid: int) -> dict[int, str]:
    """{pid: model name} of the Python-backend stubs the server runs (a zombie has no cmdline: left out)."""
    stubs = {}
    for pid in children(server_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(STUB_NAME.encode()) and len(argv) > 1:
            stubs[pid] = Path(argv[1].decode(errors="replace")).parent.parent.name   # .../<model>/1/model.py
    return stubs


SHM_PREFIX = "/dev/shm/triton_python_backend_shm_region_"


def shared_memory_files(pids) -> set[str]:
    """The Python backend's shared-memory files (``/dev/shm/triton_python_backend_shm_region_*``, one
    per stub) that the processes ``pids`` hold open: Triton removes them when it exits, but not when
    it is killed, so whoever kills it removes them (a supervisor that restarts a killed server
    otherwise leaves ~1 MB or more in /dev/shm per stub and restart)."""
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(SHM_PREFIX):
                found.add(target)
    return found


def triton_ready(http_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def what_died(process, stubs: dict[int, str]) -> str | None:
    """What of a server died, read from the process table now: ``process`` (tritonserver's Popen) and
    ``stubs`` {pid: model}; None while all live. Every death seen is named: a killed stub can take the
    server down with it (SIGABRT) before anyone looks."""
    dead = []
    for pid, model in sorted(stubs.items()):
        stat = _stat(pid)   # alive, and still the server's child: not another process given its pid
        if stat is None or stat[0] in ("Z", "X") or stat[1] != process.pid:
            dead.append(f"the Python stub of model '{model}' (pid {pid}) died")
        elif process_stopped(pid):   # Triton fails every request to it ("not healthy") while its readiness says 200
            dead.append(f"the Python stub of model '{model}' (pid {pid}) is stopped (SIGSTOP or a tracer)")
    if process.poll() is not None:
        dead.append(f"tritonserver (pid {process.pid}) exited with code {process.returncode}")
    elif process_stopped(process.pid):
        dead.append(f"tritonserver (pid {process.pid}) is stopped (SIGSTOP or a tracer)")
    return "; ".join(dead) or None


def check_server(handle, stubs: dict[int, str], timeout: float = 2.0) -> Health:
    """``handle``: a ``serving.launch.ServerHandle``; ``stubs``: {pid: model} seen when it became ready."""
    dead = what_died(handle.process, stubs)
    if dead:
        return Health(False, dead)
    if not triton_ready(handle.http_url, timeout):
        return Health(False, "tritonserver: /v2/health/ready is not 200")
    return Health(True)


FAILING_STEPS = 3   # scheduler steps raising in a row that say the model cannot serve (restart it)


class StallWatch:
    """A stub that is alive but stuck (a deadlocked scheduler; a stopped one is dead, ``what_died``): requests are in
    flight and ``nemospec_steps_total`` has not moved for ``timeout`` seconds. No request in flight:
    no verdict.

    In flight is read two ways from the metrics port, the larger wins: the gauges
    (``nemospec_active_sequences`` + ``nemospec_queued_requests``), which the stub publishes at most
    every 0.1 s and so can still read 0 when it stops right after a request's first tokens; and
    ``nemospec_requests_received_total`` (counted in ``execute`` before any response) minus
    ``nemospec_requests_total`` over its outcomes (counted when a request ends), which cannot."""

    LINE = re.compile(r'^(nemospec_\w+)\{([^}]*)\} ([0-9.eE+-]+)$', re.M)
    MODEL = re.compile(r'(?:^|,)model="speculative"(?:,|$)')

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._steps = None
        self._since = None

    @classmethod
    def failed_steps(cls, metrics_text: str) -> float:
        return sum(float(v) for name, labels, v in cls.LINE.findall(metrics_text)
                   if name == "nemospec_failed_steps_in_a_row" and cls.MODEL.search(labels))

    @classmethod
    def in_flight(cls, metrics_text: str) -> tuple[float | None, float]:
        """(scheduler steps, requests in flight) of the speculative model; steps None: no metrics yet."""
        values: dict[str, float] = {}
        for name, labels, value in cls.LINE.findall(metrics_text):
            if cls.MODEL.search(labels):
                values[name] = values.get(name, 0.0) + float(value)   # nemospec_requests_total: every outcome
        gauges = values.get("nemospec_active_sequences", 0.0) + values.get("nemospec_queued_requests", 0.0)
        counted = values.get("nemospec_requests_received_total", 0.0) - values.get("nemospec_requests_total", 0.0)
        return values.get("nemospec_steps_total"), max(gauges, counted)

    def update(self, metrics_text: str, now: float | None = None) -> str | None:
        """The stall's reason, or None. Also a stub whose every step raises (a device error that sticks):
        FAILING_STEPS in a row fail every request while the process lives and answers ready."""
        now = time.monotonic() if now is None else now
        steps, busy = self.in_flight(metrics_text)
        if steps is None:
            return None
        failed = self.failed_steps(metrics_text)
        if failed >= FAILING_STEPS:
            return (f"the speculative model is failing: its last {failed:.0f} scheduler steps raised, each failing "
                    "every request in flight")
        if not busy or steps != self._steps:
            self._steps, self._since = steps, now
            return None
        if now - self._since >= self.timeout:
            return (f"the speculative model stalled: {busy:.0f} requests in flight and no scheduler step for "
                    f"{now - self._since:.0f} s (--stall_timeout {self.timeout:g})")
        return None


def is_ready(target, timeout: float = 2.0) -> bool:
    """True only while a request can be served. ``target``: a ``serving.supervisor.Supervisor`` (in the
    same process, e.g. an OpenAI frontend started by ``nemospec serve``), or the URL of a supervisor's
    readiness endpoint (``http://HOST:HEALTH_PORT/health/ready``, from another process)."""
    if hasattr(target, "is_ready"):
        return bool(target.is_ready())
    try:
        with urllib.request.urlopen(str(target), timeout=timeout) as r:
            return r.status == 200 and bool(json.loads(r.read() or b"{}").get("ready", True))
    except (urllib.error.URLError, OSError, ValueError):
        return False
