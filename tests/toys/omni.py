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

Walk `chat_frames` speaks in frames of `GROUPS` codes, as Qwen3-Omni's
talker does: each talker step samples a frame's first code and its last
hidden state, then a code predictor (`cp`, a KV component of the talker's
partition with its own sampling key) restarts its cache (`reset`) and
samples the frame's other codes one by one in a nested loop (`@i` picks its
embedding and head); the loop collects the frame, the talker's next step
reads it, and frames stream with left context into the codec.

Walk `chat_fused` is `chat_frames` with the code predictor run inside the
talker's step (`speak`, a mode with `draws`): one talker step a frame, the
predictor's codes drawn by `TokenBatch.draw` under the "cp" key, so that its
frames are the nested loop's, as Qwen3-Omni's talker would run at speed.

More audio may come while a request runs (`more_input`): each piece is a
thinker turn (encoder, prefill on the cache it has, positions going on from
its last token), and the talker starts again at the turn's first item
(`on_turn="restart"`), on its cache, with the turn's prompt hidden states.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.graph import (Collect, Component, Emit, In, Items, Kind, LeftContext, Loop, MaxSteps, MaxTokens, Mode, Out,
                         Partition, Step, Stream, StreamDone, Walk)
from mstar.models.prepared import PreparedPiece
from mstar.types import GenerateRequest, SamplingParams, TokenBatch
from toys.audio_decoder import (ENCODE, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, PLACEHOLDER, Decoder, Encoder,
                                Layer, ToyModel, mrope_positions)

CODES = 24         # the talker's vocabulary
SAMPLES = 4        # samples per code
CHUNK, LEFT = 4, 2  # the codec's chunks: 4 new codes after up to 2 of context
GROUPS = 3         # codes per frame (`chat_frames`): the talker's, then the code predictor's

THINK_PREFILL = Mode("prefill", (In("ids", Kind.IDS), In("audio", Kind.EMBEDS, at=PLACEHOLDER, optional=True),
                                 In("pos", Kind.POSITIONS, axes=3)),
                     (Out("token", Kind.TOKEN), Out("hidden", Kind.HIDDEN, rows="all"), Out("last", Kind.HIDDEN)),
                     kv="append", query="ids")
THINK_DECODE = Mode("decode", (In("ids", Kind.IDS),), (Out("token", Kind.TOKEN), Out("hidden", Kind.HIDDEN)),
                    kv="append", query="ids", graph=True)
TALK_PREFILL = Mode("prefill", (In("ctx", Kind.EMBEDS),), (Out("code", Kind.TOKEN), Out("last", Kind.HIDDEN)),
                    kv="append", query="ctx")
TALK_DECODE = Mode("decode", (In("ids", Kind.IDS), In("h", Kind.TENSOR)), (Out("code", Kind.TOKEN),),
                   kv="append", query="ids")
TALK_FRAME = Mode("frame", (In("ids", Kind.IDS), In("frame", Kind.TENSOR), In("h", Kind.TENSOR)),
                  (Out("code", Kind.TOKEN), Out("last", Kind.HIDDEN)), kv="append", query="ids")
# chat_fused: the code predictor's frame inside one talker step (its draws under the step's `draws` key)
TALK_SPEAK = Mode("speak", (In("ids", Kind.IDS), In("last", Kind.TENSOR), In("h", Kind.TENSOR)),
                  (Out("code", Kind.TOKEN), Out("last", Kind.HIDDEN), Out("frame", Kind.TENSOR)),
                  kv="append", query="ids", draws=GROUPS - 1)
CP_PREFILL = Mode("prefill", (In("ids", Kind.IDS), In("h", Kind.TENSOR)), (Out("code", Kind.TOKEN),),
                  kv="append", query="ids", reset=True)
CP_DECODE = Mode("decode", (In("ids", Kind.IDS), In("j", Kind.INDEX)), (Out("code", Kind.TOKEN),),
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
        self.groups = nn.ModuleList(nn.Embedding(CODES, HIDDEN) for _ in range(GROUPS))  # a frame's codes

    def _run(self, x: torch.Tensor, batch: TokenBatch) -> dict[str, torch.Tensor]:
        last = _layers(self.layers, self.inv_freq, x, batch)[batch.logits_index]
        return {"logits": self.head(self.norm(last)), "last": last}

    def prefill(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        rows, index = batch.embeds["ctx"]
        x = torch.zeros(batch.input_ids.shape[0], HIDDEN, dtype=rows.dtype, device=rows.device)
        return self._run(x.index_copy(0, index, self.proj(rows)), batch)

    def decode(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        h = batch.extra["h"]  # [B, 1, HIDDEN]: one thinker item per row
        return self._run(self.embed(batch.input_ids) + h.reshape(-1, HIDDEN), batch)

    def frame(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        """The last frame's codes [B, GROUPS] summed as embeddings, plus a thinker item."""
        codes, h = batch.extra["frame"], batch.extra["h"]
        x = sum(emb(codes[:, g]) for g, emb in enumerate(self.groups))
        return self._run(x + h.reshape(-1, HIDDEN), batch)

    def speak(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        """`chat_frames`'s loop body in one step: the code predictor completes
        the frame of each row's first code (`ids`) over a dense cache of the
        frame's own, drawing its codes with `batch.draw`; then the talker
        reads the frame and a thinker item, as `frame` does."""
        assert batch.draw is not None
        code, rows = batch.input_ids, batch.input_ids.shape[0]
        every = torch.arange(rows + 1, device=code.device)
        attn, codes = FrameAttention(), [code]
        for j in range(GROUPS - 1):
            step = TokenBatch(input_ids=code, positions=torch.full_like(code, j), query_start=every.cpu(),
                              logits_index=every[:-1], attn=attn,
                              extra={"h": batch.extra["last"]} if j == 0 else {"j": torch.full_like(code, j - 1)})
            code = batch.draw((self.cp.prefill if j == 0 else self.cp.decode)(step)["logits"], j)
            codes.append(code)
        frame = torch.stack(codes, dim=1)
        return {**self.frame(dataclasses.replace(batch, extra={**batch.extra, "frame": frame})), "frame": frame}


class FrameAttention:
    """The rows' attention over a dense cache of one frame's tokens, one token
    per row a call (a code predictor's cache lives only as long as its frame)."""

    def __init__(self) -> None:
        self.k: dict[int, list[torch.Tensor]] = {}
        self.v: dict[int, list[torch.Tensor]] = {}

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        self.k.setdefault(layer, []).append(k)
        self.v.setdefault(layer, []).append(v)
        keys = torch.stack(self.k[layer], dim=1).repeat_interleave(HEADS // KV_HEADS, dim=2)  # [B, t, H, D]
        values = torch.stack(self.v[layer], dim=1).repeat_interleave(HEADS // KV_HEADS, dim=2)
        out = F.scaled_dot_product_attention(q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2), scale=scale)
        return out[:, :, 0]


def _layers(layers: nn.ModuleList, inv_freq: torch.Tensor, x: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """`layers` over the packed tokens, rotary on one position axis."""
    angles = batch.positions.reshape(-1).float()[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    for i, layer in enumerate(layers):
        x = layer(x, i, batch.attn, cos, sin)
    return x


class CodePredictor(nn.Module):
    """A frame's codes after its first: prefill reads the first code and the
    talker's last hidden state (a cache of its own, restarted every frame);
    decode step j reads code j + 1. Code g has its own embedding and head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.ModuleList(nn.Embedding(CODES, HIDDEN) for _ in range(GROUPS))
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.layers = nn.ModuleList([Layer()])
        self.norm = nn.LayerNorm(HIDDEN)
        self.heads = nn.ModuleList(nn.Linear(HIDDEN, CODES, bias=False) for _ in range(GROUPS - 1))
        inv_freq = 1.0 / (10_000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _logits(self, x: torch.Tensor, batch: TokenBatch, group: torch.Tensor) -> dict[str, torch.Tensor]:
        """`group` [B]: the code each row predicts next (1 .. GROUPS - 1)."""
        h = self.norm(_layers(self.layers, self.inv_freq, x, batch)[batch.logits_index])
        every = torch.stack([head(h) for head in self.heads])  # [GROUPS - 1, B, CODES]
        return {"logits": every[group - 1, torch.arange(h.shape[0], device=h.device)]}

    def prefill(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        x = self.embed[0](batch.input_ids) + self.proj(batch.extra["h"].reshape(-1, HIDDEN))
        return self._logits(x, batch, torch.ones(x.shape[0], dtype=torch.long, device=x.device))

    def decode(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        j = batch.extra["j"].to(batch.input_ids.device)  # [B]: the inner loop's round; the input is code j + 1
        every = torch.stack([emb(batch.input_ids) for emb in self.embed])  # [GROUPS, B, HIDDEN]
        x = every[j + 1, torch.arange(j.shape[0], device=j.device)]
        return self._logits(x, batch, j + 2)


class Codec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(CODES, 8)
        self.conv = nn.Conv1d(8, SAMPLES, kernel_size=3, padding=1)

    def chunk(self, codes: torch.Tensor, index: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """codes [B, L] (or frames [B, L, GROUPS]) -> per row, the samples of
        its new codes (after the codes of left context chunk `index` starts
        with)."""
        emb = self.embed(codes)
        if emb.dim() == 4:  # frames: their codes' embeddings summed
            emb = emb.sum(2)
        out = self.conv(emb.transpose(1, 2)).transpose(1, 2)  # [B, L, SAMPLES]
        return {"pcm": [torch.tanh(o[min(LEFT, int(i) * CHUNK):].reshape(-1)) for o, i in zip(out, index)]}


# both walks' thinker: audio encoded into its prompt, then text, each step's hidden state written as "h"
THINKER = (
    Step("enc", "encode", {"mel": "mel"}, {"emb": "audio_emb"}),
    Step("thinker", "prefill", {"ids": "prompt_ids", "audio": "audio_emb", "pos": "mrope"},
         {"token": "text", "hidden": "prompt_hidden", "last": "h"}),
    Loop(Step("thinker", "decode", {"ids": "text"}, {"token": "text", "hidden": "h"}), until=MaxTokens()),
    Emit("text"),
)

# both frame walks' talker: it starts from the thinker's prompt; its frames' first codes are emitted, and the
# frames stream into the codec
TALKER_START = Step("talker", "prefill", {"ctx": "prompt_hidden"}, {"code": "code0", "last": "last"})
FRAMES_OUT = (
    Emit("code0", modality="data"),
    Stream("frame", Step("codec", "chunk", {"codes": "frame", "index": "@chunk"}, {"pcm": "pcm"}),
           LeftContext(CHUNK, LEFT)),
    Emit("pcm", modality="data"),
)


class ToyOmniModel(ToyModel):
    components = {
        "enc": Component(modes=(ENCODE,)),
        "thinker": Component(modes=(THINK_PREFILL, THINK_DECODE), kv_cache=True, samples=True),
        "talker": Component(modes=(TALK_PREFILL, TALK_DECODE, TALK_FRAME, TALK_SPEAK), kv_cache=True, samples=True),
        "cp": Component(modes=(CP_PREFILL, CP_DECODE), kv_cache=True, samples=True),
        "codec": Component(modes=(CODEC_CHUNK,)),
    }
    walks = {
        "chat": Walk(
            *THINKER,
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
        "chat_frames": Walk(
            *THINKER,
            Stream("h", chunks=Items(), as_="item", into=Partition(
                "talker",
                TALKER_START,
                Loop((Step("cp", "prefill", {"ids": "code0", "h": "last"}, {"code": "code"}, sampling="cp"),
                      Loop(Step("cp", "decode", {"ids": "code", "j": "@i"}, {"code": "code"}, sampling="cp"),
                           until=MaxSteps(GROUPS - 1), collect=Collect("frame", each="code", first=("code0",))),
                      Step("talker", "frame", {"ids": "code0", "frame": "frame", "h": "item"},
                           {"code": "code0", "last": "last"})),
                     until=StreamDone() | MaxTokens(), value="code0"),
                *FRAMES_OUT)),
            inputs=("prompt_ids", "mel", "mrope")),
        # chat_frames with the code predictor fused into the talker's step: one talker step a frame
        "chat_fused": Walk(
            *THINKER,
            Stream("h", chunks=Items(), as_="item", into=Partition(
                "talker",
                TALKER_START,
                Loop(Step("talker", "speak", {"ids": "code0", "last": "last", "h": "item"},
                          {"code": "code0", "last": "last", "frame": "frame"}, draws="cp"),
                     until=StreamDone() | MaxTokens(), value="code0"),
                *FRAMES_OUT)),
            inputs=("prompt_ids", "mel", "mrope")),
    }
    default_walk = "chat"

    def __init__(self, name: str = "toy-omni", seed: int = 0) -> None:
        super().__init__(name)
        torch.manual_seed(seed)
        self.encoder = Encoder().eval()
        self.thinker = Thinker().eval()
        self.talker = Talker().eval()
        self.codec = Codec().eval()
        self.cp = CodePredictor().eval()
        self.talker.cp = self.cp  # run inside the talker's `speak`

    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
        module = {"enc": self.encoder, "thinker": self.thinker, "talker": self.talker, "cp": self.cp,
                  "codec": self.codec}[component]
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
