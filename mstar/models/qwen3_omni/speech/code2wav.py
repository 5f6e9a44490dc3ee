"""Qwen3-Omni's code2wav: codec frames in (codes [B, Q, T] int64, Q
codebooks), a 24 kHz waveform out, `samples_per_frame` (1920) samples a
frame. The codes' embeddings are averaged over the codebooks, pass the
sliding-window pre-transformer, are upsampled x4 by two transposed conv +
ConvNeXt stages, widened by a causal conv, then upsampled by the decoder
blocks (rates 8, 5, 4, 3) to one channel, clamped to [-1, 1].

Everything is causal, but each decoder block's transposed conv finishes a
block of samples only when the next input arrives: `decode` of T frames gives
1920 T - `held` samples (`held` = 555 at the released rates), the
utterance's last `held` never produced.

`stream` continues rows from their slots of per-row state (`state_spec`):
k frames in, 1920 k samples out, fixed shapes whatever each row's offset.
A row's outputs, concatenated, are `held` zeros followed by the whole decode
of its frames so far: its first output's leading `held` samples are not
audio, and the caller drops them (or plays them: they are silence).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from mstar.errors import ConfigError
from mstar.models.base import StateSpec
from mstar.models.qwen3_omni.config import Code2WavConfig
from mstar.models.weight_map import fill_params
from mstar.models.qwen3_omni.speech.code2wav_blocks import (
    KERNEL,
    CausalConv,
    CausalTransConv,
    DecoderBlock,
    SnakeBeta,
    Upsample,
)
from mstar.models.qwen3_omni.speech.code2wav_transformer import Code2WavTransformer
from mstar.types import StateRows

Device = torch.device | str | None


class Code2Wav(nn.Module):
    def __init__(self, cfg: Code2WavConfig, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.cfg = cfg
        hidden, dim = cfg.hidden_size, cfg.decoder_dim
        self.code_embedding = nn.Embedding(cfg.codebook_size * cfg.num_quantizers, hidden, **kw)
        self.code_embedding.requires_grad_(False)
        self.register_buffer("code_offset", (torch.arange(cfg.num_quantizers) * cfg.codebook_size).to(device),
                             persistent=False)
        self.transformer = Code2WavTransformer(cfg, **kw)
        self.upsample = nn.ModuleList(Upsample(hidden, r, **kw) for r in cfg.upsampling_ratios)
        self.conv_in = CausalConv(hidden, dim, KERNEL, **kw)
        self.blocks = nn.ModuleList(DecoderBlock(dim >> i, dim >> (i + 1), r, **kw)
                                    for i, r in enumerate(cfg.upsample_rates))
        out_dim = dim >> len(cfg.upsample_rates)
        self.snake_out = SnakeBeta(out_dim, **kw)
        self.conv_out = CausalConv(out_dim, 1, KERNEL, **kw)
        self.samples_per_frame = cfg.samples_per_frame
        # per decoder block, then for the output: samples a frame, and how
        # many samples before the sequence's start a row's first steps emit
        self._rates: list[int] = []
        self._lags: list[int] = []
        rate, lag = 1, 0
        for stage in self.upsample:
            rate *= stage.up.stride
        for block in self.blocks:
            rate, lag = rate * block.up.stride, block.up.lag(lag)
            self._rates.append(rate)
            self._lags.append(lag)
        self._rates.append(rate)
        self._lags.append(lag)
        self.held = lag

    def _embed(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.dim() != 3 or codes.shape[1] != self.cfg.num_quantizers:
            raise ValueError(f"code2wav takes codes [B, {self.cfg.num_quantizers}, T], got {tuple(codes.shape)}")
        return self.code_embedding(codes + self.code_offset[:, None]).mean(1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, Q, T] -> [B, samples_per_frame * T - held], the whole
        sequence at once."""
        x = self.transformer(self._embed(codes)).transpose(1, 2)
        for stage in self.upsample:
            x = stage(x)
        x = self.conv_in(x)
        for block in self.blocks:
            x = block(x)
        return self.conv_out(self.snake_out(x)).clamp(-1.0, 1.0)[:, 0]

    # -- streaming

    def _held_convs(self) -> Iterator[tuple[str, CausalConv | CausalTransConv]]:
        """Every convolution that carries inputs from one step to the next,
        by its state name, in the order a step reads them."""
        for i, stage in enumerate(self.upsample):
            yield f"upsample.{i}", stage.convnext.dwconv
        yield "conv_in", self.conv_in
        for i, block in enumerate(self.blocks):
            yield f"block.{i}.up", block.up
            for j, unit in enumerate(block.units):
                yield f"block.{i}.unit.{j}", unit.conv1
        yield "conv_out", self.conv_out

    def state_spec(self, dtype: torch.dtype | None = None) -> StateSpec:
        """A row's state, in `dtype` (default: the weights'): its frame count,
        the transformer's rolling K/V and every convolution's held inputs."""
        dtype = dtype or self.code_embedding.weight.dtype
        return StateSpec((("frames", (), torch.long), ("kv", self.transformer.kv_shape, dtype),
                          *((name, conv.state_shape, dtype) for name, conv in self._held_convs())))

    def stream(self, codes: torch.Tensor, state: StateRows, fresh: torch.Tensor, zeroed: bool = False) -> torch.Tensor:
        """codes [B, Q, k]: each row's next k frames -> [B, samples_per_frame
        * k], the samples they finish (after a fresh row's `held` zeros).
        Rows continue from their slots (`fresh` [B] bool: from an empty
        state, whatever the slot holds; with `zeroed`, a fresh row's slot is
        known to hold zeros, as the runtime hands slots out, and is read as
        it is) and their slots are updated."""
        slots, k = state.slots, codes.shape[-1]
        if slots.shape != (codes.shape[0],) or fresh.shape != slots.shape:
            raise ValueError(f"code2wav stream: codes for {codes.shape[0]} rows, {tuple(slots.shape)} slots and "
                             f"{tuple(fresh.shape)} fresh flags")
        restart = fresh.to(torch.bool)

        def read(name: str) -> torch.Tensor:
            rows = state.tensors[name][slots]
            return rows if zeroed else rows.masked_fill(restart.view(-1, *(1,) * (rows.dim() - 1)), 0)

        frames = read("frames")
        x, kv = self.transformer.step(self._embed(codes), read("kv"), frames)
        new = {"frames": frames + k, "kv": kv}
        x = x.transpose(1, 2)
        for i, stage in enumerate(self.upsample):
            x, new[f"upsample.{i}"] = stage.step(x, read(f"upsample.{i}"))
        x, new["conv_in"] = self.conv_in.step(x, read("conv_in"))
        for i, block in enumerate(self.blocks):
            names = [f"block.{i}.up", *(f"block.{i}.unit.{j}" for j in range(len(block.units)))]
            keep = self._keep(frames, self._rates[i], k, self._lags[i])
            x, bufs = block.step(x, [read(n) for n in names], keep)
            new.update(zip(names, bufs, strict=True))
        keep = self._keep(frames, self._rates[-1], k, self._lags[-1])
        y, new["conv_out"] = self.conv_out.advance(self.snake_out.before(x, read("conv_out"), keep))
        for name, value in new.items():   # after every read: a fault above leaves the slots as they were
            state.tensors[name][slots] = value.to(state.tensors[name].dtype)
        return y.clamp(-1.0, 1.0)[:, 0].masked_fill(~keep, 0)

    @staticmethod
    def _keep(frames: torch.Tensor, rate: int, k: int, lag: int) -> torch.Tensor:
        """[B, rate * k] bool: the samples of this step at `rate` a frame that
        are the sequence's, not the `lag` before its start."""
        return frames[:, None] * rate + torch.arange(rate * k, device=frames.device) >= lag


_PREFIX = "code2wav."


def checkpoint_target(name: str, blocks: int) -> str | None:
    """The `Code2Wav` parameter a transformers tensor name (without
    "code2wav.") fills; None for a name it does not know. transformers
    wraps each convolution in a module holding `conv`, lists the decoder as
    [conv, blocks..., snake, conv] and a block as [snake, transposed conv,
    units...]."""
    name = re.sub(r"\.conv\.(weight|bias)$", r".\1", name)
    if name == "code_embedding.weight":
        return name
    if m := re.fullmatch(r"pre_transformer\.layers\.(\d+)\.(self_attn|mlp)_layer_scale\.scale", name):
        return f"transformer.layers.{m[1]}.{'attn' if m[2] == 'self_attn' else 'mlp'}_scale"
    if m := re.fullmatch(r"pre_transformer\.(layers\.\d+\.)(?:mlp\.)?(.+)", name):
        return f"transformer.{m[1]}{m[2]}"
    if m := re.fullmatch(r"pre_transformer\.(.+)", name):
        return f"transformer.{m[1]}"
    if m := re.fullmatch(r"upsample\.(\d+)\.([01])\.(.+)", name):
        return f"upsample.{m[1]}.{'up' if m[2] == '0' else 'convnext'}.{m[3]}"
    if not (m := re.fullmatch(r"decoder\.(\d+)\.(.+)", name)):
        return None
    i, rest = int(m[1]), m[2]
    ends = {0: "conv_in", blocks + 1: "snake_out", blocks + 2: "conv_out"}
    if i in ends:
        return f"{ends[i]}.{rest}"
    if i > blocks or not (m := re.fullmatch(r"block\.(\d+)\.(.+)", rest)):
        return None
    j = int(m[1])
    return f"blocks.{i - 1}." + ("snake" if j == 0 else "up" if j == 1 else f"units.{j - 2}") + "." + m[2]


def load_code2wav(module: Code2Wav, folder: str | Path) -> None:
    """Fill `module` from the `code2wav.*` tensors of a folder transformers
    saved; a `ConfigError` names what is missing, left over or misshapen."""
    def target(local: str) -> str | None:
        return checkpoint_target(local, len(module.blocks))

    def same_shape(name: str, tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        if param.shape != tensor.shape:
            raise ConfigError(f"{folder}: {name} is {list(tensor.shape)}, the code2wav config makes "
                              f"{target(name[len(_PREFIX):])} {list(param.shape)}")
        return tensor

    fill_params(module, folder, _PREFIX, "qwen3-omni code2wav", target, same_shape)
