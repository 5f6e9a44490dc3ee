"""What a step that mixes decode rows with a new row's prompt tokens costs on
the GPU, eager and as a CUDA graph (the GPU machine).

Builds the Llama component the engine builds (`--model`, dummy weights),
fills a paged KV cache, and times, with the device synchronised after each
step: an eager prefill of one row (k new tokens after a cached prefix), an
eager decode of `--rows` rows, the graph decode of those rows, and a mixed
step (the rows plus the new row's k tokens) eager and replayed as a CUDA
graph over FlashInfer's paged-prefill kernels in graph mode, at a padded
token count. The graph's logits are checked against the eager step's.

    python scripts/probe_mixed.py --rows 64 --new 8 32 128
"""

from __future__ import annotations

import argparse
import time

import flashinfer
import torch

from mstar.config import EngineConfig
from mstar.engine.execution.backends import attention_backend
from mstar.engine.execution.graphs.cuda_graphs import DecodeGraphs
from mstar.engine.memory.flashinfer_attention import PREFILL_BACKEND, FlashInferContext
from mstar.engine.memory.kv_cache import KVCache
from mstar.engine.memory.paged_layout import build_layout
from mstar.models.registry import load_model
from mstar.types import TokenBatch


def timed(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="orpheus-3b")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--cached", type=int, default=128, help="the new row's cached prefix")
    p.add_argument("--new", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    dev = torch.device("cuda:0")
    print(f"# {torch.cuda.get_device_name(0)} | torch {torch.__version__} | flashinfer {flashinfer.__version__}"
          f" | model {a.model} | rows {a.rows} context {a.context} | new row: {a.cached} cached")
    model = load_model(a.model, "dummy")
    module = model.build_component("llm", dev, torch.bfloat16)
    spec = model.kv_spec("llm")
    page = 16
    per_row = -(-(max(a.context, a.cached + max(a.new)) + 16) // page)
    n = a.rows
    cache = KVCache(spec, (n + 1) * per_row, page, dev, torch.bfloat16)
    attn = attention_backend(cache, spec.num_q_heads, per_row, EngineConfig(cuda_graph_batch_sizes=(n,)))
    tables = torch.arange((n + 1) * per_row).reshape(n + 1, per_row)
    vocab = model.config.vocab_size
    ctx = torch.full((n,), a.context, dtype=torch.long)
    dec_ids = torch.randint(0, vocab, (n,), device=dev)
    results: dict[str, float] = {}

    def eager(ids: torch.Tensor, positions: torch.Tensor, qs: torch.Tensor, c: torch.Tensor,
              bt: torch.Tensor) -> torch.Tensor:
        last = (qs[1:] - 1).to(dev)
        b = TokenBatch(input_ids=ids, positions=positions.to(dev), query_start=qs, logits_index=last,
                       attn=attn.plan(qs, c, bt))
        return module.forward(b)["logits"]

    qs_dec = torch.arange(n + 1)
    results["eager decode"] = timed(lambda: eager(dec_ids, ctx, qs_dec, ctx, tables[:n]), a.steps)
    graphs = DecodeGraphs(module.decode, attn, (n,), dev)
    graphs.capture(show_progress=False)
    results["graph decode"] = timed(lambda: graphs.run(dec_ids, ctx, tables[:n]), a.steps)

    # the graph-mode paged-prefill wrapper of one (rows + 2, tokens) bucket: the decode rows, the new
    # row, and a padding row on the scratch page that takes the tokens the bucket has to spare
    top = max(a.new)
    tokens_b = n + top + 16
    rows_b = n + 2
    ws = attn.workspace
    qo_buf = torch.zeros(rows_b + 1, dtype=torch.int32, device=dev)
    kv_indptr_buf = torch.zeros(rows_b + 1, dtype=torch.int32, device=dev)
    kv_indices_buf = torch.zeros(rows_b * per_row + 64, dtype=torch.int32, device=dev)
    last_buf = torch.zeros(rows_b, dtype=torch.int32, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, qo_indptr_buf=qo_buf, paged_kv_indptr_buf=kv_indptr_buf,
        paged_kv_indices_buf=kv_indices_buf, paged_kv_last_page_len_buf=last_buf, backend=PREFILL_BACKEND)
    slots = torch.zeros(tokens_b, dtype=torch.long, device=dev)
    s_ids = torch.zeros(tokens_b, dtype=torch.long, device=dev)
    s_pos = torch.zeros(tokens_b, dtype=torch.long, device=dev)
    s_rows = torch.zeros(n + 1, dtype=torch.long, device=dev)
    context = FlashInferContext(cache, wrapper, slots, tokens_b)
    dims = (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, page)
    scratch = cache.scratch_page

    def mixed_layout(k: int):
        pad = tokens_b - n - k
        qs = torch.tensor([*range(n + 1), n + k, tokens_b])
        c = torch.cat([ctx, torch.tensor([a.cached, 0])])
        bt = torch.full((rows_b, max(per_row, -(-pad // page))), scratch, dtype=torch.long)
        bt[:n + 1, :per_row] = tables[:n + 1]
        positions = torch.cat([ctx, torch.arange(a.cached, a.cached + k), torch.zeros(pad, dtype=torch.long)])
        return qs, c, bt, positions

    def plan_graph(k: int) -> None:
        qs, c, bt, positions = mixed_layout(k)
        lay = build_layout(qs, c, bt, page, scratch)
        slots.copy_(lay.slot_mapping.to(dev))
        s_pos.copy_(positions.to(dev))
        s_rows.copy_(torch.cat([torch.arange(n), torch.tensor([n + k - 1])]).to(dev))
        idx = lay.kv_indices.to(dev)
        wrapper.plan(lay.qo_indptr, lay.kv_indptr, idx, lay.kv_last_page_len, *dims, causal=True,
                     q_data_type=cache.dtype, kv_data_type=cache.dtype)

    def graph_batch() -> TokenBatch:
        return TokenBatch(input_ids=s_ids, positions=s_pos, query_start=torch.zeros(1), logits_index=s_rows,
                          attn=context)

    plan_graph(top)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        for _ in range(2):
            module.forward(graph_batch())
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        out = module.forward(graph_batch())["logits"]
    torch.cuda.synchronize()

    for k in a.new:
        new_ids = torch.randint(0, vocab, (k,), device=dev)
        qs1 = torch.tensor([0, k])
        c1 = torch.tensor([a.cached])
        results[f"eager prefill, {k} new"] = timed(
            lambda: eager(new_ids, torch.arange(a.cached, a.cached + k), qs1, c1, tables[n:]), a.steps)
        ids = torch.cat([dec_ids, new_ids])
        qs, c, bt, positions = mixed_layout(k)
        results[f"eager mixed, {k} new"] = timed(
            lambda: eager(ids, positions[:n + k], qs[:n + 2], c[:n + 1], tables[:n + 1]), a.steps)
        ref = eager(ids, positions[:n + k], qs[:n + 2], c[:n + 1], tables[:n + 1]).float()

        def replay() -> None:
            s_ids[:n + k].copy_(ids)
            plan_graph(k)
            g.replay()
        results[f"graph mixed, {k} new (bucket {tokens_b} tokens)"] = timed(replay, a.steps)
        replay()
        torch.cuda.synchronize()
        diff = (out.float() - ref).abs().max().item()
        same = (out.float().argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"graph vs eager mixed, {k} new: max |logit diff| {diff:.4f}, argmax agree {same:.3f}")
    for name, ms in results.items():
        print(f"{name:48s} {ms:8.3f} ms")


if __name__ == "__main__":
    main()
