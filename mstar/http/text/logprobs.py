"""Sampled tokens' logprobs in (the engine's `TokenLogprob`s), the shapes
clients read out: the legacy completions object (`tokens`, `token_logprobs`,
`top_logprobs` as token -> logprob maps, `text_offset`), chat's `content`
entries with each token's UTF-8 bytes, and the native route's id entries.

Numbers are of the model's raw distribution (see `SamplingParams`). A token
string is the token decoded on its own with special tokens kept, as vLLM
shows it: a token holding part of a multi-byte character reads U+FFFD. Its
`bytes` are its own bytes of the text (`Tokenizer.token_bytes`), as OpenAI's
are: joined over a text's tokens they make its UTF-8, a character split over
tokens included (a sentencepiece word marker is a space, so a text's first
word there keeps the space its string drops). `text_offset` counts the
characters of the choice's text before each token: its tokens' bytes decoded
as UTF-8 as they come, a character split over tokens counting once, at the
token that completes it (the tokens of one character share its offset; bytes
that never complete one are the text's U+FFFD), and
a special token that the text leaves out (`skip_special_tokens`) counting
none (`echo` is not supported, so the prompt is not part of the text). JSON
has no -inf: a logprob below -9999 (a token the model rules out) is reported
as -9999, as OpenAI does.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from mstar.types import TokenLogprob

FLOOR = -9999.0


def _number(logprob: float) -> float:
    return logprob if logprob > FLOOR else FLOOR  # NaN and -inf compare false: the floor


class LogprobShapes:
    """One request's logprobs in the OpenAI shapes, token strings from the
    served model's tokenizer. Keeps each completions choice's text offset, so
    a stream's chunks continue where the previous one ended."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # choice index -> characters of its text so far, and the decoder holding a character's first bytes
        self._offsets: dict[int, int] = {}
        self._decoders: dict[int, codecs.IncrementalDecoder] = {}

    def _strings(self, entries: Sequence[TokenLogprob]) -> dict[int, str]:
        """Every token id of `entries` (sampled and top) decoded, in one call."""
        ids = list(dict.fromkeys([i for e in entries for i in (e.token_id, *(t for t, _ in e.top))]))
        return dict(zip(ids, self.tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)))

    def completion(self, index: int, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """`/v1/completions`' `logprobs` for choice `index`'s `entries` (its next tokens)."""
        text = self._strings(entries)
        tokens = [text[e.token_id] for e in entries]
        ids = list(dict.fromkeys(e.token_id for e in entries))
        raw = dict(zip(ids, self.tokenizer.token_bytes(ids)))
        if self.skip_special_tokens:  # a token that decodes to nothing without its specials is not in the text
            shown = dict(zip(ids, self.tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=True)))
            raw = {i: b if shown[i] else b"" for i, b in raw.items()}
        decoder = self._decoders.setdefault(index, codecs.getincrementaldecoder("utf-8")(errors="replace"))
        offsets = []
        at = self._offsets.get(index, 0)
        for e in entries:
            data = raw[e.token_id]
            # a token that starts a character ends what the decoder holds of the one before: bytes that never
            # completed one, which the text shows as one U+FFFD ahead of this token
            cut = bool(data) and not 0x80 <= data[0] < 0xC0 and bool(decoder.getstate()[0])
            offsets.append(at + cut)
            at += len(decoder.decode(data))
        self._offsets[index] = at
        return {"tokens": tokens, "token_logprobs": [_number(e.logprob) for e in entries],
                "top_logprobs": [_top_map(e, text) for e in entries], "text_offset": offsets}

    def chat(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """`/v1/chat/completions`' `logprobs` of `entries`."""
        text = self._strings(entries)
        raw = dict(zip(text, self.tokenizer.token_bytes(list(text))))

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            return {"token": text[token_id], "logprob": _number(logprob), "bytes": list(raw[token_id])}

        return {"content": [{**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, v) for t, v in e.top]}
                            for e in entries]}


def _top_map(entry: TokenLogprob, text: dict[int, str]) -> dict[str, float]:
    """A position's token string -> logprob map: the sampled token (always
    there, so a map may hold k + 1 entries, as OpenAI's) and the k most
    likely. Tokens whose strings are equal (parts of characters all read
    U+FFFD) share one key: the sampled token's, else the most likely's."""
    out = {text[entry.token_id]: _number(entry.logprob)}
    for token_id, logprob in entry.top:
        out.setdefault(text[token_id], _number(logprob))
    return out


def native_logprobs(entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """`/generate`'s `logprobs`: ids, no strings (the route speaks token ids)."""
    return [{"token_id": e.token_id, "logprob": _number(e.logprob),
             "top_logprobs": [{"token_id": t, "logprob": _number(v)} for t, v in e.top]} for e in entries]
