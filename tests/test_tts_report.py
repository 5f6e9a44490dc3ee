"""bench_tts's arithmetic (`scripts/tts_report.py`): the server's own
first-audio time of a level, read from its /metrics."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from tts_report import Level, Stream, first_audio_totals, level_extras  # noqa: E402

METRICS = """# HELP mstar_time_to_first_audio_seconds Seconds from submit to the first chunk with audio.
# TYPE mstar_time_to_first_audio_seconds histogram
mstar_time_to_first_audio_seconds_bucket{le="0.1"} 1
mstar_time_to_first_audio_seconds_bucket{le="+Inf"} 65
mstar_time_to_first_audio_seconds_sum 14.595752148999395
mstar_time_to_first_audio_seconds_count 65
mstar_time_to_first_token_seconds_sum 3.5
mstar_time_to_first_token_seconds_count 7
"""


def _level(spent: tuple[float, float] | None) -> Level:
    s = Stream(sent=0.0, first_byte=0.2)
    s.add(0.2, 4096)
    s.add(0.3, 4096)
    return Level(2, [s, s], 1.0, spent)


def test_the_first_audio_histogram_is_read_from_metrics_text() -> None:
    assert first_audio_totals(METRICS) == (14.595752148999395, 65.0)
    assert first_audio_totals("mstar_time_to_first_token_seconds_sum 1\n") is None
    assert first_audio_totals("") is None
    # a cluster front labels each replica's series: they add up
    front = ('mstar_time_to_first_audio_seconds_sum{replica="0"} 1.5\n'
             'mstar_time_to_first_audio_seconds_count{replica="0"} 3\n'
             'mstar_time_to_first_audio_seconds_sum{replica="1"} 0.5\n'
             'mstar_time_to_first_audio_seconds_count{replica="1"} 1\n')
    assert first_audio_totals(front) == (2.0, 4.0)
    # a label value may hold a space, a comma or a brace (an earlier reader split the series there)
    assert first_audio_totals(front.replace('replica="1"', 'replica="1",model="a b, {c}"')) == (2.0, 4.0)
    # a sample with a timestamp reads its value; one that is not a number reads as none
    assert first_audio_totals(METRICS.replace("_count 65", "_count 65 1712345678000")) == (14.595752148999395, 65.0)
    assert first_audio_totals(METRICS.replace("_count 65", "_count many")) is None


def test_a_levels_server_first_audio_is_the_mean_of_what_it_timed_in_the_level() -> None:
    before, after = first_audio_totals(METRICS), (14.595752148999395 + 0.5, 67.0)
    assert before is not None
    spent = (after[0] - before[0], after[1] - before[1])
    assert level_extras(_level(spent))["server_ttfa_mean_ms"] == 250.0
    # not read, or nothing timed: no number
    assert math.isnan(level_extras(_level(None))["server_ttfa_mean_ms"])
    assert math.isnan(level_extras(_level((0.0, 0.0)))["server_ttfa_mean_ms"])
