"""Capturing a step as CUDA graphs at batch buckets, shared by the decode
graphs and the graphs of plain modes: a bucket size in, its graph and the
output tensors the graph writes out.

Workers of one process capture one at a time (a process-wide lock), and each
capture is `thread_local`: under the default global mode, a CUDA call that
another worker thread makes meanwhile (an allocation, an event query, a
copy on its own device) invalidates the capture.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from tqdm import tqdm

T = TypeVar("T")
K = TypeVar("K", int, tuple[int, int])

_CAPTURING = threading.Lock()


@torch.inference_mode()
def capture_buckets(device: torch.device, buckets: Iterable[K], prepare: Callable[[K], Any],
                    step: Callable[[K, Any], T], desc: str, show_progress: bool = True,
                    pool: tuple | None = None,
                    stream: torch.cuda.Stream | None = None) -> dict[K, tuple[torch.cuda.CUDAGraph, T]]:
    """For each bucket b (a batch size, or a tuple of sizes), largest first,
    sharing one memory pool (`pool`: an earlier capture's; give its `stream`
    too, or the pool's freed blocks, kept per stream, are not reused): `prepare(b)`
    (planning, on the capture stream), two warm-up calls of `step(b, prepared)`
    (lazy inits and kernel compiles stay out of the graph), then the captured
    call. Returns b -> (graph, what the captured call returned)."""
    out: dict[K, tuple[torch.cuda.CUDAGraph, T]] = {}
    with _CAPTURING:
        stream = stream or torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        for b in tqdm(sorted(buckets, reverse=True), desc=desc, disable=not show_progress):
            with torch.cuda.stream(stream):  # planning's copies are ordered before the warm-up on this stream
                prepared = prepare(b)
                for _ in range(2):
                    step(b, prepared)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                outputs = step(b, prepared)
            pool = graph.pool()
            out[b] = (graph, outputs)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
    return out
