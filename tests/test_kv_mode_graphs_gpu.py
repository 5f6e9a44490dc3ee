"""CUDA graphs of a KV mode with a signature (a talker's frame step): per-row
inputs besides the query (a hidden state, a token id), 3-axis positions and
draws inside the step, replayed for rows that do not fill their bucket,
against the same step run eagerly over the same cache. The draws read
their parameters from static buffers and draw what the eager ones draw, on
each sampler path. Needs CUDA and flashinfer (scripts/gpu_check.sh omni)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("KV mode graphs need a CUDA device", allow_module_level=True)
pytest.importorskip("flashinfer", reason="flashinfer is not installed")

from mstar.engine.execution.draws import Draws  # noqa: E402
from mstar.engine.execution.graphs.kv_mode_graphs import KVModeGraphs  # noqa: E402
from mstar.engine.execution.sampler import SamplingTensors  # noqa: E402
from mstar.engine.memory.flashinfer_attention import FlashInferAttention  # noqa: E402
from mstar.engine.memory.kv_cache import KVCache  # noqa: E402
from mstar.models.base import KVSpec, RowShape  # noqa: E402
from mstar.types import SamplingParams, TokenBatch  # noqa: E402

from test_decode_graphs_gpu import D, HKV, HQ, PAGE, PAGES, VOCAB, Step  # noqa: E402

DRAWS = 3


class Frame(Step):
    """The decode graphs' toy step, taking ids, `last` [H] and `text` in and
    giving logits, `last` and the frame's drawn codes out. The draws' logits
    are lookups (exact in any batch), so the codes must match exactly; the
    attention's outputs to bf16 rounding."""

    def __init__(self) -> None:
        super().__init__()
        self.codes = torch.nn.Embedding(VOCAB * DRAWS, VOCAB)

    def forward(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        assert batch.draw is not None
        ids, text = batch.input_ids, batch.extra["text"].reshape(-1)
        pos = batch.positions.reshape(3, -1)
        x = self.embed(ids) + self.embed(text) + batch.extra["last"].reshape(ids.shape[0], -1).to(self.q.weight)
        x = x + sum(self.where(pos[a] % 256 + 256 * a) for a in range(3))
        t = x.shape[0]
        k, v = self.kv(x).view(t, 2, HKV, D).unbind(1)
        h = self.o(batch.attn.forward(0, self.q(x).view(t, HQ, D), k, v, D ** -0.5).reshape(t, -1))
        codes = [batch.draw(self.codes((ids + text) % VOCAB + VOCAB * j).float() * 4, j) for j in range(DRAWS)]
        return {"logits": self.head(h), "last": h, "frame": torch.stack(codes, dim=1)}


def _draws(params: SamplingParams, rows: int) -> Draws:
    return Draws(SamplingTensors.build([params] * rows, [3 + r for r in range(rows)], [5 * r for r in range(rows)],
                                       "cuda"), DRAWS)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=1.0, top_k=8, top_p=0.9)])
def test_a_replay_takes_per_row_inputs_positions_and_draws(params: SamplingParams) -> None:
    torch.manual_seed(0)
    step = Frame().to("cuda", torch.bfloat16)
    cache = KVCache(KVSpec(1, HKV, D), PAGES, PAGE, "cuda", torch.bfloat16)
    for t in (cache.k[0], cache.v[0]):
        t.copy_(torch.randn(t.shape).to(torch.bfloat16))
    attn = FlashInferAttention(cache, HQ, graph_batch_sizes=(2, 4), max_pages_per_row=8)
    rows = {"last": RowShape((HQ * D,), torch.float32), "text": RowShape((), torch.long)}
    graphs = KVModeGraphs("frame", step, attn, (2, 4), torch.device("cuda"), rows, axes=3, draws=DRAWS)
    graphs.capture(show_progress=False)
    ctx = torch.tensor([5, 17, 33])
    pages = [[3], [7, 8], [10, 11, 12]]
    positions = (ctx + torch.tensor([-2, 0, 4])).expand(3, -1).to("cuda")
    ids = torch.tensor([4, 9, 21], device="cuda")
    extra = {"last": torch.randn(3, HQ * D, device="cuda").to(torch.bfloat16),
             "text": torch.tensor([[1], [30], [2]], device="cuda")}
    draws = _draws(params, 3)

    def batch(attn_ctx, d: Draws = draws) -> TokenBatch:
        return TokenBatch(input_ids=ids, positions=positions, query_start=torch.arange(4),
                          logits_index=torch.arange(3, device="cuda"), attn=attn_ctx, extra=extra, draw=d)

    with torch.inference_mode():
        eager = step(batch(attn.plan(torch.arange(4), ctx, pages)))
        for _ in range(2):  # a second replay over the same buffers gives the same
            replayed = graphs.run(batch(None), ctx, pages, draws)
            assert replayed is not None and set(replayed) == {"logits", "last", "frame"}
            assert torch.equal(replayed["frame"], eager["frame"])
            for name in ("logits", "last"):
                torch.testing.assert_close(replayed[name].float(), eager[name].float(), atol=3e-2, rtol=3e-2)
        # the draws count: other counters, other codes (the greedy path has none)
        moved = Draws(SamplingTensors.build([params] * 3, [3, 4, 5], [1, 6, 11], "cuda"), DRAWS)
        again = graphs.run(batch(None, moved), ctx, pages, moved)
        assert again is not None
        assert torch.equal(again["frame"], step(batch(attn.plan(torch.arange(4), ctx, pages), moved))["frame"])
        assert torch.equal(again["frame"], eager["frame"]) == (params.temperature == 0)


def test_what_no_graph_serves_runs_eagerly() -> None:
    step = Frame().to("cuda", torch.bfloat16)
    cache = KVCache(KVSpec(1, HKV, D), PAGES, PAGE, "cuda", torch.bfloat16)
    attn = FlashInferAttention(cache, HQ, graph_batch_sizes=(2,), max_pages_per_row=8)
    rows = {"last": RowShape((HQ * D,), torch.float32), "text": RowShape((), torch.long)}
    graphs = KVModeGraphs("frame", step, attn, (2,), torch.device("cuda"), rows, axes=3, draws=DRAWS)
    graphs.capture(show_progress=False)
    three = TokenBatch(input_ids=torch.zeros(3, dtype=torch.long, device="cuda"),
                       positions=torch.zeros(3, 3, dtype=torch.long, device="cuda"), query_start=torch.arange(4),
                       logits_index=torch.arange(3, device="cuda"), attn=None,
                       extra={"last": torch.zeros(3, HQ * D, device="cuda"),
                              "text": torch.zeros(3, dtype=torch.long, device="cuda")})
    assert graphs.run(three, torch.tensor([1, 1, 1]), [[0], [1], [2]], _draws(SamplingParams(), 3)) is None
    one = TokenBatch(input_ids=three.input_ids[:1], positions=three.positions[:, :1], query_start=torch.arange(2),
                     logits_index=three.logits_index[:1], attn=None, extra={k: v[:1] for k, v in three.extra.items()})
    penalised = _draws(SamplingParams(temperature=1.0, repetition_penalty=1.2), 1)
    assert graphs.run(one, torch.tensor([1]), [[0]], penalised) is None
    assert graphs.run(one, torch.tensor([1]), [[0]], _draws(SamplingParams(), 1)) is not None
