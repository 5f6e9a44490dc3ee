"""The front's own counters, in Prometheus text for its `/metrics` beside the
replicas' samples: answers each replica began, by status; answers the front
gave itself (no replica available 503, a replica that dropped the request
502, one that went silent 504, a request head or held body that did not
arrive 408); requests sent on to another replica after one could not be
reached, refused it (429, 503), or left a safe one unanswered. Owned by the
front's event loop."""

from __future__ import annotations

from collections import Counter


class FrontCounters:
    def __init__(self) -> None:
        self.answers: Counter[tuple[int, int]] = Counter()   # (replica, status)
        self.own: Counter[int] = Counter()                    # status
        self.retries = 0

    def text(self) -> str:
        lines = ["# HELP mstar_front_answers_total answers a replica began through the front, by status",
                 "# TYPE mstar_front_answers_total counter"]
        lines += [f'mstar_front_answers_total{{replica="{r}",code="{s}"}} {n}'
                  for (r, s), n in sorted(self.answers.items())]
        lines += ["# HELP mstar_front_own_answers_total answers the front gave itself: 503 no replica available, "
                  "502 a replica dropped the request, 504 a replica went silent, "
                  "408 a request head or held body did not arrive in time",
                  "# TYPE mstar_front_own_answers_total counter"]
        lines += [f'mstar_front_own_answers_total{{code="{s}"}} {n}' for s, n in sorted(self.own.items())]
        lines += ["# HELP mstar_front_retries_total requests sent on to another replica after one refused or gave "
                  "no answer",
                  "# TYPE mstar_front_retries_total counter", f"mstar_front_retries_total {self.retries}"]
        return "\n".join(lines) + "\n"
