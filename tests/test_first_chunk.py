"""A stream's first chunk runs as soon as it is cut: the consumer's step on
it goes ahead of the producer's next step (`WorkItem.leads`), so Orpheus's
first audio is emitted right after the LLM step that drew its 28th code,
alone and beside running speech streams (`scripts/probe_first_window.py`,
Orpheus tiny on the CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from probe_first_window import level  # noqa: E402

pytest.importorskip("transformers")


@pytest.mark.parametrize("streams", [0, 6])
async def test_the_first_audio_follows_the_step_that_completes_its_window(streams: int) -> None:
    cut, audio = await level("orpheus-tiny", ("cpu",), streams)
    assert cut == 29  # the prompt step, then 28 codes
    assert audio == cut
