"""Failed answers in, one typed exception out.

An HTTP error status with the server's OpenAI-style body
(`{"error": {"message", "type", "param", "code"}}`), an error event inside a
stream that had already started, and a connection that failed or was cut all
become a `MstarError`, so a caller has one type to catch.
"""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Mapping
from typing import Any

# Statuses that mean "come back later": worth retrying when the caller allows it.
RETRYABLE = frozenset({429, 503})


class MstarError(Exception):
    """A request the server refused or could not finish.

    `status` is the HTTP status, or None when there was no status to give:
    the error came as an event of a stream that had already started with 200
    (then `code` says why, e.g. "timeout"), or the connection failed
    (`code` "connection_error"). `param` names the request field at fault.
    `retry_after` is in seconds, when the server said when to come back.
    A realtime session's refusal names the client event it refused
    (`event_id`, and `event_type` when this client sent it).
    """

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 param: str | None = None, type: str | None = None, retry_after: float | None = None,
                 event_id: str | None = None, event_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.param = param
        self.type = type
        self.retry_after = retry_after
        self.event_id = event_id
        self.event_type = event_type

    @property
    def retryable(self) -> bool:
        """Worth sending again later: a 429 or 503, or an error event of the
        type a 429 has (a realtime response refused while too many wait)."""
        return self.status in RETRYABLE or (self.status is None and self.type == "requests")

    def __str__(self) -> str:
        head = " ".join(str(p) for p in (self.status, self.code) if p is not None)
        return f"{head}: {self.message}" if head else self.message

    def __repr__(self) -> str:
        return (f"MstarError(status={self.status!r}, code={self.code!r}, param={self.param!r}, "
                f"message={self.message!r}, retry_after={self.retry_after!r})")


def error_from_body(status: int | None, body: bytes, headers: Mapping[str, str] | None = None,
                    reason: str | None = None) -> MstarError:
    """The error an HTTP answer describes; a body that is not the OpenAI shape
    (a proxy's HTML page, an empty 499) still gives its status and text."""
    retry_after = parse_retry_after(headers.get("Retry-After")) if headers else None
    try:
        obj = json.loads(body) if body else None
    except ValueError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        return error_from_event(obj, status=status, retry_after=retry_after)
    text = body.decode("utf-8", "replace").strip()
    return MstarError(text or reason or f"HTTP {status}", status=status, retry_after=retry_after)


def error_from_event(event: Mapping[str, Any], *, status: int | None = None,
                     retry_after: float | None = None) -> MstarError:
    """The error of an `{"error": {...}}` object, whether a whole answer or one
    event of a stream."""
    error = event.get("error")
    fields: Mapping[str, Any] = error if isinstance(error, Mapping) else {"message": str(error)}
    return MstarError(str(fields.get("message") or "unknown error"), status=status,
                      code=_text(fields.get("code")), param=_text(fields.get("param")),
                      type=_text(fields.get("type")), retry_after=retry_after)


def connection_error(exc: BaseException) -> MstarError:
    """A request that got no complete answer: refused, timed out, or cut."""
    message = str(exc) or type(exc).__name__
    code = "timeout" if isinstance(exc, TimeoutError) else "connection_error"
    error = MstarError(message, code=code)
    error.__cause__ = exc
    return error


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header: delta-seconds or an HTTP date."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _text(value: Any) -> str | None:
    return None if value is None else str(value)
