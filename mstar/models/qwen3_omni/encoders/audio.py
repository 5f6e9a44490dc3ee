"""Qwen3-Omni's audio encoder: per clip its log-mel features [mel bins,
frames] in, one [sum of tokens, output_dim] tensor of thinker-width rows out,
clip after clip, `positions.audio_tokens(frames)` rows a clip.

Each clip is cut into 1 s chunks of 100 frames (the last may be shorter).
Every chunk of every clip goes through three stride-2 3x3 convolutions in one
batch, is flattened to d_model and given the sinusoid of its position within
the chunk; then the clip's tokens pass a pre-LN transformer whose attention
stays inside windows of `n_window_infer` frames (13 tokens a second) counted
from the clip's start, all windows of all clips in one padded batch; a
LayerNorm and a two-layer GELU head project to the thinker's width.

A clip comes out as transformers encodes it alone. transformers pads every
chunk of a call to the call's longest chunk, and past a chunk's end the
convolutions then see their bias instead of zeros: a clip of more than one
chunk has its last chunk padded to 100 frames; a clip shorter than a chunk is
not padded alone, but is when batched with a longer one. Here a single-chunk
clip's convolution outputs are zeroed past their valid length at every
stage, which is what no padding gives, so batching never changes a clip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mstar.kernels.host_copy import to_device
from mstar.models.layers.linear import Linear, padded_rows
from mstar.models.qwen3_omni.config import AudioEncoderConfig
from mstar.models.weight_map import load_part
from mstar.models.qwen3_omni.positions import MEL_CHUNK, TOKENS_PER_CHUNK

Device = torch.device | str | None
IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)

CHECKPOINT_PREFIX = "thinker.audio_tower."
WINDOWED_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # the first that takes the call


def _stride2(n: IntOrTensor) -> IntOrTensor:
    """Length after a 3-wide, stride-2 convolution padded by 1."""
    return (n - 1) // 2 + 1


def sinusoids(length: int, channels: int, max_timescale: float = 10_000.0) -> torch.Tensor:
    """[length, channels] float32: sin then cos of position times
    geometrically spaced rates from 1 to 1 / max_timescale."""
    rates = torch.exp(-math.log(max_timescale) / (channels // 2 - 1) * torch.arange(channels // 2).float())
    angles = torch.arange(length).float()[:, None] * rates[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


@dataclass(frozen=True)
class AudioLayout:
    """Where each clip's frames and tokens sit in the encoder's batches.

    chunks: chunks of all clips; reach [chunks, 3]: per conv stage, how many
    of a chunk's outputs are kept (the rest zeroed, as if the chunk ended
    there); frame_slots [sum of frames]: each frame's column in the
    [chunks * 100] input grid; token_slots [T]: each token's row in the
    [chunks * 13] conv output grid; window: tokens per attention window;
    window_slots [T]: each token's row in the [windows * window] attention
    grid; key_mask [windows, window]: which grid rows hold a token; tokens:
    each clip's token count.

    `padded`: the grids hold `padded_rows` chunks and token rows, so that
    the convolutions' and projections' shapes repeat from step to step
    (cuDNN and cuBLAS pay milliseconds for each new one). Padding chunks are
    zeros; padding tokens copy the first token's row and attend among
    themselves, in windows after the clips'; no clip's token sees them."""

    chunks: int
    reach: torch.Tensor
    frame_slots: torch.Tensor
    token_slots: torch.Tensor
    window: int
    window_slots: torch.Tensor
    key_mask: torch.Tensor
    tokens: tuple[int, ...]

    @classmethod
    def of(cls, frames: list[int], window: int, device: Device = None, padded: bool = False) -> AudioLayout:
        """The layout of clips of `frames` mel frames each, attention
        windows of `window` tokens."""
        f = torch.tensor(frames, dtype=torch.long)
        chunk_counts = (f + MEL_CHUNK - 1) // MEL_CHUNK
        clip_of_chunk = torch.repeat_interleave(torch.arange(len(frames)), chunk_counts)
        first_chunk = torch.cumsum(chunk_counts, 0) - chunk_counts
        index_in_clip = torch.arange(len(clip_of_chunk)) - first_chunk[clip_of_chunk]
        chunk_frames = (f[clip_of_chunk] - index_in_clip * MEL_CHUNK).clamp(max=MEL_CHUNK)
        # alone, transformers pads a clip's chunks to its longest: 100 frames
        # if it has two or more, its own length if it has one
        reach0 = torch.where(chunk_counts[clip_of_chunk] > 1, MEL_CHUNK, chunk_frames)
        r1 = _stride2(reach0)
        r2 = _stride2(r1)
        reach = torch.stack([r1, r2, _stride2(r2)], dim=1)
        frame_slots = _ranges(first_chunk * MEL_CHUNK, f)
        chunk_tokens = _stride2(_stride2(_stride2(chunk_frames)))
        token_slots = _ranges(torch.arange(len(chunk_frames)) * TOKENS_PER_CHUNK, chunk_tokens)
        tokens = torch.zeros(len(frames), dtype=torch.long).index_add_(0, clip_of_chunk, chunk_tokens)
        chunks, spare = len(chunk_frames), 0
        if padded:
            chunks = padded_rows(chunks)
            reach = torch.cat([reach, reach.new_zeros(chunks - len(chunk_frames), 3)])
            spare = padded_rows(len(token_slots)) - len(token_slots)
            token_slots = torch.cat([token_slots, token_slots.new_zeros(spare)])
        # the spare tokens are one more clip's, attending only among themselves
        clip_tokens = torch.cat([tokens, torch.tensor([spare])])
        window_counts = (clip_tokens + window - 1) // window
        first_window = torch.cumsum(window_counts, 0) - window_counts
        window_slots = _ranges(first_window * window, clip_tokens)
        key_mask = torch.zeros(int(window_counts.sum()) * window, dtype=torch.bool)
        key_mask[window_slots] = True
        host = torch.cat([reach.reshape(-1), frame_slots, token_slots, window_slots, key_mask.long()])
        parts = to_device(host, device or "cpu").split([reach.numel(), len(frame_slots), len(token_slots),
                                                          len(window_slots), key_mask.numel()])
        return cls(chunks=chunks, reach=parts[0].view(-1, 3), frame_slots=parts[1], token_slots=parts[2],
                   window=window, window_slots=parts[3], key_mask=parts[4].bool().view(-1, window),
                   tokens=tuple(tokens.tolist()))


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """cat(arange(s, s + n) for s, n in zip(starts, lengths)), without a loop."""
    offsets = torch.arange(int(lengths.sum())) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    return torch.repeat_interleave(starts, lengths) + offsets


class AudioAttention(nn.Module):
    """Bidirectional multi-head attention within each window; q, k and v
    from one merged projection (the checkpoint's three fill its row blocks)."""

    def __init__(self, d_model: int, heads: int, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.heads, self.kv_heads, self.head_dim = heads, heads, d_model // heads
        self.qkv = Linear(d_model, 3 * d_model, bias=True, **kw)
        self.out_proj = Linear(d_model, d_model, bias=True, **kw)

    def forward(self, x: torch.Tensor, layout: AudioLayout) -> torch.Tensor:
        t, d = x.shape
        slots = layout.key_mask.numel()
        # [T, 3d] -> 3 x [windows, heads, window, head_dim], one scatter for all three
        grid = x.new_zeros(slots, 3 * d).index_copy_(0, layout.window_slots, self.qkv(x))
        q, k, v = grid.view(-1, layout.window, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        # cuDNN's attention, torch's pick for a mask on Hopper, plans each new window count for ms
        with sdpa_kernel(WINDOWED_BACKENDS):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.key_mask[:, None, None, :])
        out = out.transpose(1, 2).reshape(slots, d)[layout.window_slots]
        return self.out_proj(out)


class AudioEncoderLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        d = cfg.d_model
        self.self_attn_layer_norm = nn.LayerNorm(d, **kw)
        self.self_attn = AudioAttention(d, cfg.encoder_attention_heads, **kw)
        self.final_layer_norm = nn.LayerNorm(d, **kw)
        self.fc1 = Linear(d, cfg.encoder_ffn_dim, bias=True, **kw)
        self.fc2 = Linear(cfg.encoder_ffn_dim, d, bias=True, **kw)

    def forward(self, x: torch.Tensor, layout: AudioLayout) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), layout)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """The audio tower; parameters named as transformers names them under
    `thinker.audio_tower.`. `conv_batch`: chunks convolved at a time (the
    first convolution's output is downsample_hidden_size x 64 x 50 a chunk).
    `padded`: lay the clips out on padded grids (`AudioLayout`); None, the
    default, pads on CUDA, where a new shape costs host time."""

    def __init__(self, cfg: AudioEncoderConfig, *, device: Device = None, dtype: torch.dtype | None = None,
                 conv_batch: int = 500, padded: bool | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.cfg, self.conv_batch, self.padded = cfg, conv_batch, padded
        ch = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, ch, 3, 2, padding=1, **kw)
        self.conv2d2 = nn.Conv2d(ch, ch, 3, 2, padding=1, **kw)
        self.conv2d3 = nn.Conv2d(ch, ch, 3, 2, padding=1, **kw)
        self.conv_out = Linear(ch * _stride2(_stride2(_stride2(cfg.num_mel_bins))), cfg.d_model, **kw)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg, **kw) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model, **kw)
        self.proj1 = Linear(cfg.d_model, cfg.d_model, bias=True, **kw)
        self.proj2 = Linear(cfg.d_model, cfg.output_dim, bias=True, **kw)
        self.register_buffer("positions", sinusoids(TOKENS_PER_CHUNK, cfg.d_model).to(device=device, dtype=dtype),
                             persistent=False)
        self.requires_grad_(False)
        # the chunking and the 13 tokens a chunk are transformers' fixed 100-frame rule
        self.window = TOKENS_PER_CHUNK * (cfg.n_window_infer // MEL_CHUNK)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        """features: per clip [num_mel_bins, frames] (frames >= 1). Returns
        [sum of audio_tokens(frames), output_dim] in this module's dtype, the
        clips' rows one after another."""
        weight = self.conv2d1.weight
        frames = [int(x.shape[-1]) for x in features]
        if not features or min(frames) < 1 or any(x.dim() != 2 or x.shape[0] != self.cfg.num_mel_bins
                                                  for x in features):
            raise ValueError(f"the audio encoder takes one or more [{self.cfg.num_mel_bins}, frames >= 1] "
                             f"features, got {[list(x.shape) for x in features]}")
        padded = weight.is_cuda if self.padded is None else self.padded
        layout = AudioLayout.of(frames, self.window, weight.device, padded)
        mels = torch.cat([x.to(weight.device, weight.dtype) for x in features], dim=1)
        grid = mels.new_zeros(self.cfg.num_mel_bins, layout.chunks * MEL_CHUNK)
        grid[:, layout.frame_slots] = mels
        chunks = grid.view(-1, layout.chunks, MEL_CHUNK).transpose(0, 1).unsqueeze(1)  # [C, 1, mels, 100]
        conv = torch.cat([self._convolve(part, reach) for part, reach in
                          zip(chunks.split(self.conv_batch), layout.reach.split(self.conv_batch))])
        c, ch, freq, width = conv.shape
        h = self.conv_out(conv.permute(0, 3, 1, 2).reshape(c, width, ch * freq)) + self.positions[:width]
        h = h.reshape(c * width, -1)[layout.token_slots]
        for layer in self.layers:
            h = layer(h, layout)
        return self.proj2(F.gelu(self.proj1(self.ln_post(h))))[:sum(layout.tokens)]

    def _convolve(self, x: torch.Tensor, reach: torch.Tensor) -> torch.Tensor:
        """[C, 1, mels, 100] -> [C, channels, mels / 8, 13]; after each stage
        a chunk keeps only its first `reach` columns, zeros after."""
        for stage, conv in enumerate((self.conv2d1, self.conv2d2, self.conv2d3)):
            x = F.gelu(conv(x))
            keep = torch.arange(x.shape[-1], device=x.device)[None, :] < reach[:, stage, None]
            x = x * keep[:, None, None, :].to(x.dtype)
        return x


def load_audio_encoder(encoder: AudioEncoder, folder: str | Path) -> None:
    """Fill `encoder` from the `thinker.audio_tower.*` tensors of a folder
    transformers saved, reading only those; a `ConfigError` names tensors
    missing from the folder or left over in it."""
    load_part(encoder, folder, CHECKPOINT_PREFIX, "qwen3-omni audio encoder")
