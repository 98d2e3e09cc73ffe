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


def process_alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


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


def triton_ready(http_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def check_server(handle, stubs: dict[int, str], timeout: float = 2.0) -> Health:
    """``handle``: a ``serving.launch.ServerHandle``; ``stubs``: {pid: model} seen when it became ready."""
    if not handle.alive():
        return Health(False, f"tritonserver (pid {handle.process.pid}) exited with code {handle.process.returncode}")
    for pid, model in sorted(stubs.items()):
        if not process_alive(pid):
            return Health(False, f"the Python stub of model '{model}' (pid {pid}) died")
    if not triton_ready(handle.http_url, timeout):
        return Health(False, "tritonserver: /v2/health/ready is not 200")
    return Health(True)


class StallWatch:
    """A stub that is alive but stuck (a deadlocked scheduler, a stopped process): requests are in
    flight (``nemospec_active_sequences`` + ``nemospec_queued_requests`` > 0 on the metrics port) and
    ``nemospec_steps_total`` has not moved for ``timeout`` seconds. No request in flight: no verdict."""

    METRIC = re.compile(r'^(nemospec_steps_total|nemospec_active_sequences|nemospec_queued_requests)'
                        r'\{[^}]*model="speculative"[^}]*\} ([0-9.eE+-]+)$', re.M)

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._steps = None
        self._since = None

    def update(self, metrics_text: str, now: float | None = None) -> str | None:
        """The stall's reason, or None."""
        now = time.monotonic() if now is None else now
        values = {name: float(value) for name, value in self.METRIC.findall(metrics_text)}
        if "nemospec_steps_total" not in values:
            return None
        busy = values.get("nemospec_active_sequences", 0) + values.get("nemospec_queued_requests", 0)
        if not busy or values["nemospec_steps_total"] != self._steps:
            self._steps, self._since = values["nemospec_steps_total"], now
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
