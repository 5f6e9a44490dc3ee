"""What a decode group's launched step leaves for the host to read
(`Pending`: per row, the state after the step, or after the last of the
several steps one launch ran), where each row's tokens go (`Route`: its walk
and its loop's name for them), and a row leaving the group (`Leave`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mstar.engine.worker.kv_rows import KVRow
from mstar.engine.worker.rows import PartitionRun
from mstar.graph import WalkPlan


@dataclass(frozen=True)
class Leave:
    """A row whose stop rule held at this step (or that was taken out)."""

    part: PartitionRun
    token: torch.Tensor   # its last token, scalar on the device
    reason: str | None
    host_token: int | None = None  # the same token, where the host has read it already
    row: int = -1                  # its row in the step it left at (`Pending`), where it left at one
    carried: dict[str, torch.Tensor] = field(default_factory=dict)  # by walk value: what its next step reads back


@dataclass(frozen=True)
class Route:
    """Where a group row's tokens go: its walk (what it emits and streams)
    and the name its loop gives them there."""

    walk: WalkPlan
    value: str

    def __hash__(self) -> int:
        return hash((id(self.walk), self.value))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Route) and other.walk is self.walk and other.value == self.value


def route_of(part: PartitionRun) -> Route:
    loop = part.loop()
    assert loop is not None, "a group row is inside its loop"
    return Route(part.request.walk, loop.value)


@dataclass(eq=False)
class Pending:
    """A launched step whose tokens the host has not read yet; per row, the
    state after the step (what a row that leaves with it keeps). A launch of
    `steps` > 1 ran that many steps back to back: its tokens are [steps, n],
    and its tables hold the state after the last (a row that stopped at an
    earlier one keeps that one's: `ends` says which)."""

    seq: int
    rows: list[PartitionRun]
    request_ids: list[str]
    partitions: list[str]
    tokens: torch.Tensor        # [n] on the device ([steps, n] for several)
    host: torch.Tensor          # the same shape: host copy, valid once `event` is done
    event: torch.cuda.Event | None
    stop_table: torch.Tensor    # [n, S]
    kv_lens: torch.Tensor       # [n]
    counts: torch.Tensor        # [n]
    counters: torch.Tensor      # [n]
    drawn: torch.Tensor         # [n] the mode's own draws under the group's draw key, after the step
    exhausted: torch.Tensor     # [n] bool: reached the write cap with this step
    logprobs: torch.Tensor | None = None  # [n, 1 + 2K] packed (`sampler.token_logprobs`), host copy as `host`
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # walk value -> [n, ...] on the device
    routes: list[Route] = field(default_factory=list)  # where its rows' tokens go: one route covering every row,
    #                                                    or one per row when rows of several walks stepped
    kv: list[KVRow] = field(default_factory=list)  # each row's KV row of the group's component
    steps: int = 1
    followed: bool = False  # some row follows its ids for the prefix cache (counted before the launch's drops)
    _ends: np.ndarray | None = None

    def ends(self) -> np.ndarray:
        """Per row, how many of the launch's tokens count: up to and with
        its first stop id, else all `steps` (a row that left earlier, or was
        taken out meanwhile, is the caller's to skip)."""
        if self._ends is None:
            host = self.host.reshape(self.steps, -1).numpy()
            stops = self.stop_table.numpy()
            hit = (host[:, :, None] == stops[None]).any(axis=2)  # [steps, n]: -1 pads no drawn id matches
            self._ends = np.where(hit.any(axis=0), hit.argmax(axis=0) + 1, self.steps)
        return self._ends

    def route_rows(self) -> list[tuple[Route, list[int]]]:
        """Each route with the rows it covers."""
        if len(self.routes) == 1:
            return [(self.routes[0], list(range(len(self.rows))))]
        by: dict[Route, list[int]] = {}
        for i, route in enumerate(self.routes):
            by.setdefault(route, []).append(i)
        return list(by.items())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
