"""Stop rules: when a loop ends. A loop's rule is checked each time its
value is written (the write that enters the loop included); the worker
applies the device-side ones vectorised over rows, the event loop the host
ones (`HostStop`), which may arrive a step late."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


class StopRule:
    """When a loop stops. Checked each time the loop's value is written,
    including the write that enters the loop."""

    def __or__(self, other: StopRule) -> AnyOf:
        return AnyOf(self.rules() + other.rules())

    def rules(self) -> tuple[StopRule, ...]:
        return (self,)


@dataclass(frozen=True)
class EosToken(StopRule):
    """The model's EOS ids plus the request's `stop_token_ids`, unless the
    request sets `ignore_eos` (request stop ids still apply then)."""


@dataclass(frozen=True)
class TokenIn(StopRule):
    """Fixed token ids that end the loop (ignored under `ignore_eos`)."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class MaxTokens(StopRule):
    """The request's `max_tokens`: counts the writes of the loop value."""


@dataclass(frozen=True)
class MaxSteps(StopRule):
    """A cap on the writes of the loop value: `n`, or the integer a walk value
    holds when the loop starts (`value`, such as a request's number of
    denoising steps)."""

    n: int | None = None
    value: str | None = None

    def __post_init__(self) -> None:
        if (self.n is None) == (self.value is None):
            raise ValueError("MaxSteps takes a count n or a value holding one, not both")


@dataclass(frozen=True)
class StreamDone(StopRule):
    """The loop's partition reads a stream that has closed, and every chunk of
    it was read: the loop ends when its next read finds nothing."""


@dataclass(frozen=True)
class HostStop(StopRule):
    """The event loop decides (stop strings, or `predicate` over each emitted
    host value). It arrives late: the worker may have launched more steps."""

    predicate: Callable[[object], bool] | None = None


@dataclass(frozen=True)
class AnyOf(StopRule):
    parts: tuple[StopRule, ...]

    def rules(self) -> tuple[StopRule, ...]:
        return self.parts

    def find(self, kind: type) -> StopRule | None:
        return next((r for r in self.parts if isinstance(r, kind)), None)
