"""Decode CUDA graphs of a mode with more than logits: a step that also
returns its last token's hidden state and takes 3-axis positions (an M-RoPE
thinker's decode), replayed for rows whose positions run ahead of their
cached length, against the same step run eagerly over the same cache.
Needs CUDA and flashinfer (the GPU machine: scripts/gpu_check.sh tests)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("decode graphs need a CUDA device", allow_module_level=True)
pytest.importorskip("flashinfer", reason="flashinfer is not installed")

from mstar.engine.execution.graphs.cuda_graphs import DecodeGraphs  # noqa: E402
from mstar.engine.memory.flashinfer_attention import FlashInferAttention  # noqa: E402
from mstar.engine.memory.kv_cache import KVCache  # noqa: E402
from mstar.models.base import KVSpec  # noqa: E402
from mstar.types import TokenBatch  # noqa: E402

HQ, HKV, D, PAGE, PAGES, VOCAB = 4, 2, 64, 16, 64, 50


class Step(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HQ * D)
        self.where = torch.nn.Embedding(3 * 256, HQ * D)
        self.q, self.o = torch.nn.Linear(HQ * D, HQ * D), torch.nn.Linear(HQ * D, HQ * D)
        self.kv = torch.nn.Linear(HQ * D, 2 * HKV * D)
        self.head = torch.nn.Linear(HQ * D, VOCAB)

    def forward(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        pos = batch.positions.reshape(3, -1)
        x = self.embed(batch.input_ids) + sum(self.where(pos[a] % 256 + 256 * a) for a in range(3))
        t = x.shape[0]
        k, v = self.kv(x).view(t, 2, HKV, D).unbind(1)
        h = self.o(batch.attn.forward(0, self.q(x).view(t, HQ, D), k, v, D ** -0.5).reshape(t, -1))
        h = h[batch.logits_index]
        return {"logits": self.head(h), "hidden": h}


def test_a_replay_keeps_hidden_states_and_places_rows_by_their_positions() -> None:
    torch.manual_seed(0)
    step = Step().to("cuda", torch.bfloat16)
    cache = KVCache(KVSpec(1, HKV, D), PAGES, PAGE, "cuda", torch.bfloat16)
    for t in (cache.k[0], cache.v[0]):
        t.copy_(torch.randn(t.shape).to(torch.bfloat16))
    attn = FlashInferAttention(cache, HQ, graph_batch_sizes=(4,), max_pages_per_row=8)
    graphs = DecodeGraphs(step, attn, (4,), torch.device("cuda"), outputs=("logits", "hidden"), axes=3)
    graphs.capture(show_progress=False)
    ctx = torch.tensor([5, 17, 33])
    tables = torch.tensor([[3, 0, 0], [7, 8, 0], [10, 11, 12]])
    positions = (ctx + torch.tensor([-2, 0, 4])).expand(3, -1)  # rope deltas: ahead of and behind the cache
    tokens = torch.tensor([4, 9, 21], device="cuda")
    with torch.inference_mode():
        eager = step(TokenBatch(input_ids=tokens, positions=positions.to("cuda"), query_start=torch.arange(4),
                                logits_index=torch.arange(3, device="cuda"),
                                attn=attn.plan(torch.arange(4), ctx, [[3], [7, 8], [10, 11, 12]])))
        replayed = graphs.run(tokens, ctx, tables, positions)
    assert replayed is not None and set(replayed) == {"logits", "hidden"}
    for name in ("logits", "hidden"):
        torch.testing.assert_close(replayed[name].float(), eager[name].float(), atol=3e-2, rtol=3e-2)
    with torch.inference_mode():  # without positions, every row sits at its cached length
        plain = graphs.run(tokens, ctx, tables)
    assert plain is not None and not torch.allclose(plain["hidden"].float(), eager["hidden"].float(), atol=3e-2)
