"""What every request's intake resolves alike, worked out once: the served
model a request names as a `Target` (by the app's `Targets`, for as long as
the engine's card and tokenizer are the same), and a route's names for the fields the model
names in its errors."""

from __future__ import annotations

from typing import Any

import pytest

from mstar.errors import ModelNotFound, RequestError
from mstar.http.submission import Targets, spoken_names
from mstar.types import ModelCard, SamplingParams


class FakeEngine:
    """What `Targets` reads of an engine: its name, cards and tokenizer."""

    def __init__(self, card: ModelCard, tokenizer: Any = None) -> None:
        self.card, self.tok = card, tokenizer
        self.model_name = card.name

    def model_cards(self) -> list[ModelCard]:
        return [self.card]

    def tokenizer(self, name: str) -> Any:
        if not self.card.answers_to(name):
            raise ModelNotFound(name)
        if self.tok is None:
            raise RequestError(f"model '{name}' has no tokenizer", field="model")
        return self.tok


def card(**kw: Any) -> ModelCard:
    return ModelCard("m", 2048, ("speak", "generate"), "speak", tts_walk="speak", aliases=("alias",),
                     tts_sampling=SamplingParams(max_tokens=1200, temperature=0.6), **kw)


def test_a_target_is_made_once_per_card_name_and_tokenizer() -> None:
    engine = FakeEngine(card(), tokenizer=object())
    targets = Targets(engine)
    target = targets.resolve(None)
    assert target.name == "m" and target.tokenizer is engine.tok and target.tts_walk == "speak"
    assert target.tts_sampling == SamplingParams(max_tokens=None, temperature=0.6)
    assert targets.resolve("m") is target and targets.resolve(None) is target
    alias = targets.resolve("alias")
    assert alias.name == "alias" and alias is not target and targets.resolve("alias") is alias
    # an engine that started again has a new card; a tokenizer of its own is another target too
    engine.card = card()
    restarted = targets.resolve("m")
    assert restarted is not target and restarted == target
    engine.tok = object()
    assert targets.resolve("m").tokenizer is engine.tok
    engine.tok = None
    assert targets.resolve("m").tokenizer is None
    # another app's resolver keeps its own
    assert Targets(engine).resolve("m") is not targets.resolve("m")


def test_a_model_not_served_is_still_refused() -> None:
    targets = Targets(FakeEngine(card()))
    targets.resolve("m")
    with pytest.raises(ModelNotFound):
        targets.resolve("other")


def test_spoken_names_are_shared_and_read_only() -> None:
    names = spoken_names("input", None)
    assert names["max_tokens"] == "input" and names["input"] == "input" and names["temperature"] == "temperature"
    assert spoken_names("input", "max_tokens")["max_tokens"] == "max_tokens"
    assert spoken_names("text", None, "sampling_params.")["top_p"] == "sampling_params.top_p"
    assert spoken_names("input", None) is names
    with pytest.raises(TypeError):
        names["input"] = "x"  # type: ignore[index]
