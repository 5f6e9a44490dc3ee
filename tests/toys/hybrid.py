"""A toy hybrid LLM, small random modules in float32: one attention layer
over the paged KV cache, then a gated linear recurrence behind a short causal
convolution whose states (conv [HIDDEN, CONV - 1], recurrent [RH, RD, RD])
each row keeps in a slot of per-row state (`Component(state=True)`), read
and updated in place token by token: Qwen3.5's layer mix in miniature.
Served through the engine as a plain text generator, and run unbatched by a
test as its reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.graph import Component, Emit, Loop, MaxTokens, Step, Walk
from mstar.models.base import StateSpec
from mstar.models.prepared import PreparedPiece
from mstar.types import GenerateRequest, SamplingParams, TokenBatch
from toys.audio_decoder import HEAD_DIM, HIDDEN, VOCAB, Layer, ToyModel

CONV = 3           # the convolution's width: its state holds the last CONV - 1 inputs
RH, RD = 4, 8      # recurrent heads, and the size of each


class Hybrid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.attention = Layer()
        self.conv = nn.Parameter(torch.randn(HIDDEN, CONV) / CONV)
        self.qkv = nn.Linear(HIDDEN, 3 * RH * RD)
        self.gate = nn.Linear(HIDDEN, RH)
        self.out = nn.Linear(RH * RD, HIDDEN)
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        inv_freq = 1.0 / (10_000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        with torch.no_grad():  # random init is close to uniform: let the recurrence decide the tokens
            self.out.weight.mul_(8)
            self.head.weight.mul_(4)

    def _recur(self, x: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
        """Token by token within each row, from and back into the row's slot."""
        assert batch.state is not None
        conv, rec = batch.state.tensors["conv"], batch.state.tensors["rec"]
        qs = batch.query_start.tolist()
        out = torch.empty(x.shape[0], RH * RD, dtype=x.dtype, device=x.device)
        for r, slot in enumerate(batch.state.slots.tolist()):
            c_state, s = conv[slot], rec[slot]
            for t in range(qs[r], qs[r + 1]):
                window = torch.cat([c_state, x[t][:, None]], dim=1)  # [HIDDEN, CONV]
                c = F.silu((window * self.conv).sum(-1))
                c_state = window[:, 1:]
                q, k, v = self.qkv(c).view(3, RH, RD)
                g = torch.sigmoid(self.gate(c))
                s = g[:, None, None] * s + k[:, :, None] * v[:, None, :]
                out[t] = (q[:, :, None] * s).sum(1).reshape(-1)
            conv[slot], rec[slot] = c_state, s
        return self.out(out)

    def _logits(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        angles = batch.positions.reshape(-1).float()[:, None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        x = self.attention(self.embed(batch.input_ids), 0, batch.attn, angles.cos(), angles.sin())
        x = x + self._recur(self.norm1(x), batch)
        return {"logits": self.head(self.norm2(x)[batch.logits_index])}

    def prefill(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        return self._logits(batch)

    def decode(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        return self._logits(batch)


class ToyHybridModel(ToyModel):
    kv_layers = 1  # the attention layer; the recurrence keeps no KV
    components = {"llm": Component(modes=("prefill", "decode"), kv_cache=True, samples=True, state=True)}
    walks = {"generate": Walk(
        Step("llm", "prefill", "prompt_ids", "token"),
        Loop(Step("llm", "decode", "token", "token"), until=MaxTokens()),
        Emit("token"),
        inputs=("prompt_ids",))}
    default_walk = "generate"

    def __init__(self, name: str = "toy-hybrid", seed: int = 0) -> None:
        super().__init__(name)
        torch.manual_seed(seed)
        self.module = Hybrid().eval()

    def state_spec(self, component: str) -> StateSpec:
        return StateSpec((("conv", (HIDDEN, CONV - 1), torch.float32), ("rec", (RH, RD, RD), torch.float32)))

    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return self.module.to(device, dtype)

    def prepare_inputs(self, request: GenerateRequest, sampling: SamplingParams) -> PreparedPiece:
        ids = list(request.inputs["prompt_ids"])
        return PreparedPiece({"prompt_ids": torch.tensor(ids, dtype=torch.long)}, len(ids))
