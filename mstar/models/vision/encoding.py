"""The vision encoder as the runtime steps it, component `vision`, mode
`encode`: a batch of requests' images in (each request's patches one after
another, `pixels` [patches, patch dim], with its grids [images, 3], ragged
over requests); all of them go through the encoder in one call, and each
request's rows of the decoder's width come out in its placeholders' order
(`rows` [tokens, H]), with, where the encoder has deepstack levels, each
token's deepstack features (`deepstack` [tokens, levels, H]).
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.graph import Component, In, Kind, Mode, Out
from mstar.models.vision.encoder import VisionEncoder


def vision_component(deepstack: bool) -> Component:
    """The `vision` component; `deepstack`: its step also writes the deepstack
    features. The grids lay the batch out in Python: on the host."""
    outputs = (Out("rows", Kind.TENSOR),) + ((Out("deepstack", Kind.TENSOR),) if deepstack else ())
    return Component(modes=(Mode("encode", (In("pixels", Kind.TENSOR, ragged=True),
                                            In("grids", Kind.TENSOR, ragged=True, host=True)), outputs),))


class VisionEncoding(nn.Module):
    """Component `vision`, mode `encode`."""

    def __init__(self, encoder: VisionEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def encode(self, pixels: list[torch.Tensor], grids: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        grid = torch.cat([g.reshape(-1, 3) for g in grids]).cpu()
        out = self.encoder(torch.cat(pixels), grid)
        merge = self.encoder.cfg.spatial_merge_size ** 2
        counts = [int(g.reshape(-1, 3).prod(-1).sum()) // merge for g in grids]
        rows = {"rows": list(out.embeds.split(counts))}
        if self.encoder.cfg.deepstack_visual_indexes:
            deep = out.deepstack.transpose(0, 1)  # [tokens, levels, H]: the rows the decoder splices at a token
            rows["deepstack"] = list(deep.split(counts))
        return rows
