"""Tokenizer: the builtin byte tokenizer, a folder tokenizer trained in code,
chat templates, and streaming detokenisation."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from mstar.errors import RequestError
from mstar.models.detokenizer import CHAR_IDS, WINDOW
from mstar.models.tokenizer import (BYTE_TOKENIZER_VOCAB_SIZE, IncrementalDetokenizer, Tokenizer,
                                    builtin_byte_tokenizer)

SAMPLES = ["", "hello world", "héllo wörld", "日本語のテキスト", "emoji 🎉🚀👩‍👩‍👧", "mixed ä 中 🎉 end\n\ttabs",
           "<|eot_id|> is text here", "\x00\x01 control"]

CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('conversation must start with a user') }}{% endif %}"
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_byte_tokenizer_round_trips_unicode():
    tok = builtin_byte_tokenizer()
    assert tok.vocab_size == BYTE_TOKENIZER_VOCAB_SIZE
    rng = random.Random(0)
    texts = SAMPLES[:-2] + ["".join(chr(rng.randint(1, 0x2FFFF)) for _ in range(40)) for _ in range(20)]
    texts = [t for t in texts if not any(0xD800 <= ord(c) < 0xE000 for c in t)]  # no lone surrogates
    for text in texts:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
        assert all(i < 256 for i in ids[1:])
        assert len(ids) - 1 == len(text.encode("utf-8"))
        assert tok.decode(ids) == text
        assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_byte_tokenizer_specials_and_eos():
    tok = builtin_byte_tokenizer()
    assert tok.bos_token_id == 256
    assert tok.eos_token_ids == (257, 260)
    assert tok.token_to_id("<|eot_id|>") == 260
    ids = tok.encode("a<|eot_id|>b", add_special_tokens=False)
    assert ids == [97, 260, 98]
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == "a<|eot_id|>b"


def test_byte_tokenizer_chat_template_renders_once_bos():
    tok = builtin_byte_tokenizer()
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    text = tok.apply_chat_template(messages)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nhi\nthere<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("\n\n")
    # the template already holds BOS: encoding must not add a second one
    for special in (True, False):
        ids = tok.encode(text, add_special_tokens=special)
        assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    with pytest.raises(RequestError):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
    with pytest.raises(RequestError):
        tok.apply_chat_template([])


def test_fallback_template_when_folder_has_none():
    tok = Tokenizer(builtin_byte_tokenizer()._tok)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "user: hi\nassistant: "


def _stream(tok, ids, chunks, skip=True):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces, i = [], 0
    for n in chunks:
        piece = detok.push(ids[i:i + n])
        pieces.append(piece)
        i += n
    pieces.append(detok.flush())
    return pieces


def test_detokenizer_streams_whole_characters():
    tok = builtin_byte_tokenizer()
    text = "héllo 世界 🎉 ok"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = _stream(tok, ids, [1] * len(ids))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_detokenizer_random_sequences_match_decode():
    tok = builtin_byte_tokenizer()
    rng = random.Random(1)
    texts = ["".join(rng.choice("aé中🎉 \n") for _ in range(30)) for _ in range(30)]
    for k, text in enumerate(texts):
        ids = tok.encode(text, add_special_tokens=False)
        if k % 3 == 0:  # sprinkle specials between bytes, inside characters too
            for _ in range(4):
                ids.insert(rng.randrange(len(ids) + 1), rng.choice([256, 257, 260]))
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(rng.randint(1, 3))
        for skip in (True, False):
            assert "".join(_stream(tok, ids, chunks, skip)) == tok.decode(ids, skip_special_tokens=skip)
    # arbitrary ids, including invalid UTF-8 byte runs
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        assert "".join(_stream(tok, ids, [1] * len(ids))) == tok.decode(ids)


def test_detokenizer_window_stays_small():
    tok = builtin_byte_tokenizer()
    detok = IncrementalDetokenizer(tok)
    for _ in range(500):
        detok.push([97])
        detok.push([260])  # skipped special: must not grow the window
        assert len(detok._window) <= WINDOW
    assert detok.text == "a" * 500
    for _ in range(500):  # a run of them with no text between
        assert detok.push([260]) == ""
    assert len(detok._window) <= WINDOW
    assert detok.push([98]) == "b"


def test_detokenizer_over_long_sequences_matches_decode():
    """Windows start again from their last ids many times over: what streams
    still joins into the whole decode, for a byte-level BPE and for a
    sentencepiece-style vocabulary whose decoder strips a leading space."""
    rng = random.Random(3)
    words = ["the", "héllo", "世界", "🎉", "fox", "a", "\n", "über"]
    text = " ".join(rng.choice(words) for _ in range(400))
    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    pieces = sorted({"\u2581" + w for w in words} | {c for w in words for c in w} | {"\u2581"})
    sp = HFTokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[]))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    for hf in (bpe, sp):
        tok = Tokenizer(hf)
        ids = hf.encode(text).ids
        assert len(ids) > 10 * WINDOW
        chunks = [rng.randint(1, 3) for _ in range(len(ids))]
        assert "".join(_stream(tok, ids, chunks)) == hf.decode(ids)


def _byte_fallback_tokenizer() -> Tokenizer:
    """Llama-2's kind of vocabulary: sentencepiece pieces, and a character no piece spells as its UTF-8 bytes
    (`<0xE2>`...), which its decoder renders as U+FFFD, every byte of the run, unless the run is whole UTF-8."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["\u2581", "\u2581the", "\u2581fox", "\u2581a", "a", "t", "h", "e"]:
        vocab[piece] = len(vocab)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return Tokenizer(hf, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("text", ["a 世界 fox", "the €\nthe", "the €🎉 the", "a €€€ the 日本語のテキスト"])
def test_detokenizer_keeps_byte_fallback_characters_whole(text: str) -> None:
    """Characters spelled as byte runs, one after another: each window the detokenizer starts again from begins
    where a character does, so no run is split and no character turns into U+FFFD."""
    tok = _byte_fallback_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 2 * WINDOW
    assert "".join(_stream(tok, ids, [1] * len(ids))) == tok.decode(ids) == text


def test_detokenizer_without_prompt_context_keeps_a_left_neighbour() -> None:
    """`context=0` takes no prompt ids; the text it streams still sees the ids before it (a sentencepiece
    decoder strips the space of a word it decodes first)."""
    words = ["the", "fox", "a", "über"]
    pieces = sorted({"\u2581" + w for w in words} | {c for w in words for c in w} | {"\u2581"})
    sp = HFTokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[]))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    text = "the fox a the fox über a the"
    ids = sp.encode(text).ids
    detok = IncrementalDetokenizer(Tokenizer(sp), context=0)
    assert "".join([detok.push([i]) for i in ids] + [detok.flush()]) == sp.decode(ids) == text


def _trained_folder(tmp_path, post_processor: bool, add_bos: bool | None):
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    corpus = ["the quick brown fox jumps over the lazy dog", "héllo wörld 日本語", "tokenizers are fun"] * 50
    tok.train_from_iterator(corpus, trainer)
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    if add_bos is not None:
        cfg["add_bos_token"] = add_bos
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 1], "bos_token_id": 0}))
    return tmp_path


@pytest.mark.parametrize("post_processor,add_bos", [(True, None), (False, True), (True, True)])
def test_folder_tokenizer(tmp_path, post_processor, add_bos):
    tok = Tokenizer.from_folder(_trained_folder(tmp_path, post_processor, add_bos))
    assert tok.bos_token == "<s>" and tok.bos_token_id == 0
    assert tok.eos_token_ids == (3, 1)  # generation config first, then the tokenizer's eos
    ids = tok.encode("the quick brown fox")
    assert ids[0] == 0 and ids.count(0) == 1
    assert len(ids) < len("the quick brown fox")  # merges were learnt
    assert tok.decode(ids) == "the quick brown fox"
    text = tok.apply_chat_template([{"role": "user", "content": "héllo"}])
    assert text == "<s><|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(text).count(0) == 1
    with pytest.raises(RequestError, match="must start with a user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    for seed in range(5):
        rng = random.Random(seed)
        ids = [rng.randrange(tok.vocab_size) for _ in range(30)]
        assert "".join(_stream(tok, ids, [1] * 30)) == tok.decode(ids)


@pytest.mark.parametrize("total", [40, 40_000])  # a step's short windows (one decode each) and past the batch call's
def test_decode_batch_is_each_sequences_decode(tmp_path, total: int) -> None:
    tok = Tokenizer.from_folder(_trained_folder(tmp_path, True, None))
    rng = random.Random(total)
    seqs: list[list[int]] = []
    while sum(map(len, seqs)) < total:
        seqs.append([rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 9))])
    for skip in (True, False):
        assert tok.decode_batch(seqs, skip) == [tok.decode(s, skip) for s in seqs]


def test_token_bytes_join_into_the_texts_utf8(tmp_path):
    """`token_bytes`: a token holding part of a character is that part, so the bytes of a text's tokens join
    into its UTF-8 (byte-level BPE: the builtin and a trained one with merges; a byte-fallback vocabulary,
    whose `<0xNN>` pieces are bytes and whose word marker is a space); added and special tokens are their text."""
    byte_level = builtin_byte_tokenizer()
    trained = Tokenizer.from_folder(_trained_folder(tmp_path, True, None))
    for tok in (byte_level, trained):
        for text in SAMPLES:
            ids = tok.encode(text, add_special_tokens=False)
            assert b"".join(tok.token_bytes(ids)) == text.encode("utf-8"), text
    assert byte_level.token_bytes([0xE2, byte_level.bos_token_id]) == [b"\xe2", b"<|begin_of_text|>"]

    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", "h", "i", "\u2581h", "\u2581hi"]
    sp = HFTokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[("\u2581", "h"), ("\u2581h", "i")],
                                unk_token="<unk>", byte_fallback=True))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    fallback = Tokenizer(sp)
    ids = fallback.encode(" hi é✓", add_special_tokens=False)
    assert [fallback.id_to_token(i) for i in ids][:2] == ["\u2581hi", "\u2581"]
    assert b"".join(fallback.token_bytes(ids)) == " hi é✓".encode("utf-8")
    assert fallback.token_bytes([1 + 0xC3]) == [b"\xc3"]
    sp.decoder = decoders.Metaspace()  # the word marker alone (no byte pieces in the text)
    assert b"".join(Tokenizer(sp).token_bytes(fallback.encode(" hi hi", add_special_tokens=False))) == b" hi hi"


def test_chat_logprob_bytes_of_a_split_character_are_its_bytes() -> None:
    """"é✓" as the byte tokenizer's five tokens: each reads U+FFFD on its own, and its `bytes` are its byte,
    the sampled token's and the alternatives' alike."""
    from mstar.http.text.logprobs import LogprobShapes
    from mstar.types import TokenLogprob

    raw = "é✓".encode()
    entries = [TokenLogprob(b, -0.5, ((b, -0.5), (ord("a"), -1.0))) for b in raw]
    content = LogprobShapes(builtin_byte_tokenizer()).chat(entries)["content"]
    assert [e["token"] for e in content] == ["\ufffd"] * 5 and [e["bytes"] for e in content] == [[b] for b in raw]
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] and e["top_logprobs"][1]["bytes"] == [ord("a")]
               for e in content)


def test_folder_without_bos_request(tmp_path):
    tok = Tokenizer.from_folder(_trained_folder(tmp_path, post_processor=False, add_bos=None))
    assert 0 not in tok.encode("the fox")


def test_chat_template_file_is_read(tmp_path):
    folder = _trained_folder(tmp_path, True, None)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert Tokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_importable_without_torch():
    code = ("import sys; import mstar.models.tokenizer as t; t.builtin_byte_tokenizer().encode('x'); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_a_long_run_of_invalid_bytes_costs_linear_decoding_and_still_matches_decode():
    """A run of invalid UTF-8 bytes ends in U+FFFD after every push, so it is held to its end; the window is
    decoded again only as the held ids double, not at every push (each decode takes the whole window)."""
    tok = builtin_byte_tokenizer()
    stray = tok.encode("\u00e9", add_special_tokens=False)[1]  # a continuation byte alone: invalid on its own
    for tail in ("", "ok", "\u00e9 done", "\u4e16", "more text " * 500):
        ids = [stray] * 4000 + tok.encode(tail, add_special_tokens=False) + [stray] * 3
        detok = IncrementalDetokenizer(tok)
        decoded = detok._decode
        cost = [0]

        def counted(window: list[int], skip: bool) -> str:
            cost[0] += len(window)
            return decoded(window, skip)
        detok._decode = counted
        pieces = [detok.push([i]) for i in ids] + [detok.flush()]
        assert "".join(pieces) == tok.decode(ids)
        assert cost[0] <= 16 * len(ids), cost[0]  # every push decoding the window: ~8 million ids
        if len(tail) > 4000:  # text as long as the run comes out once the held ids have doubled, before the end
            assert "more text " * 100 in "".join(pieces[:-1])


@pytest.mark.parametrize("run, after", [(17, "\U0001f389" * 50), (33, "\U0001f389" * 50), (20, "\u4e16\u754c" * 50),
                                        (17, "now normal text " * 20)])
def test_text_after_a_held_run_comes_out_soon(run: int, after: str):
    """A run of invalid bytes longer than the checked hold, then valid text of multi-byte characters: the
    checks after each doubling look at the next few pushes too, so one of them ends on a character."""
    tok = builtin_byte_tokenizer()
    stray = tok.encode("\u00e9", add_special_tokens=False)[1]
    first = tok.encode(after[0], add_special_tokens=False)
    for before in ([], [stray] * 4000 + tok.encode("a" * 1000, add_special_tokens=False)):  # a long hold first
        ids = before + [stray] * run + tok.encode(after, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok)
        sent = ""
        for n, i in enumerate(ids, 1):
            sent += detok.push([i])
            if after[0] in sent[len(sent) - 2 * len(after):]:
                break
        # out by the check after the held ids doubled past the run and its first character, or its few pushes
        assert n <= len(before) + 2 * (run + len(first)) + CHAR_IDS, (n, len(ids))
        assert "".join([sent, *(detok.push([i]) for i in ids[n:]), detok.flush()]) == tok.decode(ids)


def test_chat_template_file_wins_over_the_tokenizer_config(tmp_path):
    """A folder with both (an older template left in tokenizer_config.json): transformers renders
    chat_template.jinja's, so vLLM serving the folder does; the same prompt here."""
    folder = _trained_folder(tmp_path, True, None)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert Tokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"
