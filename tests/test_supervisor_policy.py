"""The supervisor's decisions without a server (fake handles): restart after a crash, crash loop ->
exit 3, a restart that keeps failing -> exit 1, and the readiness endpoint's answers."""
import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from builder.errors import NemospecError
from serving import health, supervisor
from serving.launch import free_port

DIED = "the Python stub of model 'speculative' (pid 1) died"


class FakeHandle:
    def __init__(self, dead_after=0.0):
        self.process = SimpleNamespace(pid=10**6, returncode=None)
        self.stubs, self.killed, self.born = {}, False, time.monotonic()
        self.dead_after = dead_after

    def dead(self):
        return time.monotonic() - self.born >= self.dead_after

    def log_tail(self, lines=5):
        return ""

    def metrics(self):
        return ""

    def kill(self):
        self.killed = True

    def stop(self):
        pass


def _run_until_restarted(s, restarts: int = 1, until=lambda: True):
    """Runs the supervisor in a thread until it has restarted ``restarts`` times and ``until()``
    holds (10 s at most), then stops it."""
    thread = threading.Thread(target=s.run)
    thread.start()
    deadline = time.monotonic() + 10
    while (s.restarts < restarts or not until()) and time.monotonic() < deadline:
        time.sleep(0.01)
    s.request_stop()
    thread.join(10)


def check(handle, stubs, timeout):
    return health.Health(False, DIED) if handle.dead() else health.Health(True)


def test_crash_loop_exits_3_after_max_restarts():
    handles, logs = [], []

    def start(ready_timeout=None):
        handles.append(FakeHandle(dead_after=0.05))
        return handles[-1]

    s = supervisor.Supervisor(start, check_interval=0.01, max_restarts=2, restart_window=60, check=check,
                              log=logs.append)
    assert s.run() == supervisor.EXIT_CRASH_LOOP
    assert s.restarts == 2 and len(handles) == 3 and all(h.killed for h in handles)
    assert s.last_cause == DIED and not s.is_ready() and s.state()["phase"] == "crash loop"
    assert any("crash loop: 3 crashes within 60 s (--max_restarts 2)" in m for m in logs), logs


def test_crashes_spread_out_are_not_a_loop():
    handles = []

    def start(ready_timeout=None):
        handles.append(FakeHandle(dead_after=0.3))
        return handles[-1]

    s = supervisor.Supervisor(start, check_interval=0.01, max_restarts=1, restart_window=0.2, check=check,
                              log=lambda m: None)

    def stop_after_three():   # restarts come every ~0.3 s; a loaded machine may take longer
        deadline = time.monotonic() + 30
        while s.restarts < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        s.request_stop()

    threading.Thread(target=stop_after_three, daemon=True).start()
    assert s.run() == 0
    assert s.restarts >= 3, "each crash fell outside the window of the previous one"


def test_restart_that_keeps_failing_exits_1():
    calls = []

    def start(ready_timeout=None):
        calls.append(1)
        if len(calls) > 1:
            raise NemospecError("tritonserver exited with code 1 before it was ready: port in use")
        return FakeHandle()

    s = supervisor.Supervisor(start, check_interval=0.01, restart_timeout=1.5, check=check, log=lambda m: None)
    start_time = time.monotonic()
    assert s.run() == supervisor.EXIT_RESTART_FAILED
    assert 1.4 < time.monotonic() - start_time < 5 and len(calls) >= 2 and s.state()["phase"] == "failed"


def test_a_metrics_read_cut_short_or_a_failed_fork_does_not_end_the_supervisor():
    """A server dying mid-answer to the metrics scrape raised http.client.IncompleteRead (not an
    OSError), and a restart's fork failing (EAGAIN under the memory pressure that killed the server)
    raised OSError: each ended `serve` with a traceback instead of a restart."""
    import http.client
    calls, logs = [], []

    class Cut(FakeHandle):
        def metrics(self):
            raise http.client.IncompleteRead(b"nemo")

    def start(ready_timeout=None):
        calls.append(1)
        if len(calls) == 2:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return Cut(dead_after=0.05 if len(calls) == 1 else 1e9)

    s = supervisor.Supervisor(start, check_interval=0.01, restart_timeout=5, check=check, log=logs.append)
    _run_until_restarted(s, until=lambda: len(calls) >= 3)
    assert len(calls) >= 3 and s.state()["phase"] != "failed", logs
    assert any("restart failed: [Errno 11]" in line for line in logs), logs


def test_a_crashed_servers_log_is_kept_and_the_new_one_named(tmp_path):
    """A restart removed the crashed run's directory, its whole server log (the stub tracebacks) with
    it, and the log path printed at start then named nothing."""
    handles, logs = [], []

    def start(ready_timeout=None):
        h = FakeHandle(dead_after=0.05 if not handles else 1e9)
        h.log_path = tmp_path / f"tritonserver.{len(handles)}.log"
        h.log_path.write_text(f"run {len(handles)}: Traceback (most recent call last)\n")
        handles.append(h)
        return h

    s = supervisor.Supervisor(start, check_interval=0.01, check=check, log=logs.append)
    # until the new server is up and named: the restart is counted before it starts (a loaded run's
    # stop came between the two, and no second server was ever started)
    _run_until_restarted(s, until=lambda: len(handles) > 1 and any(f"server log {handles[1].log_path}" in line
                                                                 for line in logs))
    kept = [line.split(": ", 2)[-1] for line in logs if "the crashed server's whole log" in line]
    assert kept and open(kept[0]).read() == "run 0: Traceback (most recent call last)\n", logs
    assert any(f"server log {handles[1].log_path}" in line for line in logs), logs
    assert len(list(Path(kept[0]).parent.glob("*.log"))) <= supervisor.KEPT_LOGS


def test_readiness_endpoint_and_is_ready():
    s = supervisor.Supervisor(lambda **kw: FakeHandle(dead_after=1e9), check_interval=0.01, check=check)
    s.start()
    port = free_port()
    server = supervisor.serve_health(s, "127.0.0.1", port)
    try:
        url = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{url}/health/ready", timeout=5) as r:
            assert r.status == 200 and json.loads(r.read())["ready"] is True
        assert health.is_ready(f"{url}/health/ready") and health.is_ready(s)
        assert supervisor.current() is s and supervisor.is_ready(), "this process's supervisor"
        s._set(health=health.Health(False, DIED))
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{url}/health/ready", timeout=5)
        assert e.value.code == 503 and json.loads(e.value.read())["reason"] == DIED
        assert not health.is_ready(f"{url}/health/ready") and not health.is_ready(s) and not supervisor.is_ready()
        with urllib.request.urlopen(f"{url}/health/live", timeout=5) as r:
            assert r.status == 200
        s.restarts, s.last_cause = 2, 'a "quoted" cause'
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert "nemospec_supervisor_restarts_total 2" in text and "nemospec_supervisor_ready 0" in text
        assert 'nemospec_supervisor_last_restart_info{cause="a \\"quoted\\" cause"} 1' in text
    finally:
        server.shutdown()
        server.server_close()
    assert not health.is_ready(f"http://127.0.0.1:{port}/health/ready"), "nothing listening: not ready"


def test_one_missed_readiness_probe_is_not_unready_but_two_are():
    """Under load one probe of Triton's readiness missed its timeout, and readiness flapped to 503 (the
    OpenAI frontend refused 29 requests) while requests to Triton succeeded."""
    slow = health.Health(False, "tritonserver: /v2/health/ready is not 200")
    script = iter([health.Health(True), slow, health.Health(True), slow, slow] + [health.Health(True)] * 10**6)
    seen = []

    def scripted(handle, stubs, timeout):
        answer = next(script)
        seen.append(answer)
        return answer

    s = supervisor.Supervisor(lambda **kw: FakeHandle(dead_after=1e9), check_interval=0.05, check=scripted,
                              stall_timeout=0)
    states = []
    thread = threading.Thread(target=s.run)
    s.start()
    thread.start()
    deadline = time.monotonic() + 10
    while len(seen) < 7 and time.monotonic() < deadline:
        states.append((len(seen), s.is_ready()))
        time.sleep(0.001)
    s.request_stop()
    thread.join(10)
    unready = sorted({n for n, ready in states if not ready})
    # not ready only after the second miss in a row (seen as 6 where the 6th check has answered, not yet set)
    assert unready and min(unready) >= 5 and max(unready) <= 6, states
    assert s.restarts == 0


def test_bad_flags():
    with pytest.raises(NemospecError, match="--max_restarts"):
        supervisor.Supervisor(lambda: None, max_restarts=-1)
    with pytest.raises(NemospecError, match="--restart_window"):
        supervisor.Supervisor(lambda: None, restart_window=0)


def _metrics(steps, active, queued=0):
    return "\n".join(f'{name}{{model="speculative"}} {value}' for name, value in
                     (("nemospec_steps_total", steps), ("nemospec_active_sequences", active),
                      ("nemospec_queued_requests", queued))) + "\n"


def test_a_model_whose_every_step_raises_is_not_ready():
    """A device error that sticks fails every request quickly: steps_total never moves but nothing is
    in flight for long, so the stall watch saw no stall and every readiness endpoint said 200."""
    w = health.StallWatch(120)
    failing = _metrics(10, 0) + 'nemospec_failed_steps_in_a_row{model="speculative"} %d\n'
    assert w.update(failing % 2, now=0) is None
    assert "failing: its last 3 scheduler steps raised" in w.update(failing % 3, now=1)
    assert w.update(failing % 0, now=2) is None


def test_stall_watch_needs_requests_in_flight_and_no_step():
    w = health.StallWatch(5)
    assert w.update(_metrics(10, 1), now=0) is None
    assert w.update(_metrics(10, 1), now=4) is None
    assert "stalled: 1 requests in flight and no scheduler step for 6 s" in w.update(_metrics(10, 1), now=6)
    assert w.update(_metrics(11, 1), now=7) is None, "a step is progress"
    assert w.update(_metrics(11, 0, queued=2), now=11) is None
    assert w.update(_metrics(11, 0, queued=2), now=13) is not None, "queued requests waiting count too"
    assert w.update(_metrics(11, 0), now=100) is None, "nothing in flight: no verdict"
    assert w.update("", now=200) is None, "no speculative metrics (yet)"


def test_a_stub_stuck_with_requests_in_flight_is_restarted_as_stalled():
    """The stall watch wired into the loop: a live stub whose scheduler stops stepping while a
    request is in flight (a deadlock; SIGSTOP, which the end-to-end test used, is now a death of its
    own) is not ready and restarted after --stall_timeout, with the stall as the cause."""
    class Stuck(FakeHandle):
        def metrics(self):
            return _metrics(10, 1)     # one sequence active, the step count never moves

    handles, logs = [], []

    def start(ready_timeout=None):
        handles.append(Stuck(dead_after=1e9))
        return handles[-1]

    s = supervisor.Supervisor(start, check_interval=0.02, stall_timeout=0.2, max_restarts=1, restart_window=60,
                              check=check, log=logs.append)
    _run_until_restarted(s)
    assert s.restarts >= 1 and handles[0].killed and "stalled: 1 requests in flight" in s.last_cause, logs


def test_stall_watch_counts_requests_the_gauges_have_not_shown():
    """A stub stopped right after a request's first tokens may not have published its gauges (every
    0.1 s): the received-minus-ended counters still say a request is in flight."""
    def text(received, ended):
        return _metrics(10, 0) + (f'nemospec_requests_received_total{{model="speculative"}} {received}\n'
                                  f'nemospec_requests_total{{model="speculative",outcome="completed"}} {ended - 1}\n'
                                  f'nemospec_requests_total{{outcome="rejected",model="speculative"}} 1\n'
                                  f'nemospec_requests_total{{model="ensemble2",outcome="completed"}} 7\n')
    w = health.StallWatch(2)
    assert w.update(text(5, 5), now=0) is None and w.update(text(5, 5), now=10) is None, "all ended: idle"
    w = health.StallWatch(2)
    assert w.update(text(6, 5), now=0) is None
    assert "stalled: 1 requests in flight" in w.update(text(6, 5), now=3)
    assert health.StallWatch.in_flight(text(6, 5)) == (10.0, 1.0)


def test_check_server_names_every_death():
    """A killed stub can take tritonserver down with it (SIGABRT) before the next check: the reason
    names both, so the operator sees the first cause, not only the server's exit code."""
    handle = SimpleNamespace(process=SimpleNamespace(pid=10**6, returncode=-6, poll=lambda: -6), alive=lambda: False)
    gone = 2**22 + 12345      # above the kernel's pid_max default: no such process
    reason = health.check_server(handle, {gone: "speculative"}).reason
    assert reason == (f"the Python stub of model 'speculative' (pid {gone}) died; "
                      f"tritonserver (pid {10**6}) exited with code -6")
    assert health.check_server(handle, {}).reason == f"tritonserver (pid {10**6}) exited with code -6"


def test_a_stopped_stub_is_named_until_it_resumes():
    """A SIGSTOPped stub fails every request (Triton: "Stub process ... is not healthy") while Triton's
    readiness, and so ours, said 200: it is now as good as dead (the supervisor restarts the server)."""
    import signal
    import subprocess
    import sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        process = SimpleNamespace(pid=os.getpid(), returncode=None, poll=lambda: None)   # the stub's parent
        assert health.what_died(process, {child.pid: "speculative"}) is None
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not health.process_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert health.what_died(process, {child.pid: "speculative"}) == (
            f"the Python stub of model 'speculative' (pid {child.pid}) is stopped (SIGSTOP or a tracer)")
        child.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while health.process_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert health.what_died(process, {child.pid: "speculative"}) is None
    finally:
        child.kill()
        child.wait()
