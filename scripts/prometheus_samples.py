"""A server's /metrics text (Prometheus exposition format, a cluster front's
too) in; its samples out, keyed by (name, sorted labels), and sums of them by
name over the series whose labels include some given ones.

The benchmarks and the load test read the server through this one parser. A
sample line is `name{label="value",...} value [timestamp]`:

- the value is the field after the name and labels; a trailing timestamp is
  passed over (an earlier reader took it for the value);
- a label value may hold spaces, commas, `}` and the escapes `\\\\`, `\\"`,
  `\\n`, which come back unescaped;
- `NaN`, `+Inf` and `-Inf` are floats like any other value;
- HELP, TYPE and other comment lines and blank lines are no samples, and a
  line that is no well-formed sample (a value that is not a number, say) is
  passed over rather than raised: a reader of counters wants the rest of the
  text, and one whose series is then missing sees it missing (the load
  test's reader raised here, and the first-audio reader took the whole text
  for one without the histogram);
- a series that the text repeats (a malformed text: each stands once) adds
  up, so that a sum by name reads the same as the sum of the keyed samples.

Sums by name add the series of every label set: a server labels by device,
component or status, and a cluster front labels each replica's series with
`replica`, so a sum over labels reads the whole front.
"""

from __future__ import annotations

import re

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]

_PAIR = r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\\n]|\\.)*)"\s*'
_LINE = re.compile(r'\s*(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)'
                   rf'(?:\s*\{{(?P<labels>(?:{_PAIR},)*(?:{_PAIR})?)\s*\}}\s*|\s+)'
                   r'(?P<value>\S+)(?:\s+-?\d+)?\s*')
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def _unescaped(value: str) -> str:
    # an escape the format does not name keeps its backslash
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m[1], m[0]), value)


def _sample(line: str) -> tuple[str, Labels, float] | None:
    """One line's name, sorted labels and value; None: the line is no sample."""
    m = _LINE.fullmatch(line)
    if m is None:
        return None
    try:
        value = float(m["value"])
    except ValueError:
        return None
    pairs = [(k, _unescaped(v)) for k, v in re.findall(_PAIR, m["labels"] or "")]
    if len({k for k, _ in pairs}) != len(pairs):
        return None  # a label twice: no series of the format
    return m["name"], tuple(sorted(pairs)), value


def samples(text: str) -> Samples:
    """Every sample of an exposition text: {(name, sorted labels): value}."""
    found: Samples = {}
    for line in text.splitlines():
        got = _sample(line)
        if got is not None:
            name, labels, value = got
            found[(name, labels)] = found.get((name, labels), 0.0) + value
    return found


def totals(found: Samples, /, **match: str) -> dict[str, float]:
    """{name: the sum of its series whose labels include `match`}; a name
    with no such series is absent."""
    out: dict[str, float] = {}
    for (name, labels), value in found.items():
        if match.items() <= dict(labels).items():
            out[name] = out.get(name, 0.0) + value
    return out


def total(found: Samples, name: str, /, **match: str) -> float:
    """The sum of `name` over its series whose labels include `match`; 0
    where there are none."""
    return totals(found, **match).get(name, 0.0)
