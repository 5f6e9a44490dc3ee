"""`StopStrings` (the event loop's stop-string matcher): what it sends and
holds back, checked against a brute-force reference over random pushes; and
its work per push bounded by what the push could change, not by the stops'
length (long stops over a long answer stalled the event loop)."""

from __future__ import annotations

import random

import pytest

from mstar.engine.eventloop.requests import StopStrings


def _reference(stops: tuple[str, ...], keep: bool, pieces: list[str], unarmed: int = 0) -> tuple[str, str | None]:
    """The text sent in all and the stop that matched: once a piece is in, the earliest match of any stop that
    ends past the first `unarmed` pieces' text (min_tokens: text before that never matches on its own), the
    stops' order breaking ties; else the whole text."""
    text, armed_at = "", 0
    for k, piece in enumerate(pieces):
        text += piece
        if k < unarmed:
            armed_at = len(text)
            continue
        found = [(text.find(s, max(0, armed_at - len(s) + 1)), s) for s in stops]
        found = [(at, s) for at, s in found if at >= 0]
        if found:
            at, stop = min(found, key=lambda hit: hit[0])
            return text[:at + (len(stop) if keep else 0)], stop
    return text, None


def _held(stops: tuple[str, ...], text: str) -> int:
    return max((n for s in stops for n in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:n])), default=0)


@pytest.mark.parametrize("seed", range(600))
def test_sent_and_held_text_match_a_brute_force_reference(seed: int) -> None:
    rnd = random.Random(seed)
    alphabet = "ab" if seed % 2 else "abc\u00e9"
    stops = tuple("".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 6))) for _ in range(rnd.randint(1, 3)))
    keep = rnd.random() < 0.3
    pieces = ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 4))) for _ in range(rnd.randint(1, 12))]
    unarmed = rnd.randint(0, 3) if seed % 3 == 0 else 0  # pieces pushed before min_tokens is reached
    matcher = StopStrings(stops, keep)
    sent, text = "", ""
    for k, piece in enumerate(pieces):
        out, hit = matcher.push(piece, armed=k >= unarmed)
        sent += out
        text += piece
        if hit:
            break
        assert sent == text[:len(text) - _held(stops, text)], (stops, pieces)
    else:
        sent += matcher.flush()
    expected, stop = _reference(stops, keep, pieces, unarmed)
    if stop is not None:
        assert (sent, matcher.matched) == (expected, stop), (stops, keep, pieces)
    else:
        assert sent == expected and matcher.matched is None


class _CountedStop(str):
    """A stop string that counts the prefixes taken of it: each is one candidate tail the search tries."""

    taken = 0
    budget = 16 * 4000  # one candidate a stop a push

    def __getitem__(self, key):  # type: ignore[override]
        _CountedStop.taken += 1
        if _CountedStop.taken > _CountedStop.budget:  # fail at once: an unbounded search would run for minutes
            raise AssertionError(f"over {_CountedStop.budget} candidate tails tried")
        return str.__getitem__(self, key)


def test_long_stops_over_a_long_answer_cost_little_per_push() -> None:
    # 16 stops of 4,000 characters the text never starts: the search for a held tail once ran from each stop's
    # full length down on every push (~4,000 candidates a stop a push); a push of one character can lengthen a
    # held tail by one at most, so each stop's search tries at most one length here
    stops = tuple(_CountedStop(chr(0x4E00 + i) * 4000) for i in range(16))
    matcher = StopStrings(stops)
    rnd = random.Random(0)
    _CountedStop.taken = 0
    for _ in range(4000):
        out, hit = matcher.push(rnd.choice("abcdef"))
        assert out and not hit
    assert _CountedStop.taken <= _CountedStop.budget, _CountedStop.taken


def test_a_tail_grows_by_the_push_and_still_matches() -> None:
    # the bounded search must still find a held tail that grows push by push, and the stop once it is whole
    stop = "abcdefgh"
    matcher = StopStrings((stop,))
    sent = ""
    for i, piece in enumerate(["xx", "ab", "c", "def", "g"]):
        out, hit = matcher.push(piece)
        sent += out
        assert not hit and sent == "xx", (i, sent)
    out, hit = matcher.push("hzz")
    assert hit and sent + out == "xx" and matcher.matched == stop


@pytest.mark.parametrize("keep", [False, True])
def test_a_longer_stop_ending_in_armed_text_wins_over_a_shorter_one_at_the_same_place(keep: bool) -> None:
    # "ab" lies wholly in text pushed before min_tokens; "abc", at the same place, ends in armed text
    matcher = StopStrings(("ab", "abc"), keep)
    assert matcher.push("ab", armed=False) == ("", False)
    assert matcher.push("c") == ("abc" if keep else "", True)
    assert matcher.matched == "abc"
