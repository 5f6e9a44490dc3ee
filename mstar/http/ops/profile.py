"""`POST /debug/profile` (served with `--enable-profiling`): torch's profiler
over a few seconds of one worker's thread while the server serves, answered
as text: the worker's phases (its `mstar.*` ranges), then its ops by their
own CPU time and, on CUDA, by their kernels' time.

This is how to see where a worker's host time goes under real HTTP load
(the event loop and the clients beside it), which an in-process profile
misses. The profiler slows the worker while it runs, so the route is off
unless the server was started to allow it.
"""

from __future__ import annotations

import asyncio
import math

import torch
from aiohttp import web

from mstar.errors import ProfilerBusy, RequestError
from mstar.http.keys import ENGINE

MAX_SECONDS = 60.0
STACK_DEPTH = 8  # frames of each op's stack that tell its callers apart


def _number(body: dict, name: str, default: float) -> float | None:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


async def profile(request: web.Request) -> web.Response:
    """Body (JSON, every field optional): `seconds` (default 2, at most 60),
    `worker` (index into --gpus, default 0), `rows` (ops per table, default
    30), `stacks` (also the ops by their Python stack, default false)."""
    try:
        body = await request.json() if request.can_read_body else {}
    except ValueError:
        raise RequestError("the body is not JSON")
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    engine = request.app[ENGINE]
    seconds, worker, rows = _number(body, "seconds", 2.0), _number(body, "worker", 0), _number(body, "rows", 30)
    if seconds is None or not 0 < seconds <= MAX_SECONDS:
        raise RequestError(f"must be in (0, {MAX_SECONDS:g}]", field="seconds")
    if worker is None or worker != int(worker) or not 0 <= worker < len(engine.workers):
        raise RequestError(f"must be an index below {len(engine.workers)}", field="worker")
    if rows is None or rows != int(rows) or not 1 <= rows <= 500:
        raise RequestError("must be a whole number in [1, 500]", field="rows")
    stacks = body.get("stacks", False)
    if not isinstance(stacks, bool):
        raise RequestError("must be true or false", field="stacks")
    try:
        prof = await engine.profile(seconds, int(worker), stacks)
    except ProfilerBusy as e:  # one profile in the process at a time
        raise RequestError(str(e), status=409, code="profiler_busy") from None
    except RuntimeError as e:  # the worker is not running
        raise RequestError(str(e), status=503, code="unavailable") from None
    # the tables take a while to build (seconds, with stacks): off the event loop
    text = await asyncio.to_thread(_report, prof, seconds, int(worker), engine.workers[int(worker)].name,
                                   int(rows), stacks)
    return web.Response(text=text, content_type="text/plain")


def _report(prof: torch.profiler.profile, seconds: float, worker: int, device: str, rows: int, stacks: bool) -> str:
    events = prof.key_averages()
    cuda = device.startswith("cuda")
    lines = [f"# {seconds:g} s of worker {worker} ({device})",
             "worker phases (CPU ms total, calls" + ("; device ms of their kernels)" if cuda else ")")]
    for e in sorted((e for e in events if e.key.startswith("mstar.")), key=lambda e: -e.cpu_time_total):
        kernels = f" {e.device_time_total / 1e3:10.1f}" if cuda else ""
        lines.append(f"  {e.key:<28} {e.cpu_time_total / 1e3:10.1f} {e.count:>7}{kernels}")
    lines += ["", "ops by their own CPU time:", events.table(sort_by="self_cpu_time_total", row_limit=rows,
                                                              max_name_column_width=70)]
    if cuda:
        lines += ["ops by their kernels' time:", events.table(sort_by="self_cuda_time_total", row_limit=rows,
                                                               max_name_column_width=70)]
    if stacks:
        lines += ["ops by their own CPU time and Python stack:",
                  prof.key_averages(group_by_stack_n=STACK_DEPTH).table(
                      sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70)]
    return "\n".join(lines)
