"""What a worker has for the event loop, in order: emits whose host copies
may still be in flight, and finished partitions queued behind them.

A plain step (the codec's window, say) does not wait for its device work:
its emitted rows are copied to page-locked host memory without blocking, and
the copy's event says when they can be read. Reports must keep each
request's order (every audio chunk before the request's end), so once one
emit waits, everything after it waits too; `release` moves the ready prefix
into the step report.
"""

from __future__ import annotations

from collections import deque

import torch

from mstar.engine.messages import EmitBatch, Finished, StepReport


class Outbox:
    def __init__(self) -> None:
        self._held: deque[tuple[torch.cuda.Event | None, EmitBatch | Finished]] = deque()

    def __len__(self) -> int:
        return len(self._held)

    def emit(self, report: StepReport, batch: EmitBatch, ready: torch.cuda.Event | None = None) -> None:
        """`batch` into `report`, or held behind what is still in flight.
        `ready`: recorded after the copy that fills `batch.data`."""
        if ready is None and not self._held:
            report.emits.append(batch)
        else:
            self._held.append((ready, batch))

    def finished(self, report: StepReport, fin: Finished) -> None:
        if self._held:
            self._held.append((None, fin))
        else:
            report.finished.append(fin)

    def release(self, report: StepReport, wait: bool = False) -> None:
        """Move what is ready (with `wait`: everything) into `report`, in order."""
        while self._held:
            ready, item = self._held[0]
            if ready is not None and not ready.query():
                if not wait:
                    return
                ready.synchronize()
            self._held.popleft()
            if isinstance(item, EmitBatch):
                report.emits.append(item)
            else:
                report.finished.append(item)


def to_host(rows: torch.Tensor | list[torch.Tensor]) -> tuple[torch.Tensor | list[torch.Tensor],
                                                              torch.cuda.Event | None]:
    """Rows copied to the host without blocking: (host rows, the copy's event);
    on the CPU the rows themselves and None."""
    if isinstance(rows, list):
        if not rows or rows[0].device.type != "cuda":
            return rows, None
        host = [torch.empty(r.shape, dtype=r.dtype, pin_memory=True).copy_(r, non_blocking=True) for r in rows]
    else:
        if rows.device.type != "cuda":
            return rows, None
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True).copy_(rows, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def select_rows(data: torch.Tensor, index: list[int]) -> torch.Tensor:
    """`data[index]` without a blocking copy: a Python list index becomes a
    pageable host tensor, and copying that to the device waits for the stream."""
    if len(index) == data.shape[0]:
        return data
    idx = torch.tensor(index, dtype=torch.long)
    if data.device.type == "cuda":
        idx = idx.pin_memory().to(data.device, non_blocking=True)
    return data.index_select(0, idx)
