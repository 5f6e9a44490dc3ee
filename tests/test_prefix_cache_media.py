"""The prefix cache over a multimodal prompt (Qwen3-Omni's thinker, a tiny
random model on the CPU): a page's key hashes its tokens' ids, the digest of
the media rows that stand for its placeholders, and its positions, so a
prompt with the same media starts from the cached pages past them, and one
with other media of the same size only from the text before them; outputs
are those of an engine without the cache either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.types import GenerateRequest, SamplingParams
from test_qwen3_omni_media import _audio, _clip, _messages, _picture, folder  # noqa: F401  (fixtures)
from test_qwen3_omni_thinker import saved  # noqa: F401  (the fixture)

PAGE = 4


def _prompts() -> dict[str, list[dict]]:
    long_text = "describe what you hear and see, in detail please"
    return {
        "first": _messages(long_text, _audio(_clip(1.4, 1)), _picture(40, 33, 2), "and then?"),
        "same media": _messages(long_text, _audio(_clip(1.4, 1)), _picture(40, 33, 2), "and then?"),
        "other clip": _messages(long_text, _audio(_clip(1.4, 7)), _picture(40, 33, 2), "and then?"),
        "other question": _messages(long_text, _audio(_clip(1.4, 1)), _picture(40, 33, 2), "why?"),
    }


async def _serve(folder: Path, caching: bool) -> tuple[dict[str, tuple[list[int], list[float]]], dict[str, int]]:
    """Each prompt's greedy tokens and logprobs, one after the other, and the
    prompt tokens each found in the cache."""
    eng = Engine(EngineConfig(model=str(folder), devices=("cpu",), max_model_len=512,
                              scheduler=SchedulerConfig(page_size=PAGE, prefix_caching=caching)))
    await eng.start()
    out, hits = {}, {}
    try:
        for name, messages in _prompts().items():
            before = eng.workers[0].prefix_caches().get("thinker", {}).get("hits", 0)
            params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)
            chunks = [c async for c in eng.submit(GenerateRequest(name, str(folder), {"messages": messages}, params))]
            assert all(c.error is None for c in chunks), [c.error for c in chunks]
            out[name] = ([t for c in chunks for t in c.token_ids],
                         [lp.logprob for c in chunks for lp in c.logprobs or ()])
            hits[name] = eng.workers[0].prefix_caches().get("thinker", {}).get("hits", 0) - before
        return out, hits
    finally:
        await eng.shutdown()


def _placeholders(folder: Path) -> tuple[int, int, dict[str, list[int]]]:
    from mstar.models.qwen3_omni.model import Qwen3OmniModel

    model = Qwen3OmniModel(str(folder), str(folder))
    ids = {name: model.prepare(GenerateRequest(name, "m", {"messages": m})).values["prompt_ids"].tolist()
           for name, m in _prompts().items()}
    return model.config.ids.audio, model.config.ids.image, ids


async def test_media_prompts_reuse_what_they_share_and_nothing_else(folder: Path) -> None:  # noqa: F811
    cached, hits = await _serve(folder, True)
    plain, none = await _serve(folder, False)
    assert not any(none.values())
    for name in cached:
        assert cached[name][0] == plain[name][0], name
        assert cached[name][1] == pytest.approx(plain[name][1], abs=1e-4), name
    audio, image, ids = _placeholders(folder)
    first = ids["first"]
    media_start = first.index(audio)
    media_end = len(first) - 1 - first[::-1].index(image)
    assert hits["first"] == 0
    # the same prompt: every full page but the one holding its last token
    assert hits["same media"] == (len(first) - 1) // PAGE * PAGE
    # another clip of the same length: its ids are the same, its audio rows are not
    assert ids["other clip"] == first
    assert 0 < hits["other clip"] <= media_start // PAGE * PAGE
    # another question after the same media: the pages before the question's first difference
    differs = next(i for i, (a, b) in enumerate(zip(first, ids["other question"])) if a != b)
    assert differs > media_end and hits["other question"] == differs // PAGE * PAGE


def test_signed_keys_follow_media_content_and_positions() -> None:
    from mstar.engine.movement.tensor_store import TensorRef, TensorStore
    from mstar.engine.worker.prompt_rows import _signed_keys
    from mstar.graph import In, Kind, Mode, Out, Step

    sig = Mode("prefill", (In("ids", Kind.IDS), In("audio", Kind.EMBEDS, at=9), In("pos", Kind.POSITIONS, axes=3)),
               (Out("token", Kind.TOKEN),), kv="append", query="ids")
    step = Step("thinker", "prefill", {"ids": "ids", "audio": "rows", "pos": "pos"}, {"token": "t"})
    store = TensorStore()
    ids = torch.tensor([1, 2, 3, 4, 9, 9, 9, 9, 5, 6, 7, 8])

    def keys(rows: torch.Tensor, pos: torch.Tensor) -> tuple[bytes, ...]:
        refs = {"ids": TensorRef(store.put(ids, ("r",))), "rows": TensorRef(store.put(rows, ("r",))),
                "pos": TensorRef(store.put(pos, ("r",)))}
        return _signed_keys(store, sig, step, refs, 4, b"thinker")

    rows = torch.randn(4, 8)
    pos = torch.arange(12).expand(3, 12).clone()
    base = keys(rows, pos)
    assert len(base) == 3 and keys(rows.clone(), pos.clone()) == base
    other = keys(torch.randn(4, 8), pos)
    assert other[0] == base[0] and other[1] != base[1] and other[2] != base[2]
    moved = pos.clone()
    moved[1, 4:8] = 4  # the same rows at other (M-RoPE) positions
    assert keys(rows, moved)[0] == base[0] and keys(rows, moved)[1] != base[1]
