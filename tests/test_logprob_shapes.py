"""`LogprobShapes.completion`'s `text_offset` indexes the choice's text: a
special token the text leaves out counts no characters, one it keeps counts
its string, a character split over tokens counts once, and a stream's pieces
continue each choice's offsets."""

from __future__ import annotations

from mstar.http.text.logprobs import LogprobShapes
from mstar.models.tokenizer import BEGIN_OF_TEXT, BYTE_TOKENIZER_BOS, builtin_byte_tokenizer
from mstar.types import TokenLogprob


def _entries(ids: list[int]) -> list[TokenLogprob]:
    return [TokenLogprob(i, -1.0, ((i, -1.0),)) for i in ids]


def test_text_offset_skips_a_special_token_the_text_leaves_out():
    tok = builtin_byte_tokenizer()
    ids = [ord("H"), BYTE_TOKENIZER_BOS, ord("i"), ord("!")]
    text = tok.decode(ids)  # skip_special_tokens: "Hi!"
    got = LogprobShapes(tok).completion(0, _entries(ids))
    assert got["tokens"] == ["H", BEGIN_OF_TEXT, "i", "!"]
    assert got["text_offset"] == [0, 1, 1, 2]
    assert [text[o] for o, t in zip(got["text_offset"], got["tokens"]) if t != BEGIN_OF_TEXT] == ["H", "i", "!"]
    kept = LogprobShapes(tok, skip_special_tokens=False).completion(0, _entries(ids))
    assert kept["text_offset"] == [0, 1, 1 + len(BEGIN_OF_TEXT), 2 + len(BEGIN_OF_TEXT)]


def test_text_offset_continues_over_a_stream_per_choice():
    tok = builtin_byte_tokenizer()
    shapes = LogprobShapes(tok)
    assert shapes.completion(0, _entries([ord("a"), BYTE_TOKENIZER_BOS]))["text_offset"] == [0, 1]
    assert shapes.completion(1, _entries([ord("x")]))["text_offset"] == [0]
    assert shapes.completion(0, _entries([ord("b"), ord("c")]))["text_offset"] == [1, 2]


def test_text_offset_counts_a_character_split_over_tokens_once():
    tok = builtin_byte_tokenizer()
    e_acute, snowman = "é".encode(), "☃".encode()  # two and three bytes: a byte token each
    ids = [ord("a"), *e_acute, ord("b"), *snowman, ord("c")]
    text = tok.decode(ids)
    assert text == "aéb☃c"
    shapes = LogprobShapes(tok)  # in two pieces of a stream, the first ending inside "é"
    got = [*shapes.completion(0, _entries(ids[:2]))["text_offset"],
           *shapes.completion(0, _entries(ids[2:]))["text_offset"]]
    # the bytes of one character share its offset, and each token's offset indexes the text
    assert got == [0, 1, 1, 2, 3, 3, 3, 4]
    assert [text[o] for o in got] == ["a", "é", "é", "b", "☃", "☃", "☃", "c"]


def test_text_offset_of_bytes_that_never_complete_a_character():
    # two lead bytes with nothing to complete them: the text shows a U+FFFD for each, and "r" comes after both
    tok = builtin_byte_tokenizer()
    ids = [0xE5, 0xC3, ord("r"), 0xE2, 0x98, ord("!")]  # the last two bytes of three, then "!"
    text = tok.decode(ids)
    assert text == "\ufffd\ufffdr\ufffd!"
    got = LogprobShapes(tok).completion(0, _entries(ids))["text_offset"]
    assert got == [0, 1, 2, 3, 3, 4]
    assert text[got[2]] == "r" and text[got[5]] == "!"
