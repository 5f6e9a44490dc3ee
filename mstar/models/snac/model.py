"""SnacDecoder, the `codec` component: codes per level in, a waveform out.

codes: one int64 tensor per level, [B, T_level], with T_level = T * (s_0 / s_l)
for vq_strides s (24 kHz: [B, T], [B, 2T], [B, 4T]) and every code in
[0, codebook_size). Each level looks its codes up in its codebook, projects
them to the latent width (1x1 conv) and repeats each frame s_l times; the sum
is the latent z [B, latent, T * s_0]. The decoder network turns z into audio
[B, 1, T * s_0 * hop] in [-1, 1] (24 kHz: a 4-frame window is 16 latent
frames, 8192 samples):

    depthwise conv k7 + 1x1 conv (or one conv k7) -> [local attention]
    -> per decoder rate: snake, transposed conv x rate, noise, 3 residual units
    -> snake -> conv k7 to one channel -> tanh

Rows are independent except through the noise source (see noise.py): with
`noise=False` or `seeds`, a row decodes to the same samples alone or in any
batch. Code ranges are the caller's contract: an out-of-range code on CUDA is
a device-side assert, so it must be filtered before it gets here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mstar.kernels.codec.snake import snake
from mstar.models.snac.attention import LocalAttention
from mstar.models.snac.blocks import KERNEL, Snake, UpsampleBlock
from mstar.models.snac.config import SnacConfig
from mstar.models.snac.noise import NoiseSource, SeededNoise, TorchNoise
from mstar.models.snac.spans import Span, conv_need, conv_span, take

Device = torch.device | str | None


class CodebookLevel(nn.Module):
    """One level of the residual quantizer, decode side: codes [B, T_l] in,
    latent [B, latent, T_l * stride] out."""

    def __init__(self, cfg: SnacConfig, stride: int, *, device: Device = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.stride = stride
        self.codebook = nn.Embedding(cfg.codebook_size, cfg.codebook_dim, device=device, dtype=dtype)
        self.out_proj = nn.Conv1d(cfg.codebook_dim, cfg.latent, 1, device=device, dtype=dtype)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        z = self.out_proj(self.codebook(codes).transpose(1, 2))
        return z.repeat_interleave(self.stride, dim=-1) if self.stride > 1 else z


class SnacDecoder(nn.Module):
    def __init__(self, cfg: SnacConfig, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = cfg
        kw = {"device": device, "dtype": dtype}
        latent, dim = cfg.latent, cfg.decoder_dim
        self.levels = nn.ModuleList(CodebookLevel(cfg, s, **kw) for s in cfg.vq_strides)
        if cfg.depthwise:
            self.stem_depthwise: nn.Conv1d | None = nn.Conv1d(latent, latent, KERNEL, padding=KERNEL // 2,
                                                              groups=latent, **kw)
            self.stem = nn.Conv1d(latent, dim, 1, **kw)
        else:
            self.stem_depthwise = None
            self.stem = nn.Conv1d(latent, dim, KERNEL, padding=KERNEL // 2, **kw)
        self.attention = (LocalAttention(dim, cfg.attn_window_size, **kw)
                          if cfg.attn_window_size is not None else None)
        blocks = []
        for i, rate in enumerate(cfg.decoder_rates):
            in_dim, out_dim = dim >> i, dim >> (i + 1)
            blocks.append(UpsampleBlock(in_dim, out_dim, rate, cfg.noise, groups=out_dim if cfg.depthwise else 1, **kw))
        self.blocks = nn.ModuleList(blocks)
        out_dim = dim >> len(cfg.decoder_rates)
        self.out_snake = Snake(out_dim, **kw)
        self.out_conv = nn.Conv1d(out_dim, 1, KERNEL, padding=KERNEL // 2, **kw)

    # -- the quantizer's decode path
    def check_codes(self, codes: Sequence[torch.Tensor]) -> tuple[int, int]:
        """(batch, coarse frames) of well-shaped codes; raises ValueError
        otherwise. Shapes only: checking values would synchronise the device."""
        cfg = self.config
        if len(codes) != cfg.num_levels:
            raise ValueError(f"expected codes for {cfg.num_levels} levels, got {len(codes)}")
        if codes[0].dim() != 2:
            raise ValueError(f"codes must be [B, T] per level, got {tuple(codes[0].shape)} for level 0")
        batch, coarse = codes[0].shape
        want = cfg.level_lengths(coarse)
        for level, (c, n) in enumerate(zip(codes, want)):
            if tuple(c.shape) != (batch, n):
                raise ValueError(f"level {level} codes have shape {tuple(c.shape)}, expected {(batch, n)} "
                                 f"for {coarse} coarse frames (vq_strides {list(cfg.vq_strides)})")
            if c.dtype.is_floating_point or c.dtype == torch.bool:
                raise ValueError(f"level {level} codes must be integers, got {c.dtype}")
        if coarse < 1:
            raise ValueError("codes are empty: need at least one coarse frame")
        window = cfg.attn_window_size
        if window is not None and (coarse * cfg.vq_strides[0]) % window:
            raise ValueError(f"this codec attends over windows of {window} latent frames: the number of "
                             f"latent frames ({coarse} coarse x {cfg.vq_strides[0]}) must be a multiple of it")
        return batch, coarse

    def embed_codes(self, codes: Sequence[torch.Tensor]) -> torch.Tensor:
        """codes per level -> latent z [B, latent, T * vq_strides[0]] (the
        package's `quantizer.from_codes`)."""
        self.check_codes(codes)
        z = self.levels[0](codes[0])
        for level, c in zip(self.levels[1:], codes[1:]):
            z = z + level(c)
        return z

    # -- the decoder network
    def synthesize(self, z: torch.Tensor, noise: NoiseSource | None, play: tuple[int, int] | None = None,
                   fused: bool | None = None) -> torch.Tensor:
        """latent z [B, latent, F] -> audio [B, 1, F * hop]. `noise` draws one
        [B, 1, T] tensor per upsampling block, in block order; None: no noise.
        `play` (start, stop): only those samples, [B, 1, stop - start], equal
        to the whole decode's there; each layer computes just the positions
        they depend on (`spans.py`). `fused`: depthwise residual units in the
        passes of `kernels/codec/snake_unit.py` (each snake computed once, carried
        to what reads it); None: where the kernels are Triton's (CUDA)."""
        if fused is None:
            fused = z.is_cuda and not torch.is_grad_enabled()
        fused = fused and self.config.depthwise
        if play is None and not fused:
            x = self.stem_depthwise(z) if self.stem_depthwise is not None else z
            x = self.stem(x)
            if self.attention is not None:
                x = self.attention(x)
            batch, length = x.shape[0], x.shape[-1]
            for i, block in enumerate(self.blocks):
                length *= block.stride
                draw = None
                if noise is not None and block.noise is not None:
                    draw = noise.draw(i, batch, length, x.device, x.dtype)
                x = block(x, draw)
            return torch.tanh(self.out_conv(self.out_snake(x)))
        total = z.shape[-1] * self.config.hop_length
        out = Span(*play, total) if play else Span.whole(total)
        if out.width == 0:
            return z.new_zeros(z.shape[0], 1, 0)
        return self._synthesize_span(z, noise, out, fused)

    def _synthesize_span(self, z: torch.Tensor, noise: NoiseSource | None, out: Span, fused: bool) -> torch.Tensor:
        # backward from the samples asked for: the span each block's output must hold
        last = conv_need(out, self.out_conv.padding[0])
        block_spans: list[list[Span]] = []
        need = last
        for block in reversed(self.blocks):
            block_spans.insert(0, block.spans(need, need.length // block.stride))
            need = block_spans[0][0]
        if self.attention is not None:  # attention over windows of the whole signal: all of it, up to there
            need = Span.whole(need.length)
        first = self.stem_depthwise if self.stem_depthwise is not None else self.stem
        z_span = conv_need(need, first.padding[0])
        # forward over the spans
        x = conv_span(first, take(z, Span.whole(z.shape[-1]), z_span), z_span, need)
        if self.stem_depthwise is not None:
            x = self.stem(x)
        if self.attention is not None:
            x = self.attention(x)
        held = need
        if fused:  # the blocks pass each other their outputs' snakes
            x = snake(x, self.blocks[0].snake.alpha)
        for i, (block, spans) in enumerate(zip(self.blocks, block_spans)):
            draw = None
            if noise is not None and block.noise is not None:
                noised = spans[1]
                draw = noise.draw(i, x.shape[0], noised.length, x.device, x.dtype, (noised.start, noised.stop))
            if fused:
                after = self.blocks[i + 1].snake.alpha if i + 1 < len(self.blocks) else self.out_snake.alpha
                _, x = block.forward_fused(take(x, held, spans[0]), spans, draw, after)
            else:
                x = block.forward_span(take(x, held, spans[0]), spans, draw)
            held = spans[-1]
        return torch.tanh(conv_span(self.out_conv, x if fused else self.out_snake(x), last, out))

    @torch.no_grad()
    def decode(self, codes: Sequence[torch.Tensor], *, noise: bool = True,
               generator: torch.Generator | None = None, seeds: torch.Tensor | None = None,
               play: tuple[int, int] | None = None, fused: bool | None = None) -> torch.Tensor:
        """codes per level [B, T_level] -> audio [B, 1, T * vq_strides[0] * hop].

        Noise (when the config has it and `noise` is True): with `seeds` [B]
        (int64), per-row counter-based noise, independent of the batch; else
        torch.randn from `generator` (default: the global generator), the
        package's exact draws. `play` (start, stop): only those samples;
        `fused`: see `synthesize`."""
        z = self.embed_codes(codes)
        source: NoiseSource | None = None
        if noise:
            source = SeededNoise(seeds) if seeds is not None else TorchNoise(generator)
        return self.synthesize(z, source, play, fused)

    def forward(self, codes: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.decode(codes)
