"""A toy audio-in, text-out model whose modes declare signatures: an encoder
(mel frames, ragged per row, in; embeddings out) and a 2-layer decoder over
the paged KV cache whose prompt takes the encoder's rows at its placeholder
ids, with 3-axis rotary positions (M-RoPE-like sections) that the decoder
applies itself. Prefill writes a token and the hidden states of every prompt
position; decode writes a token and the last position's hidden state.

Small random modules in float32; `ToyAudioModel` serves them through the
engine, and a test runs the same modules unbatched as its reference."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.graph import Component, Emit, In, Kind, Loop, MaxTokens, Mode, Out, Step, Walk
from mstar.models.base import KVSpec, Model
from mstar.models.prepared import PreparedPiece
from mstar.types import GenerateRequest, SamplingParams, TokenBatch

PLACEHOLDER = 3        # where the audio's rows go in a prompt
VOCAB = 48
HIDDEN = 32
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
LAYERS = 2
MEL = 10
SECTIONS = (2, 1, 1)   # frequency pairs driven by each position axis (temporal, height, width)
MAX_LEN = 128

ENCODE = Mode("encode", (In("mel", Kind.TENSOR, ragged=True),), (Out("emb", Kind.EMBEDS),))
PREFILL = Mode("prefill", (In("ids", Kind.IDS), In("audio", Kind.EMBEDS, at=PLACEHOLDER, optional=True),
                           In("pos", Kind.POSITIONS, axes=3)),
               (Out("token", Kind.TOKEN), Out("hidden", Kind.HIDDEN, rows="all")), kv="append", query="ids")
DECODE = Mode("decode", (In("ids", Kind.IDS),), (Out("token", Kind.TOKEN), Out("hidden", Kind.HIDDEN)),
              kv="append", query="ids", graph=True)


def mrope_positions(ids: list[int]) -> torch.Tensor:
    """[3, n] positions of a prompt: a text token sits at (t, t, t); a block of
    placeholders is laid out two by two (time advances every other row), so
    the prompt's last position is less than its length (a rope delta < 0)."""
    cols: list[tuple[int, int, int]] = []
    t = i = 0
    while i < len(ids):
        if ids[i] != PLACEHOLDER:
            cols.append((t, t, t))
            t, i = t + 1, i + 1
            continue
        j = i
        while j < len(ids) and ids[j] == PLACEHOLDER:
            k = j - i
            cols.append((t + k // 2, t + k % 2, t))
            j += 1
        t = max(c for col in cols for c in col) + 1
        i = j
    return torch.tensor(cols, dtype=torch.long).T.contiguous()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + turned * sin[:, None, :]


class Encoder(nn.Module):
    """encode: mel [n_i, MEL] per row (a list) -> emb [n_i, HIDDEN] per row."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(MEL, HIDDEN)
        self.gate: threading.Event | None = None  # the next call waits for it (a test holds the worker)

    def encode(self, mel: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.wait(timeout=30)
        return {"emb": [torch.tanh(self.proj(m)) for m in mel]}


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.q = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.k = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.v = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, index: int, attn: Any, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        h = self.norm1(x)
        q = rotate(self.q(h).view(t, HEADS, HEAD_DIM), cos, sin)
        k = rotate(self.k(h).view(t, KV_HEADS, HEAD_DIM), cos, sin)
        v = self.v(h).view(t, KV_HEADS, HEAD_DIM)
        x = x + self.o(attn.forward(index, q, k, v, HEAD_DIM ** -0.5).reshape(t, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    """prefill / decode over a `TokenBatch` with [3, T] positions."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        inv_freq = 1.0 / (10_000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # the position axis that drives each frequency pair
        self.register_buffer("axis", torch.repeat_interleave(torch.arange(3), torch.tensor(SECTIONS)),
                             persistent=False)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[self.axis].T * self.inv_freq  # [T, HEAD_DIM // 2]
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos(), angles.sin()

    def _hidden(self, batch: TokenBatch) -> torch.Tensor:
        x = self.embed(batch.input_ids)
        for rows, index in batch.embeds.values():
            x = x.index_copy(0, index, rows.to(x.dtype))
        cos, sin = self._rotary(batch.positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, i, batch.attn, cos, sin)
        return self.norm(x)

    def prefill(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        h = self._hidden(batch)
        return {"logits": self.head(h[batch.logits_index]), "hidden": h}

    def decode(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        h = self._hidden(batch)[batch.logits_index]
        return {"logits": self.head(h), "hidden": h}


class ToyModel(Model):
    """What every toy's model file shares: its context, and the KV shape of
    its decoders (`kv_layers` of them a row)."""

    kv_layers = LAYERS
    context = MAX_LEN  # a test may shorten it on an instance (a small page pool must hold one request)

    @property
    def max_model_len(self) -> int:
        return self.context

    def kv_spec(self, component: str) -> KVSpec:
        return KVSpec(num_layers=self.kv_layers, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, num_q_heads=HEADS)


class ToyAudioModel(ToyModel):
    components = {
        "enc": Component(modes=(ENCODE,)),
        "dec": Component(modes=(PREFILL, DECODE), kv_cache=True, samples=True),
    }
    walks = {
        # tokens, the prompt's hidden states and each decode step's
        "listen": Walk(
            Step("enc", "encode", {"mel": "mel"}, {"emb": "audio_emb"}),
            Step("dec", "prefill", {"ids": "prompt_ids", "audio": "audio_emb", "pos": "mrope"},
                 {"token": "text", "hidden": "prompt_hidden"}),
            Loop(Step("dec", "decode", {"ids": "text"}, {"token": "text", "hidden": "hidden"}), until=MaxTokens()),
            Emit("text"), Emit("prompt_hidden", modality="data"), Emit("hidden", modality="data"),
            inputs=("prompt_ids", "mel", "mrope")),
        # tokens alone: a decode loop a group would take, were it not for its signature and rope delta
        "transcribe": Walk(
            Step("enc", "encode", {"mel": "mel"}, {"emb": "audio_emb"}),
            Step("dec", "prefill", {"ids": "prompt_ids", "audio": "audio_emb", "pos": "mrope"}, {"token": "text"}),
            Loop(Step("dec", "decode", {"ids": "text"}, {"token": "text"}), until=MaxTokens()),
            Emit("text"),
            inputs=("prompt_ids", "mel", "mrope")),
    }
    default_walk = "listen"

    def __init__(self, name: str = "toy-audio", seed: int = 0) -> None:
        super().__init__(name)
        torch.manual_seed(seed)
        self.encoder = Encoder().eval()
        self.decoder = Decoder().eval()

    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
        module = {"enc": self.encoder, "dec": self.decoder}[component]
        return module.to(device, dtype)

    def prepare_inputs(self, request: GenerateRequest, sampling: SamplingParams) -> PreparedPiece:
        ids = list(request.inputs["prompt_ids"])
        return PreparedPiece({"prompt_ids": torch.tensor(ids, dtype=torch.long), "mel": request.inputs["mel"].float(),
                              "mrope": mrope_positions(ids)}, len(ids))
