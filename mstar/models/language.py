"""`LanguageModel`: what the runtime reads of a model that is one language
model over a tokenizer (Llama, Orpheus, Qwen3.5): its tokenizer, its EOS ids
(the generation config's, the config's and the tokenizer's, in that order,
once each), the served context and whether its weights are random.

A subclass sets `config` (with `eos_token_ids`), `load_format`,
`_tokenizer` (a folder's: `folder_tokenizer`), `_generation_eos` and
`_max_model_len` in its constructor.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mstar.models.base import Model
from mstar.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class LanguageModel(Model):
    config: Any
    load_format: str
    _tokenizer: Tokenizer | None
    _generation_eos: tuple[int, ...] = ()
    _max_model_len: int

    @staticmethod
    def folder_tokenizer(path: Path) -> Tokenizer | None:
        """The folder's tokenizer; None (token-id prompts only) without a tokenizer.json."""
        if not (path / "tokenizer.json").is_file():
            log.warning("%s has no tokenizer.json: only token-id prompts can be served", path)
            return None
        return Tokenizer.from_folder(path)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        tok = self._tokenizer.eos_token_ids if self._tokenizer is not None else ()
        return tuple(dict.fromkeys((*self._generation_eos, *self.config.eos_token_ids, *tok)))

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def random_weights(self) -> bool:
        return self.load_format == "dummy"
