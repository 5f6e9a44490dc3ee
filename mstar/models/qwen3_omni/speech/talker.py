"""The Qwen3-Omni talker over a `TokenBatch`: codec frames out of the
thinker's text, one frame (80 ms) a step.

- `prefill`: the talker prompt's input rows (`embeds["ctx"]`, built by
  `talker_prompt`) at 3-axis positions in; the logits of frame 0's first
  code and the normed last hidden state ("last" [B, H]) out.
- `speak`: per row, the frame's first code (`input_ids`), the "last" of the
  step that drew it, and the step's text side ("text" [B, H]: a row of
  `text_rows`). The code predictor completes the frame, drawing codes
  1 .. G - 1 with `batch.draw`; the talker then reads the frame (its codes'
  embeddings summed, plus the text side) through its KV cache. Out: the
  logits of the next frame's first code, "last", and the completed
  "frame" [B, G] int64.

The decoder is the thinker's layer at the talker's size (every layer MoE
with a gated shared expert, q/k norm, interleaved M-RoPE). The text side
of every row is `text_projection` of a thinker token's embedding, so the
talker holds its own copy of the thinker's embedding table
(`thinker_embed`, filled at load from the thinker's tensor): the thinker
may live on another device, and a step's text rows are then a lookup here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.layers.linear import Linear
from mstar.models.layers.mrope import mrope_axes, mrope_cos_sin
from mstar.models.layers.norm import RMSNorm
from mstar.models.qwen3_omni.config import TalkerConfig
from mstar.models.qwen3_omni.speech.code_predictor import CodePredictor
from mstar.models.qwen3_omni.thinker import ThinkerLayer
from mstar.types import TokenBatch

Device = torch.device | str | None
SPECIAL_CODES = 1024  # the top of the talker's vocabulary holds its special ids, never drawn but codec_eos


def suppressed_codes(cfg: TalkerConfig) -> torch.Tensor:
    """[n] int64: the ids the talker's first code may never take (the top
    1024 of its vocabulary except codec_eos)."""
    vocab = cfg.decoder.vocab_size
    ids = torch.arange(max(vocab - SPECIAL_CODES, 0), vocab)
    return ids[ids != cfg.codec_eos_id]


class Projection(nn.Module):
    """Thinker-width rows [N, Ht] -> talker-width rows [N, H]: a biased
    linear, SiLU, a biased linear."""

    def __init__(self, thinker_hidden: int, inner: int, hidden: int, *, device: Device = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.linear_fc1 = Linear(thinker_hidden, inner, bias=True, device=device, dtype=dtype)
        self.linear_fc2 = Linear(inner, hidden, bias=True, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerDecoder(nn.Module):
    def __init__(self, cfg: TalkerConfig, thinker_vocab_size: int, *, device: Device = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        d = cfg.decoder
        self.cfg = cfg
        self.layers = nn.ModuleList(ThinkerLayer(d, i, **kw) for i in range(d.num_hidden_layers))
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps, **kw)
        self.codec_embedding = nn.Embedding(d.vocab_size, d.hidden_size, **kw)
        self.codec_head = Linear(d.hidden_size, d.vocab_size, **kw)
        self.text_projection = Projection(cfg.thinker_hidden_size, cfg.projection_size, d.hidden_size, **kw)
        self.hidden_projection = Projection(cfg.thinker_hidden_size, cfg.projection_size, d.hidden_size, **kw)
        self.thinker_embed = nn.Embedding(thinker_vocab_size, cfg.thinker_hidden_size, **kw)
        self.code_predictor = CodePredictor(cfg.code_predictor, **kw)
        inv_freq = 1.0 / d.rope_theta ** (torch.arange(0, d.head_dim, 2, dtype=torch.float32) / d.head_dim)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.register_buffer("mrope_axes", mrope_axes(cfg.decoder.mrope_section).to(device), persistent=False)

    def text_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Thinker token ids [N] -> the talker's text side of each [N, H]:
        for a step, the next text token, tts_eos or tts_pad."""
        return self.text_projection(self.thinker_embed(ids.to(self.thinker_embed.weight.device)))

    def prefill(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        rows, index = batch.embeds["ctx"]
        x = torch.zeros(batch.input_ids.shape[0], self.cfg.decoder.hidden_size, dtype=self.norm.weight.dtype,
                        device=self.norm.weight.device)
        return self._run(x.index_copy(0, index.to(x.device), rows.to(x)), batch)

    def speak(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        """One token a row: its frame's first code."""
        if batch.draw is None:
            raise ValueError("speak draws the frame's codes: its batch needs `draw`")
        first = batch.input_ids
        rows = first.shape[0]
        dtype = self.norm.weight.dtype
        first_embed = self.codec_embedding(first)
        rest, rest_embeds = self.code_predictor.complete(batch.extra["last"].reshape(rows, -1).to(dtype),
                                                         first_embed, batch.draw)
        x = torch.cat([first_embed[:, None], rest_embeds], dim=1).sum(1)
        x = x + batch.extra["text"].reshape(rows, -1).to(x)
        return {**self._run(x, batch), "frame": torch.cat([first[:, None], rest], dim=1)}

    def _run(self, x: torch.Tensor, batch: TokenBatch) -> dict[str, torch.Tensor]:
        positions = batch.positions if batch.positions.dim() == 2 else batch.positions.expand(3, -1)
        cos, sin = mrope_cos_sin(positions, self.inv_freq, self.mrope_axes)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, cos, sin, batch.attn, residual)
        rows = batch.logits_index
        last = self.norm(x[rows], residual[rows])[0] if residual is not None else self.norm(x[rows])
        return {"logits": self.codec_head(last), "last": last}
