"""OpenAI's error JSON with the right status, and what Triton's error messages map to."""
from __future__ import annotations

from serving.protocol import FAULT

#: gRPC statuses of a call that failed through no fault of the request (the stream's own model errors
#: arrive as text, without a status)
SERVER_STATUSES = {"INTERNAL": 500, "UNKNOWN": 500, "DATA_LOSS": 500, "UNIMPLEMENTED": 500,
                   "DEADLINE_EXCEEDED": 504, "RESOURCE_EXHAUSTED": 503, "CANCELLED": 503, "ABORTED": 503}


def _kind(status: int) -> str:
    """The error ``type`` for a status: a 4xx without its own type is the client's request
    (invalid_request_error), never "server_error", which would blame the server for it."""
    known = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
             503: "service_unavailable"}
    return known.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or _kind(status)

    def body(self) -> dict:
        """Text that quotes the request is escaped where it is no Unicode (a lone surrogate), so the
        error itself can always be encoded as UTF-8 JSON."""
        def text(s):
            return s if s is None else str(s).encode("utf-8", "backslashreplace").decode("utf-8")
        return {"error": {"message": text(self.message), "type": self.kind, "param": text(self.param),
                          "code": self.status}}


def shown(value, limit: int = 80) -> str:
    """``value`` as an error message quotes it, cut short: a 400-digit number or a long list sent
    back in full would bury the message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def internal_error(e: Exception) -> APIError:
    """An unexpected exception as OpenAI's error JSON (a 500, the exception named)."""
    return APIError(500, f"internal error: {type(e).__name__}: {e}")


def ended_error() -> APIError:
    """A generation whose stream closed without a finish reason: the server ended it (an error while
    answering it), so its text is partial; never a 200 with finish_reason "stop"."""
    return APIError(500, "the server ended the generation without finishing it (see the server's log)")


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


def grpc_text(error: Exception) -> str:
    """A gRPC call's failure as its status and details (``str`` of an AioRpcError is a multi-line dump
    with a debug string)."""
    try:
        return f"{error.code().name}: {error.details()}"
    except Exception:   # not a gRPC error
        return str(error)


def from_triton(message: str) -> APIError:
    """A failed ensemble request: a full queue is 429, a server that cannot serve 503, a model's
    internal error (``serving.protocol.fault``) or a failed call 500 (SDKs retry a 5xx, never a 400),
    a refused field 400 (the message names it)."""
    text = str(message)
    if "server busy" in text:
        return APIError(429, text)
    if any(s in text for s in ("Stub process", "is not healthy")):   # a model process died or hangs
        return APIError(503, f"the server cannot serve now: a model process stopped, and the supervisor restarts "
                             f"it; retry shortly (Triton: {text.strip()})")
    if any(s in text for s in ("Stream removed", "Socket closed", "Connection reset")):   # tritonserver died
        return APIError(503, f"the server cannot serve now: the connection to Triton closed mid-request, and the "
                             f"supervisor restarts a server whose process died; retry shortly (Triton: {text.strip()})")
    if any(s in text for s in ("not ready", "unavailable", "UNAVAILABLE", "shutting down", "failed to connect")):
        return APIError(503, text)
    status = SERVER_STATUSES.get(text.split(":", 1)[0].strip())
    if status:
        return APIError(status, text)
    if FAULT in text or "Exception" in text or "shared memory" in text:   # the last: Triton's own pool
        return APIError(500, text)
    return APIError(400, text)
