"""The Qwen3-Omni thinker's text decoder against transformers: a tiny random
model built offline and saved as transformers saves it (experts one by
one), loaded by mstar's loader; prefill logits, the embeddings and the
`accept_hidden_layer` output the talker reads, and greedy decode tokens over
a dense cache, in float32."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3OmniMoeForConditionalGeneration

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.errors import ConfigError
from mstar.models.qwen3_omni.config import Qwen3OmniConfig
from mstar.models.qwen3_omni.loader import load_thinker
from mstar.models.qwen3_omni.model import Qwen3OmniModel
from mstar.models.qwen3_omni.thinker import ThinkerDecoder
from mstar.types import GenerateRequest, SamplingParams, TokenBatch
from test_qwen3_omni_config import tiny

PROMPT = [151644, 872, 198, 100, 2001, 37, 4242, 151645, 198, 151644, 77091, 198]


class DenseCache:
    """One request's attention over dense per-layer K/V (GQA, causal)."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        self.k[layer] = torch.cat([self.k[layer], k]) if layer in self.k else k
        self.v[layer] = torch.cat([self.v[layer], v]) if layer in self.v else v
        group = q.shape[1] // k.shape[1]
        keys = self.k[layer].repeat_interleave(group, dim=1).transpose(0, 1)
        values = self.v[layer].repeat_interleave(group, dim=1).transpose(0, 1)
        n, total = q.shape[0], keys.shape[1]
        mask = torch.arange(total)[None, :] <= (total - n + torch.arange(n))[:, None]
        return F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask,
                                              scale=scale).transpose(0, 1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen3OmniMoeForConditionalGeneration]:
    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(tiny()).eval()
    # transformers leaves stacked experts uninitialised; norm weights near 1, as trained ones are (near 0 they
    # flatten attention until positions stop mattering)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if re.search(r"norm\d*\.weight$", name) else 0.0, 0.08)
    folder = tmp_path_factory.mktemp("omni-weights")
    model.save_pretrained(folder)
    return folder, model


def _ours(folder: Path) -> ThinkerDecoder:
    cfg = Qwen3OmniConfig.from_folder(folder)
    decoder = ThinkerDecoder(cfg.thinker, cfg.talker.accept_hidden_layer).eval()
    load_thinker(decoder, folder)
    return decoder


def _step(decoder: ThinkerDecoder, ids: list[int], start: int, cache: DenseCache) -> dict[str, torch.Tensor]:
    n = len(ids)
    return decoder.prefill(TokenBatch(input_ids=torch.tensor(ids), positions=torch.arange(start, start + n),
                                      query_start=torch.tensor([0, n]), logits_index=torch.tensor([n - 1]),
                                      attn=cache))


@torch.inference_mode()
def test_prefill_and_greedy_decode_match_transformers(saved) -> None:
    folder, model = saved
    decoder = _ours(folder)
    ids = torch.tensor([PROMPT])
    want = model.thinker(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
    cache = DenseCache()
    out = _step(decoder, PROMPT, 0, cache)
    torch.testing.assert_close(out["logits"][0], want.logits[0, -1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out["embeds"], want.hidden_states[0][0])
    accept = Qwen3OmniConfig.from_folder(folder).talker.accept_hidden_layer
    torch.testing.assert_close(out["hidden"], want.hidden_states[accept][0], atol=1e-4, rtol=1e-4)
    generated = model.thinker.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                       do_sample=False)[0, len(PROMPT):].tolist()
    tokens = [int(out["logits"][0].argmax())]
    for k in range(5):
        tokens.append(int(_step(decoder, [tokens[-1]], len(PROMPT) + k, cache)["logits"][0].argmax()))
    assert tokens == generated


def test_a_checkpoint_without_an_expert_is_refused(saved, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder, _ = saved
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["thinker.model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"missing 1 tensor\(s\): layers\.1\.mlp\.gate_up"):
        _ours(tmp_path)


def test_a_key_projection_of_the_wrong_size_is_refused_not_written_over_the_queries(saved, tmp_path: Path) -> None:
    """q, k and v fill the row blocks of one merged weight: a k of another
    size (here the size of q) names the tensor instead of landing elsewhere."""
    from safetensors.torch import load_file, save_file

    folder, _ = saved
    tensors = load_file(str(folder / "model.safetensors"))
    name = "thinker.model.layers.0.self_attn.k_proj.weight"
    tensors[name] = tensors["thinker.model.layers.0.self_attn.q_proj.weight"].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ConfigError, match=re.escape(name)):
        _ours(tmp_path)


async def test_the_served_thinker_decodes_as_transformers_generates(saved) -> None:
    """Concurrent greedy requests of different prompts through the engine's
    paged cache (pages of 4 tokens) give transformers' greedy tokens."""
    folder, model = saved
    prompts = [PROMPT, PROMPT[:5] + [9, 99, 999], [151644, 872, 198, 42], PROMPT + [7] * 9]
    want = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            want.append(model.thinker.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                               do_sample=False, eos_token_id=None)[0, len(p):].tolist())
    eng = Engine(EngineConfig(model=str(folder), devices=("cpu",), dtype="float32", max_model_len=64,
                              scheduler=SchedulerConfig(page_size=4)))  # the folder's model_type picks the model
    await eng.start()
    try:
        async def run(k: int, p: list[int]) -> list[int]:
            request = GenerateRequest(f"t{k}", str(folder), {"prompt_ids": p},
                                      SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
            return [t for c in [c async for c in eng.submit(request)] for t in c.token_ids]

        got = await asyncio.gather(*(run(k, p) for k, p in enumerate(prompts)))
        assert got == want
        assert isinstance(eng.model, Qwen3OmniModel)
    finally:
        await eng.shutdown()


async def test_the_builtin_tiny_model_serves_text_prompts() -> None:
    """`qwen3-omni-tiny` by name: random weights, the byte tokenizer, a text
    prompt decoded to its token budget on the CPU, the same on a second run."""
    from mstar.models.registry import load_model

    assert load_model("qwen3-omni-tiny").random_weights
    eng = Engine(EngineConfig(model="qwen3-omni-tiny", devices=("cpu",), max_model_len=128))
    await eng.start()
    try:
        async def run(rid: str) -> list[int]:
            request = GenerateRequest(rid, "qwen3-omni-tiny", {"prompt": "hello there"},
                                      SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True))
            chunks = [c async for c in eng.submit(request)]
            assert chunks[-1].finish_reason == "length"
            return [t for c in chunks for t in c.token_ids]

        first, second = await run("a"), await run("b")
        assert len(first) == 5 and first == second
    finally:
        await eng.shutdown()
