"""A stream's first chunk runs as soon as it is cut: the consumer's step on
it goes ahead of the producer's next step (`WorkItem.leads`) where that step
cuts no other chunk, so a lone Orpheus request's first audio is emitted right
after the LLM step that drew its 28th code (`scripts/probe_first_window.py`,
Orpheus tiny on the CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from probe_first_window import level  # noqa: E402

pytest.importorskip("transformers")


async def test_the_first_audio_follows_the_step_that_completes_its_window() -> None:
    cut, audio = await level("orpheus-tiny", ("cpu",), 0)
    assert cut == 29  # the prompt step, then 28 codes
    assert audio == cut
