"""IncrementalDetokenizer: generated token ids in, streamable text out.

Pure Python over a `Tokenizer`'s `decode`: each push decodes a short window,
never the whole sequence, and never emits half of a multi-byte character.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mstar.models.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Generated token ids in, new text out, one push at a time.

    Decodes only a short window: the tokens emitted by the previous advance
    (kept as context, so the tokenizer's spacing rules see a left neighbour)
    followed by the tokens not yet emitted. The new text is the window's text
    minus the context's. Text ending in U+FFFD is held back, since it is
    usually a character whose bytes are split across tokens; `flush` releases
    whatever is still held at the end. The pieces concatenate to
    `tokenizer.decode(ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = (), context: int = 5) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # window = context tokens [0, _read) + unemitted tokens [_read, end)
        self._window: list[int] = [int(i) for i in list(prompt_ids)[-context:]] if context > 0 else []
        self._read = len(self._window)
        self.text = ""

    def push(self, new_ids: Iterable[int]) -> str:
        """Append `new_ids`; return the text that is now safe to show."""
        return push_batch([self], [new_ids])[0]

    def flush(self) -> str:
        """The text held back at the end of generation (an incomplete character)."""
        if self._read >= len(self._window):
            return ""
        before, after = self.tokenizer.decode_batch([self._window[:self._read], self._window],
                                                    self.skip_special_tokens)
        return self._advance(before, after, final=True, held=-1)

    def _advance(self, before: str, after: str, final: bool, held: int) -> str:
        if after == before and held == 0:
            # the new ids render as nothing (skipped specials): forget them so a
            # long run of them does not grow the window
            del self._window[self._read:]
            return ""
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""
        delta = after[len(before):]
        # what was just emitted becomes the next context
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self.text += delta
        return delta


def push_batch(detoks: Sequence[IncrementalDetokenizer], new_ids: Sequence[Iterable[int]]) -> list[str]:
    """`push` for many requests at once: one call into the tokenizer library
    per tokenizer and options, not two per request (the per-step cost on the
    event loop, which serves every stream)."""
    out = [""] * len(detoks)
    held = []
    for d, ids in zip(detoks, new_ids):
        held.append(len(d._window) - d._read)
        d._window.extend(ids)
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, d in enumerate(detoks):
        if d._read < len(d._window):
            groups.setdefault((id(d.tokenizer), d.skip_special_tokens), []).append(i)
    for (_, skip), rows in groups.items():
        tok = detoks[rows[0]].tokenizer
        seqs = [detoks[i]._window[:detoks[i]._read] for i in rows] + [detoks[i]._window for i in rows]
        texts = tok.decode_batch(seqs, skip)
        n = len(rows)
        for j, i in enumerate(rows):
            out[i] = detoks[i]._advance(texts[j], texts[n + j], final=False, held=held[i])
    return out
