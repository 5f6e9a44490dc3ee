"""scripts/prometheus_samples.py: exposition text in, samples keyed by
(name, sorted labels) and sums by name over label matches out."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from prometheus_samples import samples, total, totals  # noqa: E402

TEXT = """# HELP mstar_kv_pages_in_use Pages held.
# TYPE mstar_kv_pages_in_use gauge
mstar_kv_pages_in_use{device="cpu",component="llm"} 2
mstar_kv_pages_in_use{component="talker",device="cpu"} 1

mstar_requests_total{status="abort"} 4
mstar_requests_total{status="stop"} 6
mstar_tensors_held 0
"""


def test_series_are_keyed_by_name_and_sorted_labels() -> None:
    found = samples(TEXT)
    assert found[("mstar_kv_pages_in_use", (("component", "llm"), ("device", "cpu")))] == 2
    assert found[("mstar_kv_pages_in_use", (("component", "talker"), ("device", "cpu")))] == 1
    assert found[("mstar_tensors_held", ())] == 0
    assert len(found) == 5  # HELP, TYPE and the blank line are no samples


def test_sums_by_name_over_the_series_whose_labels_match() -> None:
    found = samples(TEXT)
    assert totals(found) == {"mstar_kv_pages_in_use": 3, "mstar_requests_total": 10, "mstar_tensors_held": 0}
    assert totals(found, status="abort") == {"mstar_requests_total": 4}
    assert total(found, "mstar_requests_total", status="stop") == 6
    assert total(found, "mstar_kv_pages_in_use", component="llm", device="cpu") == 2
    assert total(found, "mstar_kv_pages_in_use", device="gpu") == 0
    assert total(found, "mstar_absent") == 0
    # a label called `name` is a match, not the metric's name
    assert total(samples('x{name="a"} 1\nx{name="b"} 2\n'), "x", name="b") == 2


def test_a_trailing_timestamp_is_not_the_value() -> None:
    found = samples('a 3 1712345678000\nb{l="x"} 4 -5\n')
    assert found == {("a", ()): 3.0, ("b", (("l", "x"),)): 4.0}


def test_label_values_keep_quotes_commas_spaces_and_braces() -> None:
    line = r'a{path="x, y} z",quote="say \"hi\"",slash="c:\\d",nl="1\n2",odd="\t"} 7'
    assert samples(line) == {("a", (("nl", "1\n2"), ("odd", "\\t"), ("path", "x, y} z"), ("quote", 'say "hi"'),
                                    ("slash", "c:\\d"))): 7.0}
    assert samples('a{ l = "v" , } 1\na{} 2\n') == {("a", (("l", "v"),)): 1.0, ("a", ()): 2.0}


def test_nan_and_infinities_are_floats() -> None:
    found = samples('a NaN\nb{le="+Inf"} +Inf\nc -Inf\n')
    assert math.isnan(found[("a", ())])
    assert found[("b", (("le", "+Inf"),))] == math.inf and found[("c", ())] == -math.inf


def test_a_malformed_line_is_passed_over_not_raised() -> None:
    bad = ["a many", "a", "a 1 2 3", "a 1 later", 'a{l="open} 1', "a{l=v} 1", 'a{l="1",l="2"} 1', "{} 1",
           "9a 1", 'a{l="v"', "#a 1", "a 0x10"]
    assert samples("\n".join(bad + ["ok 1"])) == {("ok", ()): 1.0}


def test_a_repeated_series_adds_up_like_its_sum() -> None:
    found = samples("a 1\na 2\n")
    assert found == {("a", ()): 3.0} and totals(found) == {"a": 3.0}
