"""One-time costs a benchmark level paid, counted between two points of a
process: page-locked host blocks the pinned allocator created (each a
`cudaHostAlloc`), device blocks the caching allocator took from CUDA (each a
`cudaMalloc`) and its retries, and Python's garbage collections per
generation with the time they held the GIL. A first burst after startup that
is slower than a later identical one pays for something once; these are the
usual suspects that no kernel trace shows.

    costs = LevelCosts.start()
    ...  # the level
    print(costs.stop().line())
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch


@dataclass
class _GcClock:
    """Collections and their time per generation, while installed."""
    counts: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    _t0: float = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            gen = info["generation"]
            self.counts[gen] += 1
            self.seconds[gen] += time.perf_counter() - self._t0


@dataclass
class LevelCosts:
    host: dict
    device: dict
    clock: _GcClock
    result: dict | None = None

    @classmethod
    def start(cls) -> LevelCosts:
        clock = _GcClock()
        gc.callbacks.append(clock)
        return cls(_host_stats(), _device_stats(), clock)

    def stop(self) -> LevelCosts:
        gc.callbacks.remove(self.clock)
        host, device = _host_stats(), _device_stats()
        self.result = {
            "pinned_blocks": host.get("num_host_alloc", 0) - self.host.get("num_host_alloc", 0),
            "pinned_alloc_ms": (host.get("host_alloc_time.total", 0) - self.host.get("host_alloc_time.total", 0))
            / 1e3,
            "device_blocks": device.get("num_device_alloc", 0) - self.device.get("num_device_alloc", 0),
            "device_frees": device.get("num_device_free", 0) - self.device.get("num_device_free", 0),
            "alloc_retries": device.get("num_alloc_retries", 0) - self.device.get("num_alloc_retries", 0),
            "gc_collections": list(self.clock.counts),
            "gc_ms": [round(1e3 * s, 1) for s in self.clock.seconds],
        }
        return self

    def line(self) -> str:
        r = self.result
        assert r is not None, "stop() first"
        return (f"paid once? pinned blocks created {r['pinned_blocks']} ({r['pinned_alloc_ms']:.1f} ms), device blocks "
                f"cudaMalloc'd {r['device_blocks']} (freed {r['device_frees']}, retries {r['alloc_retries']}), gc "
                f"collections per generation {r['gc_collections']} ({r['gc_ms']} ms)")


def _host_stats() -> dict:
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return {}
    return torch.cuda.host_memory_stats()


def _device_stats() -> dict:
    return torch.cuda.memory_stats() if torch.cuda.is_available() else {}
