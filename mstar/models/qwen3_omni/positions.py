"""Where a Qwen3-Omni prompt's tokens sit: the audio encoder's token count for
a clip of mel frames, and the thinker's 3-axis M-RoPE positions (temporal,
height, width) for a prompt of text, audio and image placeholders, with the
rope delta its decode steps add.

Text and audio tokens advance all three axes by one. An image's tokens form
its merged grid (t, h / merge, w / merge): temporal `start + t * seconds`,
height `start + row`, width `start + col`; the next token starts one past the
largest position so far. Video (fractional temporal positions) is not here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar.errors import RequestError

MEL_CHUNK = 100      # mel frames the encoder's convolutions take at a time (1 s)
TOKENS_PER_CHUNK = 13  # what three stride-2 convolutions leave of a chunk


def audio_tokens(mel_frames: int) -> int:
    """Tokens the audio encoder makes of `mel_frames` frames: 13 per whole
    second, and the last part second through three stride-2 convolutions."""
    whole, rest = divmod(mel_frames, MEL_CHUNK)
    n = rest
    for _ in range(3):
        n = (n - 1) // 2 + 1 if n > 0 else 0
    return whole * TOKENS_PER_CHUNK + n


def mrope_positions(ids: Sequence[int], *, audio_id: int, image_id: int, audio_frames: Sequence[int] = (),
                    image_grids: Sequence[tuple[int, int, int]] = (), spatial_merge: int = 2,
                    per_second: int = 13) -> tuple[torch.Tensor, int]:
    """[3, len(ids)] positions and the rope delta (the next position minus the
    prompt's length). Each run of `audio_id` is the next clip of
    `audio_frames` (mel frames), each run of `image_id` the next grid of
    `image_grids` (t, h, w in patches); a run must hold the tokens its clip
    or grid makes, else `RequestError` (field "input")."""
    rows: list[torch.Tensor] = []
    start, i, clip, image = 0, 0, 0, 0
    while i < len(ids):
        j = i
        while j < len(ids) and ids[j] == ids[i]:
            j += 1
        if ids[i] == audio_id:
            if clip == len(audio_frames):
                raise RequestError(f"the prompt has more audio placeholders than the {len(audio_frames)} clips",
                                   field="input")
            n = audio_tokens(audio_frames[clip])
            if j - i != n:
                raise RequestError(f"audio {clip} makes {n} tokens, but its placeholder run has {j - i}",
                                   field="input")
            clip += 1
            rows.append(torch.arange(start, start + n).expand(3, n))
        elif ids[i] == image_id:
            if image == len(image_grids):
                raise RequestError(f"the prompt has more image placeholders than the {len(image_grids)} images",
                                   field="input")
            t, h, w = image_grids[image]
            gh, gw = h // spatial_merge, w // spatial_merge
            if j - i != t * gh * gw:
                raise RequestError(f"image {image} makes {t * gh * gw} tokens, but its placeholder run has {j - i}",
                                   field="input")
            image += 1
            tt = (torch.arange(t) * per_second).repeat_interleave(gh * gw)
            hh = torch.arange(gh).repeat_interleave(gw).repeat(t)
            ww = torch.arange(gw).repeat(t * gh)
            rows.append(torch.stack([tt, hh, ww]) + start)
        else:  # text: one position per token
            rows.append(torch.arange(start, start + j - i).expand(3, j - i))
        start = int(rows[-1].max()) + 1
        i = j
    if clip != len(audio_frames) or image != len(image_grids):
        raise RequestError(f"{len(audio_frames) - clip} audio clips and {len(image_grids) - image} images have no "
                           "placeholders in the prompt", field="input")
    positions = torch.cat(rows, dim=1) if rows else torch.zeros(3, 0, dtype=torch.long)
    return positions, start - len(ids)
