"""Whether readiness tells the truth across a kill -9, measured from outside (issue 40).

One cycle (``kill_cycle``): a prober per readiness URL asks every ~10 ms while short requests go back
to back; after a settle time one model process is killed (kill -9); the cycle ends once a request
begun after the process was gone has been served again. It records, relative to the moment the
process was gone:

* ``lies``: probes begun after that moment that answered 200 although a request begun after the
  probe's answer then failed (a load balancer trusting that answer would have sent a request to its
  failure); the goal is none;
* ``said_not_ready``: the URLs that answered anything but 200 at least once (each should);
* ``ready_again_s``: when ``ready()`` (the supervisor's readiness) was true again;
* ``served_again_s``: when the first request begun after the kill ended served.

Used by ``tests/test_supervisor.py`` (two cycles) and ``benchmarks/readiness_soak.py`` (``--cycles N``).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

from serving.health import process_alive


def get_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of a GET (None when nothing answered)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def generate_ok(http_url: str, prompt: str = "import os\nimport sys\n", max_tokens: int = 2,
                timeout: float = 60.0) -> bool:
    """One short greedy request to Triton's ``/v2/models/ensemble/generate`` (``http_url``: host:port):
    served or not."""
    request = urllib.request.Request(f"http://{http_url}/v2/models/ensemble/generate", method="POST",
                                     data=json.dumps({"text_input": prompt, "max_tokens": max_tokens, "end_id": -1,
                                                      "exclude_input_in_output": True}).encode())
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            r.read()
            return r.status == 200
    except (urllib.error.HTTPError, OSError):
        return False


def openai_ready_url(log: Callable[[], str], timeout: float = 30.0) -> str:
    """The OpenAI frontend's readiness URL, from the ``openai <url>/v1`` endpoint line `nemospec serve`
    prints once the frontend is up (``log``: the serve process's output so far)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in log().splitlines() if line.split()[:1] == ["openai"]]
        if lines:
            return lines[0].split()[1].removesuffix("/v1") + "/health/ready"
        if time.monotonic() > deadline:
            raise TimeoutError("no 'openai' endpoint line in the serve output")
        time.sleep(0.1)


@dataclass
class Cycle:
    served_before: int = 0          # requests served in the settle time before the kill
    failed_before: int = 0          # requests that failed then (should be none)
    probes: int = 0
    requests_after: int = 0         # requests begun after the process was gone
    failed_after: int = 0           # of them, failed
    lies: list = field(default_factory=list)            # (url, probe start in s after the process was gone)
    said_not_ready: set = field(default_factory=set)    # URLs that answered not ready after the kill
    ready_again_s: float | None = None
    served_again_s: float | None = None

    def summary(self) -> dict:
        return {"served_before": self.served_before, "failed_before": self.failed_before, "probes": self.probes,
                "requests_after": self.requests_after, "failed_after": self.failed_after,
                "ready_answers_while_failing": len(self.lies), "lies": self.lies[:5],
                "said_not_ready": sorted(self.said_not_ready),
                "ready_again_s": None if self.ready_again_s is None else round(self.ready_again_s, 3),
                "served_again_s": None if self.served_again_s is None else round(self.served_again_s, 3)}


def kill_cycle(urls, send: Callable[[], bool], find_pid: Callable[[], int], ready: Callable[[], bool], *,
               settle: float = 1.0, ready_timeout: float = 60.0, served_timeout: float = 30.0,
               interval: float = 0.01) -> Cycle:
    """One kill -9 cycle (see the module's doc). ``urls``: the readiness URLs to probe; ``send``: one
    short request, True when served; ``find_pid``: the process to kill, asked after the settle time;
    ``ready``: the readiness that says when to expect service again."""
    probes, requests, stop = [], [], threading.Event()

    def probe(url):
        while not stop.is_set():
            start = time.monotonic()
            status = get_status(url, timeout=2)
            probes.append((start, time.monotonic(), url, status))
            time.sleep(interval)

    def request():
        while not stop.is_set():
            start = time.monotonic()
            ok = send()
            requests.append((start, time.monotonic(), ok))

    threads = [threading.Thread(target=probe, args=(u,), daemon=True) for u in urls]
    threads.append(threading.Thread(target=request, daemon=True))
    for t in threads:
        t.start()
    cycle = Cycle()
    try:
        time.sleep(settle)
        before = list(requests)
        cycle.served_before = sum(ok for _, _, ok in before)
        cycle.failed_before = len(before) - cycle.served_before
        pid = find_pid()
        os.kill(pid, signal.SIGKILL)
        while process_alive(pid):
            time.sleep(0.0005)
        gone = time.monotonic()
        deadline = gone + ready_timeout
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        if ready():
            cycle.ready_again_s = time.monotonic() - gone
        deadline = time.monotonic() + served_timeout    # a request served after the restart ends the cycle
        while not any(ok and s > gone for s, _, ok in requests) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    after = [(s, e, ok) for s, e, ok in requests if s > gone]
    failed = [s for s, _, ok in after if not ok]
    cycle.requests_after, cycle.failed_after = len(after), len(failed)
    served = [e for _, e, ok in after if ok]
    cycle.served_again_s = min(served) - gone if served else None
    cycle.probes = len(probes)
    cycle.lies = [(url, round(start - gone, 3)) for start, end, url, status in probes
                  if status == 200 and start >= gone and any(f >= end for f in failed)]
    cycle.said_not_ready = {url for start, _, url, status in probes if start >= gone and status != 200}
    return cycle
