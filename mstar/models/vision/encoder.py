"""The vision encoder of Qwen3-VL, as Qwen3-Omni's thinker and Qwen3.5 carry
it: the patches of one or more images (`ImagePatches.pixel_values`
concatenated, [patches, C * T * P * P]) and their grids [N, 3] in; one row
of the decoder's width per 2x2 block of patches out (`embeds`), and, for a
model that has them (Qwen3-Omni; Qwen3.5 has none), the deepstack features,
the same blocks merged after chosen encoder layers (`deepstack`), which the
decoder adds to its residual stream at the image positions after its first
layers.

A patch is embedded by one linear map (the checkpoint's Conv3d has stride
equal to its kernel, so it sees each patch alone), plus a learned square
table of positions resampled bilinearly (corners aligned) to the image's
grid. Pre-norm blocks follow: attention under 2-D axial rotary (of a
head's rotation pairs (j, j + D/2), the first D/4 turn with the patch's
row, the rest with its column), full within a frame and blind across frames
and images, then a GELU MLP. Patches arrive in merge-block order, so a
merger views four consecutive rows as one. Deepstack levels come in the
order of the encoder layers they are taken after, whatever the order of
`deepstack_visual_indexes` (as in transformers).

Frames of different sizes attend in one batched call, padded to the longest
frame with the padding masked out as keys. `load_vision_encoder` fills it
from a checkpoint's tensors under a prefix (`thinker.visual.`,
`model.visual.`), in either model's names for the mergers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mstar.kernels.rope_kv import rotate_half
from mstar.models.layers.linear import Linear
from mstar.models.vision.config import VisionEncoderConfig
from mstar.models.weight_map import fill_params

Device = torch.device | str | None
LAYER_NORM_EPS = 1e-6


@dataclass(frozen=True)
class VisionOutput:
    embeds: torch.Tensor      # [tokens, out_hidden]: what the image placeholders' embeddings become
    deepstack: torch.Tensor   # [levels, tokens, out_hidden]: level k adds to the thinker after its layer k


@dataclass(frozen=True)
class PatchLayout:
    """Where each patch of a batch sits ([patches] int64 each), and how its
    frames pad to one attention batch."""

    row: torch.Tensor          # in its frame's grid of patches
    col: torch.Tensor
    height: torch.Tensor       # its frame's grid size
    width: torch.Tensor
    frame: torch.Tensor        # its frame, counted over the batch
    slot: torch.Tensor         # its index within its frame
    frames: int
    longest: int               # patches in the largest frame
    keys: torch.Tensor | None  # [frames, 1, 1, longest] bool: a frame's real patches; None when all are equal

    @classmethod
    def of(cls, grid_thw: torch.Tensor, merge: int, device: Device = None) -> PatchLayout:
        """The layout of patches in merge-block order (per frame: block row,
        block column, row in block, column in block) for grids [N, 3]."""
        grid = grid_thw.to("cpu", torch.long)
        t, h, w = grid.unbind(1)
        image = torch.repeat_interleave(torch.arange(len(grid)), t * h * w)
        first_patch = torch.cumsum(t * h * w, 0) - t * h * w
        first_frame = torch.cumsum(t, 0) - t
        offset = torch.arange(len(image)) - first_patch[image]
        height, width = h[image], w[image]
        frame_in_image, slot = offset // (height * width), offset % (height * width)
        block, in_block = slot // (merge * merge), slot % (merge * merge)
        row = block // (width // merge) * merge + in_block // merge
        col = block % (width // merge) * merge + in_block % merge
        sizes = torch.repeat_interleave(h * w, t)
        longest = int(sizes.max())
        # equal frames need no mask, and without one SDPA may take its fastest kernel
        keys = None if bool((sizes == longest).all()) else (
            torch.arange(longest)[None, :] < sizes[:, None])[:, None, None, :].to(device)
        return cls(row=row.to(device), col=col.to(device), height=height.to(device), width=width.to(device),
                   frame=(first_frame[image] + frame_in_image).to(device), slot=slot.to(device), frames=len(sizes),
                   longest=longest, keys=keys)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated in the "rotate half" layout by cos/sin [T, D]
    (one angle per patch, from its own row and column), in float32."""
    h = x.float()
    return (h * cos[:, None] + rotate_half(h) * sin[:, None]).to(x.dtype)


def _bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For positions `index` along axes of `size` points resampled from
    `side` table entries (end points on end points): the two table
    entries [n, 2] and their weights [n, 2]."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)
    low = torch.floor(src)
    frac = src - low
    taps = torch.stack([low.long(), low.long() + 1], dim=1).clamp(max=side - 1)
    return taps, torch.stack([1 - frac, frac], dim=1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True, **kw)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=True, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: PatchLayout) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        shape = (layout.frames, layout.longest, self.heads, self.head_dim)
        padded = []
        for rows in (q, k, v):
            if layout.keys is None:  # frames of one size lie back to back: already the padded layout
                frames = rows.reshape(shape)
            else:
                frames = rows.new_zeros(shape)
                frames[layout.frame, layout.slot] = rows
            padded.append(frames.transpose(1, 2))  # [frames, heads, longest, head_dim]
        out = F.scaled_dot_product_attention(*padded, attn_mask=layout.keys, scale=self.head_dim ** -0.5)
        out = out.transpose(1, 2)
        out = out.reshape(n, -1) if layout.keys is None else out[layout.frame, layout.slot].reshape(n, -1)
        return self.proj(out)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS, **kw)
        self.attn = VisionAttention(cfg, **kw)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS, **kw)
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True, **kw)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True, **kw)
        self.approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: PatchLayout) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, layout)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate=self.approximate))


class PatchMerger(nn.Module):
    """Four patches of a merge block -> one row of the thinker's width. The
    final merger normalises each patch before joining them; the deepstack
    mergers normalise the joined row."""

    def __init__(self, cfg: VisionEncoderConfig, *, norm_joined: bool, device: Device = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.norm_joined = norm_joined
        self.norm = nn.LayerNorm(self.width if norm_joined else cfg.hidden_size, eps=LAYER_NORM_EPS, **kw)
        self.fc1 = Linear(self.width, self.width, bias=True, **kw)
        self.fc2 = Linear(self.width, cfg.out_hidden_size, bias=True, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joined = self.norm(x.reshape(-1, self.width)) if self.norm_joined else self.norm(x).reshape(-1, self.width)
        return self.fc2(F.gelu(self.fc1(joined)))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.cfg = cfg
        self.patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        self.patch_embed = Linear(self.patch_dim, cfg.hidden_size, bias=True, **kw)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size, **kw)
        self.side = math.isqrt(cfg.num_position_embeddings)
        self.blocks = nn.ModuleList(VisionBlock(cfg, **kw) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, norm_joined=False, **kw)
        self.deepstack_mergers = nn.ModuleList(PatchMerger(cfg, norm_joined=True, **kw)
                                               for _ in cfg.deepstack_visual_indexes)
        self.deepstack_at = {layer: k for k, layer in enumerate(cfg.deepstack_visual_indexes)}
        rotary_dim = cfg.head_dim // 2  # per axis
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def positions(self, layout: PatchLayout) -> torch.Tensor:
        """[patches, hidden] float32: the position table resampled to each
        patch's place in its frame."""
        h_taps, h_weights = _bilinear_taps(layout.row, layout.height, self.side)
        w_taps, w_weights = _bilinear_taps(layout.col, layout.width, self.side)
        index = (h_taps[:, :, None] * self.side + w_taps[:, None, :]).flatten(1)
        weight = (h_weights[:, :, None] * w_weights[:, None, :]).flatten(1)
        return (self.pos_embed.weight[index].float() * weight[:, :, None]).sum(1)

    def rotary(self, layout: PatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, head_dim] float32 of the patches' rows and columns."""
        angles = torch.cat([layout.row[:, None].float() * self.inv_freq, layout.col[:, None].float() * self.inv_freq],
                           dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionOutput:
        """`pixel_values` [patches, patch_dim] of the images whose grids
        (t, h, w) are the rows of `grid_thw` [N, 3], in that order."""
        merge = self.cfg.spatial_merge_size
        grid = grid_thw.to("cpu", torch.long).reshape(-1, 3)
        if pixel_values.dim() != 2 or pixel_values.shape[1] != self.patch_dim:
            raise ValueError(f"pixel_values must be [patches, {self.patch_dim}], got {list(pixel_values.shape)}")
        if int(grid.prod(1).sum()) != pixel_values.shape[0] or bool((grid[:, 1:] % merge).any()):
            raise ValueError(f"grids {grid.tolist()} (sides multiples of {merge}) do not cover "
                             f"{pixel_values.shape[0]} patches")
        device = self.patch_embed.weight.device
        if not len(pixel_values):
            empty = torch.zeros(0, self.cfg.out_hidden_size, device=device, dtype=self.patch_embed.weight.dtype)
            return VisionOutput(embeds=empty, deepstack=empty.new_zeros(len(self.deepstack_mergers), *empty.shape))
        layout = PatchLayout.of(grid, merge, device)
        x = self.patch_embed(pixel_values.to(device, self.patch_embed.weight.dtype))
        x = x + self.positions(layout).to(x.dtype)
        cos, sin = self.rotary(layout)
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, layout)
            if i in self.deepstack_at:
                levels.append(self.deepstack_mergers[self.deepstack_at[i]](x))
        embeds = self.merger(x)
        deepstack = torch.stack(levels) if levels else embeds.new_zeros(0, *embeds.shape)
        return VisionOutput(embeds=embeds, deepstack=deepstack)


# the mergers' names: Qwen3-Omni's (`merger`, `merger_list.K`; `ln_q`, `mlp.0`, `mlp.2`) and Qwen3-VL's and
# Qwen3.5's (`merger`, `deepstack_merger_list.K`; `norm`, `linear_fc1`, `linear_fc2`)
_MERGER = re.compile(r"(merger|(?:deepstack_)?merger_list\.(\d+))\.(ln_q|mlp\.0|mlp\.2|norm|linear_fc1|linear_fc2)"
                     r"\.(weight|bias)")
_MERGER_PARTS = {"ln_q": "norm", "mlp.0": "fc1", "mlp.2": "fc2", "norm": "norm", "linear_fc1": "fc1",
                 "linear_fc2": "fc2"}


def _vision_target(local: str) -> str:
    """The encoder parameter that the checkpoint tensor `<prefix><local>` fills."""
    if local.startswith("patch_embed.proj."):
        return "patch_embed." + local[len("patch_embed.proj."):]
    merger = _MERGER.fullmatch(local)
    if merger is not None:
        head = "merger" if merger[2] is None else f"deepstack_mergers.{merger[2]}"
        return f"{head}.{_MERGER_PARTS[merger[3]]}.{merger[4]}"
    return local.replace(".mlp.linear_fc", ".fc")


def load_vision_encoder(encoder: VisionEncoder, folder: str | Path, prefix: str, what: str) -> None:
    """Fill `encoder` from the `<prefix>*` tensors of a folder transformers
    saved; a `ConfigError` (`what` names the encoder) names what is missing
    or left over."""
    def as_linear(name: str, tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        # the patch Conv3d's [out, C, T, P, P] kernel is the [out, C*T*P*P] linear map
        if name.endswith("patch_embed.proj.weight") and param.numel() == tensor.numel():
            return tensor.reshape(param.shape)
        return tensor

    fill_params(encoder, folder, prefix, what, _vision_target, as_linear)
