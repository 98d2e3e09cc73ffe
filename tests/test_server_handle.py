"""ServerHandle signals only its own processes. pid_max is 32768 on these machines and a test run
wraps it within minutes, so a stub pid recorded at readiness, or a reaped server's pid (its process
group's id), can belong to another server by the time a handle stops: a stale SIGKILL once took a
module's Triton down in the middle of its tests. No Triton here: sleeping processes stand in."""
import os
import signal
import subprocess
import time

from serving import launch
from serving.health import start_time, what_died


def _handle(process, stubs, starts, tmp_path):
    return launch.ServerHandle(process, "127.0.0.1", 1, 2, 3, tmp_path, tmp_path, tmp_path / "log", [],
                               stubs=stubs, stub_starts=starts)


def _sleeper(**kwargs):
    return subprocess.Popen(["sleep", "60"], **kwargs)


def _gone(process, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return True
        time.sleep(0.02)
    return False


def test_a_recorded_stub_pid_now_held_by_another_process_is_left_alone(tmp_path):
    server, other = _sleeper(start_new_session=True), _sleeper()
    try:   # the recorded start differs: the pid was reused by ``other`` after the stub was reaped
        handle = _handle(server, {other.pid: "speculative"}, {other.pid: start_time(other.pid) - 1}, tmp_path)
        handle._kill_group()
        assert _gone(server) and server.returncode == -signal.SIGKILL
        assert other.poll() is None, "another process with a stub's old pid was killed"
    finally:
        other.kill()
        other.wait()


def test_a_stub_that_is_still_the_same_process_is_killed(tmp_path):
    server, stub = _sleeper(start_new_session=True), _sleeper(start_new_session=True)   # outside the group
    handle = _handle(server, {stub.pid: "speculative"}, {stub.pid: start_time(stub.pid)}, tmp_path)
    handle._kill_group()
    assert _gone(server) and _gone(stub) and stub.returncode == -signal.SIGKILL


def test_a_reaped_servers_group_is_not_signalled(tmp_path, monkeypatch):
    server = _sleeper(start_new_session=True)
    server.kill()
    server.wait()     # reaped: its pid, and so its group's id, may now lead another server's group
    sent = []
    monkeypatch.setattr(os, "killpg", lambda pid, sig: sent.append(pid))
    _handle(server, {}, {}, tmp_path)._kill_group()
    assert sent == []


def test_a_stub_pid_held_by_a_process_that_is_not_the_servers_child_counts_as_dead(tmp_path):
    server, other = _sleeper(), _sleeper()
    try:
        assert what_died(server, {other.pid: "speculative"}) == (
            f"the Python stub of model 'speculative' (pid {other.pid}) died")
    finally:
        for p in (server, other):
            p.kill()
            p.wait()
