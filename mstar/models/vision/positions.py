"""Where a multimodal prompt's tokens sit: its ids, with runs of image (and,
for Qwen3-Omni, audio) placeholders, in; the decoder's 3-axis M-RoPE
positions (temporal, height, width) and the rope delta its decode steps add,
out. Qwen3-VL's scheme, which Qwen3-Omni and Qwen3.5 share.

Text and audio tokens advance all three axes by one. An image's tokens form
its merged grid (t, h / merge, w / merge): temporal `start + t * per_second`,
height `start + row`, width `start + col`; the next token starts one past the
largest position so far (for a picture, t = 1: `start + max(h, w) / merge`).
Video (fractional temporal positions) is not here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar.errors import RequestError

NOT_A_TOKEN = -1  # a placeholder id no prompt holds: a prompt without that kind of media


def prompt_positions(ids: Sequence[int], *, image_id: int, image_grids: Sequence[tuple[int, int, int]] = (),
                     spatial_merge: int = 2, per_second: int = 1, audio_id: int = NOT_A_TOKEN,
                     audio_lengths: Sequence[int] = (), field: str = "input") -> tuple[torch.Tensor, int]:
    """[3, len(ids)] positions and the rope delta (the next position minus the
    prompt's length). Each run of `image_id` is the next grid of
    `image_grids` (t, h, w in patches), each run of `audio_id` the next clip,
    of `audio_lengths` tokens; a run must hold the tokens its grid or clip
    makes, else `RequestError` naming `field`: the request's input the ids
    came from, so a client that typed placeholder ids is told which."""
    rows: list[torch.Tensor] = []
    start, i, clip, image = 0, 0, 0, 0
    while i < len(ids):
        j = i
        while j < len(ids) and ids[j] == ids[i]:
            j += 1
        if ids[i] == audio_id:
            if clip == len(audio_lengths):
                raise RequestError(f"the prompt has more audio placeholders than the {len(audio_lengths)} clips",
                                   field=field)
            n = audio_lengths[clip]
            if j - i != n:
                raise RequestError(f"audio {clip} makes {n} tokens, but its placeholder run has {j - i}",
                                   field=field)
            clip += 1
            rows.append(torch.arange(start, start + n).expand(3, n))
        elif ids[i] == image_id:
            if image == len(image_grids):
                raise RequestError(f"the prompt has more image placeholders than the {len(image_grids)} images",
                                   field=field)
            t, h, w = image_grids[image]
            gh, gw = h // spatial_merge, w // spatial_merge
            if j - i != t * gh * gw:
                raise RequestError(f"image {image} makes {t * gh * gw} tokens, but its placeholder run has {j - i}",
                                   field=field)
            image += 1
            tt = (torch.arange(t) * per_second).repeat_interleave(gh * gw)
            hh = torch.arange(gh).repeat_interleave(gw).repeat(t)
            ww = torch.arange(gw).repeat(t * gh)
            rows.append(torch.stack([tt, hh, ww]) + start)
        else:  # text: one position per token
            rows.append(torch.arange(start, start + j - i).expand(3, j - i))
        start = int(rows[-1].max()) + 1
        i = j
    if clip != len(audio_lengths) or image != len(image_grids):
        raise RequestError(f"{len(audio_lengths) - clip} audio clips and {len(image_grids) - image} images have no "
                           "placeholders in the prompt", field=field)
    positions = torch.cat(rows, dim=1) if rows else torch.zeros(3, 0, dtype=torch.long)
    return positions, start - len(ids)
