"""Error types shared by every layer.

Bad input is a per-request value (`RequestError` carries the HTTP status and the
field at fault); exceptions are for faults. `WalkError` is raised when a model's
walks fail validation at load time.
"""

from __future__ import annotations

from dataclasses import dataclass

CONTEXT_EXCEEDED = "context_length_exceeded"  # the code of input that does not fit the model's context (OpenAI's)


class MstarError(Exception):
    """Base class of every mstar exception."""


@dataclass
class RequestError(MstarError):
    """A request that cannot be served as asked: maps to a 4xx answer."""

    message: str
    field: str | None = None
    status: int = 400
    code: str = "invalid_request_error"
    retry_after: float | None = None  # seconds, for answers that ask the client to come back (429, 503)

    def __str__(self) -> str:
        return self.message if self.field is None else f"{self.field}: {self.message}"


# a request the server would not run because it is stopping: refused before it began (503, Retry-After), so that
# a client or a cluster front sends it elsewhere
SHUTTING_DOWN = "the server is shutting down"


class ModelNotFound(RequestError):
    def __init__(self, name: str) -> None:
        super().__init__(f"model '{name}' is not served here", field="model", status=404, code="model_not_found")


class WalkError(MstarError):
    """A walk that cannot run: names the walk and the step at fault."""

    def __init__(self, walk: str, step: str, reason: str) -> None:
        super().__init__(f"walk '{walk}', step '{step}': {reason}")
        self.walk = walk
        self.step = step
        self.reason = reason


class ConfigError(MstarError):
    """Inconsistent engine or model configuration."""


class ProfilerBusy(MstarError, RuntimeError):
    """A profile was asked for while another runs in the process (torch's
    profiler is one per process)."""
