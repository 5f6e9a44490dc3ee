"""A toy omni model: small random modules in float32, served through the
engine on the CPU, and run unbatched by a test as its reference.

- `enc.encode`: mel frames (ragged per row) -> embeddings, the toy audio
  decoder's encoder;
- `thinker` (the toy audio decoder's 2-layer decoder over the paged KV cache,
  3-axis M-RoPE positions): its prompt takes the encoder's rows at
  placeholder ids; prefill writes a token, the hidden states of every prompt
  position and the last one's; decode writes a token and its hidden state;
- the thinker's last hidden state of every step streams, one item per step
  of the talker (`Items`), into the `talker` partition: its prefill takes the
  thinker's prompt hidden states (handed over when the stream starts) as
  embeddings, its decode adds the item to the embedding of its last code;
  it samples codes under its own sampling key, with its own KV cache and
  1-axis positions;
- the talker's codes stream with left context (`LeftContext`) into
  `codec.chunk`, a convolution that returns the samples of the chunk's new
  codes (the `@chunk` index says how many codes of context came first).

More audio may come while a request runs (`more_input`): each piece is a
thinker turn (encoder, prefill on the cache it has, positions going on from
its last token), and the talker starts again at the turn's first item
(`on_turn="restart"`), on its cache, with the turn's prompt hidden states.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mstar.graph import (Component, Emit, In, Items, Kind, LeftContext, Loop, MaxTokens, Mode, Out, Partition, Step,
                         Stream, StreamDone, Walk)
from mstar.models.base import KVSpec, Model
from mstar.models.prepared import PreparedPiece
from mstar.types import GenerateRequest, SamplingParams, TokenBatch
from toys.audio_decoder import (ENCODE, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, MAX_LEN, PLACEHOLDER, Decoder,
                                Encoder, Layer, mrope_positions)

CODES = 24         # the talker's vocabulary
SAMPLES = 4        # samples per code
CHUNK, LEFT = 4, 2  # the codec's chunks: 4 new codes after up to 2 of context

THINK_PREFILL = Mode("prefill", (In("ids", Kind.IDS), In("audio", Kind.EMBEDS, at=PLACEHOLDER, optional=True),
                                 In("pos", Kind.POSITIONS, axes=3)),
                     (Out("token", Kind.TOKEN), Out("hidden", Kind.HIDDEN, rows="all"), Out("last", Kind.HIDDEN)),
                     kv="append", query="ids")
THINK_DECODE = Mode("decode", (In("ids", Kind.IDS),), (Out("token", Kind.TOKEN), Out("hidden", Kind.HIDDEN)),
                    kv="append", query="ids", graph=True)
TALK_PREFILL = Mode("prefill", (In("ctx", Kind.EMBEDS),), (Out("code", Kind.TOKEN),), kv="append", query="ctx")
TALK_DECODE = Mode("decode", (In("ids", Kind.IDS), In("h", Kind.TENSOR)), (Out("code", Kind.TOKEN),),
                   kv="append", query="ids")
CODEC_CHUNK = Mode("chunk", (In("codes", Kind.TENSOR), In("index", Kind.INDEX)), (Out("pcm", Kind.TENSOR),))


class Thinker(Decoder):
    def prefill(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        h = self._hidden(batch)
        last = h[batch.logits_index]
        return {"logits": self.head(last), "hidden": h, "last": last}


class Talker(nn.Module):
    """A 2-layer decoder over codes, rotary on one position axis."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(CODES, HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, CODES, bias=False)
        inv_freq = 1.0 / (10_000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _run(self, x: torch.Tensor, batch: TokenBatch) -> dict[str, torch.Tensor]:
        angles = batch.positions.reshape(-1).float()[:, None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        for i, layer in enumerate(self.layers):
            x = layer(x, i, batch.attn, cos, sin)
        return {"logits": self.head(self.norm(x)[batch.logits_index])}

    def prefill(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        rows, index = batch.embeds["ctx"]
        x = torch.zeros(batch.input_ids.shape[0], HIDDEN, dtype=rows.dtype, device=rows.device)
        return self._run(x.index_copy(0, index, self.proj(rows)), batch)

    def decode(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        h = batch.extra["h"]  # [B, 1, HIDDEN]: one thinker item per row
        return self._run(self.embed(batch.input_ids) + h.reshape(-1, HIDDEN), batch)


class Codec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(CODES, 8)
        self.conv = nn.Conv1d(8, SAMPLES, kernel_size=3, padding=1)

    def chunk(self, codes: torch.Tensor, index: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """codes [B, L] -> per row, the samples of its new codes (after the
        codes of left context chunk `index` starts with)."""
        out = self.conv(self.embed(codes).transpose(1, 2)).transpose(1, 2)  # [B, L, SAMPLES]
        return {"pcm": [torch.tanh(o[min(LEFT, int(i) * CHUNK):].reshape(-1)) for o, i in zip(out, index)]}


class ToyOmniModel(Model):
    components = {
        "enc": Component(modes=(ENCODE,)),
        "thinker": Component(modes=(THINK_PREFILL, THINK_DECODE), kv_cache=True, samples=True),
        "talker": Component(modes=(TALK_PREFILL, TALK_DECODE), kv_cache=True, samples=True),
        "codec": Component(modes=(CODEC_CHUNK,)),
    }
    walks = {
        "chat": Walk(
            Step("enc", "encode", {"mel": "mel"}, {"emb": "audio_emb"}),
            Step("thinker", "prefill", {"ids": "prompt_ids", "audio": "audio_emb", "pos": "mrope"},
                 {"token": "text", "hidden": "prompt_hidden", "last": "h"}),
            Loop(Step("thinker", "decode", {"ids": "text"}, {"token": "text", "hidden": "h"}), until=MaxTokens()),
            Emit("text"),
            Stream("h", chunks=Items(), as_="item", on_turn="restart", into=Partition(
                "talker",
                Step("talker", "prefill", {"ctx": "prompt_hidden"}, {"code": "code"}),
                Loop(Step("talker", "decode", {"ids": "code", "h": "item"}, {"code": "code"}),
                     until=StreamDone() | MaxTokens()),
                Emit("code", modality="data"),
                Stream("code", Step("codec", "chunk", {"codes": "code", "index": "@chunk"}, {"pcm": "pcm"}),
                       LeftContext(CHUNK, LEFT)),
                Emit("pcm", modality="data"))),
            inputs=("prompt_ids", "mel", "mrope"), more_input=("prompt_ids", "mel", "mrope")),
    }
    default_walk = "chat"

    def __init__(self, name: str = "toy-omni", seed: int = 0) -> None:
        super().__init__(name)
        torch.manual_seed(seed)
        self.encoder = Encoder().eval()
        self.thinker = Thinker().eval()
        self.talker = Talker().eval()
        self.codec = Codec().eval()

    @property
    def max_model_len(self) -> int:
        return MAX_LEN

    def kv_spec(self, component: str) -> KVSpec:
        return KVSpec(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, num_q_heads=HEADS)

    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
        module = {"enc": self.encoder, "thinker": self.thinker, "talker": self.talker, "codec": self.codec}[component]
        return module.to(device, dtype)

    def prepare_inputs(self, request: GenerateRequest, sampling: SamplingParams) -> PreparedPiece:
        ids = list(request.inputs["prompt_ids"])
        return PreparedPiece({"prompt_ids": torch.tensor(ids, dtype=torch.long), "mel": request.inputs["mel"].float(),
                              "mrope": mrope_positions(ids)}, len(ids))

    def prepare_more(self, request: GenerateRequest, inputs: dict[str, Any]) -> PreparedPiece:
        ids = list(inputs["prompt_ids"])
        return PreparedPiece({"prompt_ids": torch.tensor(ids, dtype=torch.long), "mel": inputs["mel"].float()},
                             len(ids))

    def join_turn(self, last_token: int, piece: dict[str, torch.Tensor], start: int) -> PreparedPiece:
        ids = [last_token, *piece["prompt_ids"].tolist()]
        return PreparedPiece({"prompt_ids": torch.tensor(ids, dtype=torch.long), "mel": piece["mel"],
                              "mrope": mrope_positions(ids) + start}, len(ids))
