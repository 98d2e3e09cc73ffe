"""The side channel that carries a client's cancellation from ``postprocessing`` to ``speculative``."""
from __future__ import annotations

import os
import socket
from pathlib import Path

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


def _send(cancel_dir, pid: int, data: bytes) -> bool:
    """One datagram, never waiting: a hung listener's full queue (10 datagrams here) made sendto
    block for good, and with it a server's stop."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.setblocking(False)
            s.sendto(data, cancel_socket_path(cancel_dir, pid))
        return True
    except OSError:
        return False


def notify_cancel(cancel_dir, key: int) -> bool:
    """Tells the speculative instance that owns ``key`` that its client cancelled (best effort)."""
    pid, request_id = split_request_key(key)
    return _send(cancel_dir, pid, str(request_id).encode())


#: the datagram prefix that tells a speculative instance its client ended a request as complete (the
#: OpenAI frontend at a stop string, matched on the text): counted completed, not cancelled
STOPPED = b"stopped "


def notify_stopped(cancel_dir, key: int) -> bool:
    pid, request_id = split_request_key(key)
    return _send(cancel_dir, pid, STOPPED + str(request_id).encode())


#: the datagram that tells a speculative instance the server is stopping: answer every request in
#: flight with an error now (``serving.launch.ServerHandle.stop`` sends it when draining ran out)
SHUTDOWN = b"shutdown"


def notify_shutdown(cancel_dir, pid: int) -> bool:
    return _send(cancel_dir, pid, SHUTDOWN)


#: the datagram that tells a speculative instance the server is about to stop: refuse new requests
#: with the stop's error, serve those already held (``serving.launch.ServerHandle.stop`` sends it
#: before it signals Triton)
DRAIN = b"drain"


def notify_drain(cancel_dir, pid: int) -> bool:
    return _send(cancel_dir, pid, DRAIN)


def cancel_listener(cancel_dir, on_cancel, on_shutdown=None, on_stopped=None, on_drain=None) -> "callable":
    """Binds this process's cancel socket and calls ``on_cancel(request_id)`` for each datagram from
    a daemon thread (``on_shutdown()`` for SHUTDOWN, ``on_drain()`` for DRAIN, ``on_stopped(request_id)``
    for STOPPED). Returns a function that closes it."""
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
                if data == SHUTDOWN and on_shutdown is not None:
                    on_shutdown()
                    continue
                if data == DRAIN:
                    if on_drain is not None:
                        on_drain()
                    continue
                if data.startswith(STOPPED):
                    if on_stopped is not None:
                        on_stopped(int(data[len(STOPPED):].decode()))
                    continue
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
