"""Deterministic fake components for engine tests: a counter loop, a chunk
summer fed by a stream, and a gate that lets a test decide when a step may
finish (to make "the stop arrives one step late" happen every time)."""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch import nn

from mstar.graph import (Component, Emit, FanOut, FixedChunks, HostStop, Loop, MaxSteps, SlidingWindow, Step, Stream,
                         Walk)
from mstar.models.base import Model
from mstar.models.prepared import PreparedPiece
from mstar.types import GenerateRequest, SamplingParams


class Counter(nn.Module):
    """tick: x -> x + 1, one row per request; calls `gate(step_index)` first."""

    def __init__(self, gate: Callable[[int], None] | None) -> None:
        super().__init__()
        self.gate = gate
        self.calls = 0
        self.fail_on: int | None = None  # a value of x that makes the step raise

    def tick(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            self.gate(self.calls)
        self.calls += 1
        if self.fail_on is not None and bool((x == self.fail_on).any()):
            raise RuntimeError("injected fault")
        return x + 1


class Summer(nn.Module):
    """window: a chunk of stream items [B, L] -> [B, 2] (sum, length)."""

    def window(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x.sum(-1), torch.full_like(x[:, 0], x.shape[-1])], dim=-1)


class Tone(nn.Module):
    """synth: a chunk of stream items [B, L] -> a waveform [B, 4L] in [-1, 1]."""

    def synth(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() / 10.0).repeat_interleave(4, dim=-1).clamp(-1.0, 1.0)


class Doubler(nn.Module):
    def double(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class FakeModel(Model):
    """Walks over fake components; `limit` in the request inputs is the host
    stop: the event loop stops the loop once x reaches it."""

    components = {
        "counter": Component(modes=("tick",)),
        "summer": Component(modes=("window",)),
        "doubler": Component(modes=("double",)),
        "tone": Component(modes=("synth",)),
    }

    def __init__(self, gate: Callable[[int], None] | None = None, max_steps: int = 1000) -> None:
        super().__init__("fake")
        self.gate = gate
        self.counter = Counter(gate)
        stop = HostStop(predicate=lambda v: v >= self.limit) | MaxSteps(max_steps)
        self.limit = 10**9
        self.walks = {
            "count": Walk(Loop(Step("counter", "tick", "x", "x"), until=stop), Emit("x"), inputs=("x",)),
            "stream": Walk(
                Loop(Step("counter", "tick", "x", "x"), until=MaxSteps(max_steps)),
                Stream("x", Step("summer", "window", "x", "sum"), SlidingWindow(size=4, stride=2)),
                Emit("sum", modality="data"),
                inputs=("x",)),
            "chunks": Walk(
                Loop(Step("counter", "tick", "x", "x"), until=MaxSteps(max_steps)),
                Stream("x", Step("summer", "window", "x", "sum"), FixedChunks(3)),
                Emit("sum", modality="data"),
                inputs=("x",)),
            "audio": Walk(
                Loop(Step("counter", "tick", "x", "x"), until=MaxSteps(max_steps)),
                Stream("x", Step("tone", "synth", "x", "pcm"), FixedChunks(2)),
                Emit("pcm", modality="audio", sample_rate=24_000),
                inputs=("x",)),
            "filtered": Walk(
                Loop(Step("counter", "tick", "x", "x"), until=MaxSteps(max_steps)),
                Stream("x", Step("summer", "window", "x", "sum"), FixedChunks(2), accept=(3, 7)),
                Emit("sum", modality="data"),
                inputs=("x",)),
            "fanout": Walk(
                Step("doubler", "double", "x", "y"),
                FanOut(((Loop(Step("counter", "tick", "y", "y"), until=MaxSteps(3)),),
                        (Step("doubler", "double", "y", "z"),)), names=("a", "b")),
                Emit("y", modality="data"), Emit("z", modality="data"),
                inputs=("x",)),
        }
        self.default_walk = "count"

    @property
    def max_model_len(self) -> int:
        return 4096

    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return {"counter": self.counter, "summer": Summer(), "doubler": Doubler(), "tone": Tone()}[component]

    def prepare_inputs(self, request: GenerateRequest, sampling: SamplingParams) -> PreparedPiece:
        return PreparedPiece({"x": torch.tensor(int(request.inputs.get("x", 0)))}, 1)


class StepGate:
    """Makes every stop decided on the event loop arrive one step late: the
    event loop handles the report of tick n only once tick n + 1 has started,
    and tick n + 1 finishes only once that report has been handled."""

    def __init__(self, last: int) -> None:
        """`last`: the last tick that runs (the one whose output a late stop drops)."""
        self.started = [threading.Event() for _ in range(last + 2)]
        self.processed = [threading.Event() for _ in range(last + 2)]
        self.reports = 0
        self.last = last
        self.failure: str | None = None  # an event-loop hook's assert would only be logged: the test reads this

    def __call__(self, n: int) -> None:  # on the worker, at the start of tick n
        self.started[n].set()
        if n > 0:
            assert self.processed[n - 1].wait(timeout=30), "event loop never handled a report"

    def before_report(self, report: object) -> None:  # on the event loop
        if getattr(report, "emits", None) and self.reports < self.last:  # the last tick has no successor
            if not self.started[self.reports + 1].wait(timeout=30):
                self.failure = f"the worker never started tick {self.reports + 1}"

    def after_report(self, report: object) -> None:
        if getattr(report, "emits", None):
            self.processed[self.reports].set()
            self.reports += 1


class Hold:
    """A fake component's gate that holds every step until released."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def __call__(self, n: int) -> None:
        assert self.released.wait(timeout=30)
