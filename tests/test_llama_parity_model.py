"""LlamaDecoder over the paged KV cache against transformers' LlamaForCausalLM
with the same weights: logits close (fp32) and greedy tokens equal, for single
rows, mixed prefill/decode batches, and checkpoint variants (tied/untied head,
llama3 rope scaling with biases, sharded safetensors)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from mstar.engine.memory.attention import TorchPagedAttention
from mstar.engine.memory.kv_cache import KVCache
from mstar.models.registry import load_model
from mstar.types import TokenBatch

PAGE = 4
VOCAB = 300
ATOL = 1e-4

VARIANTS = {
    "tied": dict(tie_word_embeddings=True),
    "untied": dict(tie_word_embeddings=False, num_hidden_layers=3),
    "llama3_rope_bias": dict(
        tie_word_embeddings=False, attention_bias=True, mlp_bias=True, rope_theta=50000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),
    "sharded": dict(tie_word_embeddings=False, num_key_value_heads=1),
}


def make_hf(folder, variant: str) -> transformers.LlamaForCausalLM:
    torch.manual_seed(1234)
    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.1,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kwargs.update(VARIANTS[variant])
    cfg = transformers.LlamaConfig(**kwargs)
    cfg._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a mis-loaded one shows
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    shard = "40KB" if variant == "sharded" else "10GB"
    hf.save_pretrained(folder, safe_serialization=True, max_shard_size=shard)
    return hf


class PagedRunner:
    """Drives a decoder the way the engine does: rows own random,
    non-contiguous pages; every step plans attention once for all rows."""

    def __init__(self, decoder, spec, num_pages: int = 256, seed: int = 0, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.decoder = decoder
        self.device = device
        self.cache = KVCache(spec, num_pages, PAGE, device, dtype)
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_pages, generator=gen).tolist()
        self.pages: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, rows: list[tuple[str, list[int]]]) -> torch.Tensor:
        ids, positions, starts, ctx, tables = [], [], [0], [], []
        for rid, new in rows:
            done = self.lens.setdefault(rid, 0)
            pages = self.pages.setdefault(rid, [])
            while len(pages) * PAGE < done + len(new):
                pages.append(self.free.pop())
            ids += new
            positions += range(done, done + len(new))
            starts.append(starts[-1] + len(new))
            ctx.append(done)
            tables.append(list(pages))
        qs = torch.tensor(starts)
        attn = TorchPagedAttention(self.cache, qs, torch.tensor(ctx), tables)
        dev = self.device
        batch = TokenBatch(input_ids=torch.tensor(ids, device=dev), positions=torch.tensor(positions, device=dev),
                           query_start=qs, logits_index=(qs[1:] - 1).to(dev), attn=attn)
        out = self.decoder.decode(batch) if all(len(n) == 1 for _, n in rows) else self.decoder.prefill(batch)
        for rid, new in rows:
            self.lens[rid] += len(new)
        return out["logits"].cpu()


def hf_last_logits(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([seq])).logits[0, -1].float()


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_hf(folder, request.param)
    model = load_model(str(folder))
    decoder = model.build_component("llm", torch.device("cpu"), torch.float32)
    return hf, model, decoder


def test_loaded_config(pair):
    hf, model, decoder = pair
    assert model.kv_spec("llm").num_kv_heads == hf.config.num_key_value_heads
    assert model.max_model_len == 256
    assert decoder.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (decoder.lm_head.weight.data_ptr() == decoder.embed_tokens.weight.data_ptr()) == decoder.tie_word_embeddings


def test_prefill_then_decode_matches(pair):
    hf, model, decoder = pair
    runner = PagedRunner(decoder, model.kv_spec("llm"), seed=1)
    seq = [5, 17, 250, 3, 99, 42, 7, 7, 120, 64, 33]
    logits = runner.step([("a", seq)])
    assert logits.shape == (1, VOCAB) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], hf_last_logits(hf, seq), atol=ATOL, rtol=0)
    for _ in range(10):
        nxt = int(logits[0].argmax())
        seq.append(nxt)
        logits = runner.step([("a", [nxt])])
        torch.testing.assert_close(logits[0], hf_last_logits(hf, seq), atol=ATOL, rtol=0)


def test_mixed_batch_rows_at_different_stages(pair):
    hf, model, decoder = pair
    runner = PagedRunner(decoder, model.kv_spec("llm"), seed=2)
    gen = torch.Generator().manual_seed(3)
    prompts = {r: torch.randint(0, VOCAB, (n,), generator=gen).tolist() for r, n in
               [("a", 9), ("b", 2), ("c", 13), ("d", 1), ("e", 6)]}
    seqs = {r: [] for r in prompts}

    def run(rows):
        logits = runner.step(rows)
        for (rid, new), row_logits in zip(rows, logits):
            seqs[rid] += new
            torch.testing.assert_close(row_logits, hf_last_logits(hf, seqs[rid]), atol=ATOL, rtol=0)
        return {rid: int(lg.argmax()) for (rid, _), lg in zip(rows, logits)}

    nxt = run([("a", prompts["a"]), ("b", prompts["b"])])
    # c arrives and prefills in two chunks while a and b decode
    nxt |= run([("a", [nxt["a"]]), ("c", prompts["c"][:5]), ("b", [nxt["b"]])])
    nxt |= run([("c", prompts["c"][5:]), ("b", [nxt["b"]]), ("d", prompts["d"]), ("a", [nxt["a"]])])
    nxt |= run([("e", prompts["e"]), ("a", [nxt["a"]]), ("b", [nxt["b"]]), ("c", [nxt["c"]]), ("d", [nxt["d"]])])
    for _ in range(4):
        nxt |= run([(r, [nxt[r]]) for r in ("d", "c", "b", "a", "e")])


def test_greedy_matches_generate(pair):
    hf, model, decoder = pair
    runner = PagedRunner(decoder, model.kv_spec("llm"), seed=4)
    prompts = {"p0": [1, 2, 3], "p1": [200, 13, 77, 5, 9, 150, 151, 3, 2], "p2": [42], "p3": list(range(40, 70))}
    steps = 12
    expected = {}
    for rid, p in prompts.items():
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        expected[rid] = out[0, len(p):].tolist()
    got = {rid: [] for rid in prompts}
    logits = runner.step(list(prompts.items()))
    for _ in range(steps):
        toks = logits.argmax(-1).tolist()
        for rid, t in zip(prompts, toks):
            got[rid].append(t)
        logits = runner.step([(rid, [t]) for rid, t in zip(prompts, toks)])
    assert got == expected


def test_bf16_decoder_runs_close(pair):
    hf, model, _ = pair
    decoder = model.build_component("llm", torch.device("cpu"), torch.bfloat16)
    runner = PagedRunner(decoder, model.kv_spec("llm"), seed=5, dtype=torch.bfloat16)
    seq = [3, 1, 4, 1, 5, 9, 2, 6]
    logits = runner.step([("a", seq)])
    ref = hf_last_logits(hf, seq)
    assert logits.dtype == torch.bfloat16
    logits = logits.float()
    assert math.isclose(float(torch.nn.functional.cosine_similarity(logits[0], ref, dim=0)), 1.0, abs_tol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_reference(pair):
    hf, model, _ = pair
    decoder = model.build_component("llm", torch.device("cuda"), torch.float32)
    runner = PagedRunner(decoder, model.kv_spec("llm"), seed=6, device="cuda")
    seqs = {"a": [5, 17, 250, 3, 99, 42, 7], "b": [1], "c": list(range(100, 130))}
    logits = runner.step(list(seqs.items()))
    for _ in range(6):
        for rid, row in zip(seqs, logits):
            torch.testing.assert_close(row, hf_last_logits(hf, seqs[rid]), atol=1e-3, rtol=0)
        toks = logits.argmax(-1).tolist()
        for rid, t in zip(seqs, toks):
            seqs[rid].append(t)
        logits = runner.step([(rid, [t]) for rid, t in zip(seqs, toks)])
