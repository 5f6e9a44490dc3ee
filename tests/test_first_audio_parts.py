"""profile_tts's split of a speech request's first audio
(`scripts/first_audio_parts.py`): codes counted per followed request from
the reports' sampled ids, decode steps between its first code and the one
that completes its window, and nothing looked at once its audio came."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from first_audio_parts import FirstAudioParts  # noqa: E402

from mstar.engine.messages import StepReport  # noqa: E402


def decode(sampled: list[str], steps: int = 1) -> StepReport:
    return StepReport(device="cpu", component="llm", mode="decode", rows=len(sampled), steps=steps, sampled=sampled)


def test_parts_count_codes_and_steps_of_followed_requests_only() -> None:
    parts = FirstAudioParts(window_codes=3)
    parts.submitted("a")
    parts.on_report(StepReport(device="cpu", component="llm", mode="prefill", rows=1, sampled=["a"]))
    parts.on_report(decode(["a", "b"]))        # "b" is not followed
    parts.on_report(decode(["a", "a"], steps=2))  # a launch of two steps: codes 3 and 4
    trip = parts.trips["a"]
    assert (trip.codes, trip.steps_at_first, trip.steps_at_window) == (4, 0, 3)
    assert "b" not in parts.trips
    assert parts.summary("a") is None  # no audio yet
    time.sleep(0.002)
    parts.heard("a")
    parts.on_report(decode(["a"]))  # after its audio: no longer counted
    assert trip.codes == 4 and trip.first_audio is not None
    line = parts.summary("a")
    assert line is not None and "over 1 requests" in line and "(3 decode steps" in line
    assert parts.summary("z") is None


def test_a_request_short_of_its_window_is_left_out_of_the_summary() -> None:
    parts = FirstAudioParts(window_codes=28)
    parts.submitted("p1")
    parts.on_report(decode(["p1"] * 5))
    parts.heard("p1")
    assert parts.summary("p") is None
