"""The Prometheus text exposition format (0.0.4), written by hand: label
escaping, number formatting, histograms with cumulative `le` buckets, and one
metric family rendered as its `# HELP` / `# TYPE` lines and samples.

Nothing here knows about the engine; `mstar.engine.eventloop.metrics` fills it.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence

Labels = tuple[tuple[str, str], ...]

# Latency from 5 ms to 30 s: a token step is milliseconds, a first token under
# load or a long prefill can be seconds.
LATENCY_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Rows per step: powers of two up to the largest max_num_seqs one would set.
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def format_value(v: float) -> str:
    """A sample value as Prometheus reads it (integers without `.0`)."""
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer() and abs(v) < 2**53:
        return str(int(v))
    return repr(float(v))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"


class Histogram:
    """One histogram family: per label set, counts per bucket (not yet
    cumulative: an observation touches one slot), the sum and the count."""

    def __init__(self, buckets: Sequence[float], labelled: bool = False) -> None:
        self.buckets = tuple(sorted(buckets))
        self.series: dict[Labels, list[float]] = {}  # [bucket counts..., +Inf count, sum]
        if not labelled:  # an unlabelled histogram shows zeros before its first observation
            self.add_series(())

    def add_series(self, labels: Labels) -> list[float]:
        """The series of `labels`, made (as zeros) if it is not there yet."""
        s = self.series.get(labels)
        if s is None:
            s = self.series[labels] = [0.0] * (len(self.buckets) + 2)
        return s

    def observe(self, value: float, labels: Labels = ()) -> None:
        s = self.series.get(labels) or self.add_series(labels)
        # `le` is inclusive: a value equal to a bound belongs to that bucket
        s[bisect_left(self.buckets, value)] += 1
        s[-1] += value

    def count(self, labels: Labels = ()) -> int:
        s = self.series.get(labels)
        return int(sum(s[:-1])) if s is not None else 0

    def samples(self, name: str) -> Iterable[str]:
        for labels, s in sorted(self.series.items()):
            acc = 0.0
            for bound, n in zip((*self.buckets, math.inf), s[:-1]):
                acc += n
                yield f"{name}_bucket{format_labels((*labels, ('le', format_value(bound))))} {format_value(acc)}"
            yield f"{name}_sum{format_labels(labels)} {format_value(s[-1])}"
            yield f"{name}_count{format_labels(labels)} {format_value(acc)}"


def family(name: str, kind: str, help_text: str,
           samples: Histogram | Iterable[tuple[Labels, float]]) -> str:
    """One metric family: HELP, TYPE, then its samples, newline-terminated.
    `samples` is a `Histogram`, or (labels, value) pairs for a counter/gauge."""
    lines = [f"# HELP {name} {help_text.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + 'n')}",
             f"# TYPE {name} {kind}"]
    if isinstance(samples, Histogram):
        lines.extend(samples.samples(name))
    else:
        lines.extend(f"{name}{format_labels(labels)} {format_value(v)}" for labels, v in samples)
    return "\n".join(lines) + "\n"
