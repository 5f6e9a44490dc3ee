"""IncrementalDetokenizer: generated token ids in, streamable text out.

Pure Python over a `Tokenizer`'s `decode`: each push decodes a short window,
never the whole sequence, and never emits half of a multi-byte character.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mstar.models.tokenizer import Tokenizer

# the window grows by the pushed ids until it holds this many, then starts again from the ids it just
# emitted: until then the window's text before a push is the text after the previous one, already known,
# so most pushes cost one decode, not two (the event loop pays this for every running request's token); a
# longer window costs more in each decode than it saves in restarts
WINDOW = 4
# Text ending in U+FFFD is held (usually a character split across ids), and each push decodes the whole window:
# a long run of invalid bytes, which never stops ending in U+FFFD, would cost each push more. Past this many held
# ids the window is decoded again only when their count has doubled since, and at the CHAR_IDS pushes after each
# such check (a character spans at most 4 ids that carry bytes, so one of them ends where a character does): a
# run costs linear time in all, and text after it comes out within about twice as many ids as the run held
HELD_CHECKED = 16
CHAR_IDS = 4


class IncrementalDetokenizer:
    """Generated token ids in, new text out, one push at a time.

    Decodes only a short window: tokens already emitted (kept as context, so
    the tokenizer's spacing rules see a left neighbour) followed by the
    tokens not yet emitted. The new text is the window's text minus the
    context's. Text ending in U+FFFD is held back, since it is usually a
    character whose bytes are split across tokens; `flush` releases whatever
    is still held at the end. The pieces concatenate to
    `tokenizer.decode(ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = (), context: int = 5) -> None:
        """`prompt_ids`: what the answer follows; its last `context` ids are the first push's left neighbour."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode = tokenizer.decode_list
        # window = context tokens [0, _read) + unemitted tokens [_read, end); _before is the context's text
        self._window: list[int] = [int(i) for i in list(prompt_ids)[-context:]] if context > 0 else []
        self._read = len(self._window)
        self._before = self._decode(self._window, skip_special_tokens) if self._window else ""
        self._pieces: list[str] = []
        self._next_check = 0  # held ids at which a long hold decodes again
        self._checked = 0     # held ids at its last doubling check (the next few pushes decode too)

    @property
    def text(self) -> str:
        """All the text emitted so far."""
        return "".join(self._pieces)

    def push(self, new_ids: Iterable[int]) -> str:
        """Append `new_ids`; return the text that is now safe to show."""
        window = self._window
        read = self._read
        held = len(window) - read
        window.extend(new_ids)
        if len(window) == read:
            return ""
        now = len(window) - read
        if HELD_CHECKED < now < self._next_check and now > self._checked + CHAR_IDS:
            return ""
        out = self._advance(self._decode(window, self.skip_special_tokens), False, held)
        still = len(self._window) - self._read
        if still > HELD_CHECKED:  # still held: look again over the next few pushes, then when twice as many are
            if still >= self._next_check:
                self._next_check, self._checked = 2 * still, still
        elif self._next_check:  # released: the next long hold starts afresh (a token's usual path skips this)
            self._next_check = self._checked = 0
        return out

    def flush(self) -> str:
        """The text held back at the end of generation (an incomplete character)."""
        if self._read >= len(self._window):
            return ""
        return self._advance(self._decode(self._window, self.skip_special_tokens), final=True, held=-1)

    def _advance(self, after: str, final: bool, held: int) -> str:
        before, window = self._before, self._window
        if after == before and held == 0:
            # the new ids render as nothing (skipped specials): forget them so a
            # long run of them does not grow the window
            del window[self._read:]
            return ""
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""
        delta = after[len(before):]
        if len(window) >= WINDOW:
            # start again from the ids just emitted, the next push's left neighbour: they begin where a
            # character does (a later id alone may be the last byte of one, which a byte-fallback decoder
            # would render, with the next character's bytes, as U+FFFD)
            del window[:self._read]
            self._before = self._decode(window, self.skip_special_tokens)
        else:  # what was just emitted joins the context
            self._before = after
        self._read = len(window)
        self._pieces.append(delta)
        return delta

