"""scripts/bench_intake.py without a server: a span counts only its own task's
steps up to its submit, the notes split into bursts and summed per request,
and the raw client reads answers of either framing."""

from __future__ import annotations

import asyncio
import sys
from argparse import Namespace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))

from bench_intake import Connection, Probe, bursts, summary  # noqa: E402


def test_a_span_counts_its_own_steps_until_its_submit() -> None:
    probe = Probe(None)

    async def handler(hold: asyncio.Event) -> str:
        await hold.wait()  # its body still arriving: the loop runs others meanwhile, not counted
        sum(range(20_000))
        probe.end()  # the submit
        await asyncio.sleep(0)  # the tail: the rest of that step only
        return "done"

    async def main() -> Any:
        hold = asyncio.Event()

        async def timed() -> str:
            return await probe.begin(handler(hold))

        task = asyncio.create_task(timed())
        await asyncio.sleep(0)
        sum(range(200_000))  # the loop's other work, between the span's steps
        hold.set()
        return await task

    assert asyncio.run(main()) == "done"
    [note] = probe.notes
    assert note["kind"] == "submit" and note["steps"] == 2 and "tail" in note
    assert 0 < note["span"] <= note["span_wall"] < 0.05  # well under the loop's own 200k-sum between steps


def _burst(t0: float, n: int, span: float = 100e-6) -> list[dict[str, Any]]:
    notes: list[dict[str, Any]] = [{"kind": "recv", "wall": t0, "cpu": t0, "worker_cpu": t0 / 2}]
    for i in range(n):
        at = t0 + (i + 1) * 1e-3
        notes.append({"kind": "submit", "wall": at, "cpu": at, "worker_cpu": at / 2, "span": span, "span_wall": span,
                      "before": span / 4, "tail": span / 10, "steps": 1})
    return notes


def test_notes_split_into_bursts_of_the_asked_size() -> None:
    notes = _burst(0.0, 4) + _burst(1.0, 3) + _burst(2.0, 4, span=200e-6)
    assert [len(b) for b in bursts(notes, 4)] == [5, 5]
    s = summary(notes, Namespace(requests=4, warmup=1))
    assert s["bursts"] == 1 and s["requests"] == 4
    assert round(s["span_us_median"]) == 200 and round(s["before_route_us_median"]) == 50
    assert round(s["loop_us_per_request_median"]) == 1000 and round(s["gap_us_median"]) == 1000
    assert round(s["worker_us_per_request_median"]) == 500


def test_the_client_reads_chunked_and_sized_answers() -> None:
    async def read(data: bytes) -> str | None:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await Connection(reader, None).answer()  # type: ignore[arg-type]

    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Sample-Rate: 24000\r\n\r\n"
               b"4\r\n\x00\x000\r\r\n3;ext=1\r\nabc\r\n0\r\n\r\n")
    assert asyncio.run(read(chunked)) is None
    refused = b'HTTP/1.1 429 Too Many Requests\r\nContent-Length: 9\r\n\r\n{"e": 1}\n'
    assert asyncio.run(read(refused)) == "HTTP 429: b'{\"e\": 1}\\n'"
