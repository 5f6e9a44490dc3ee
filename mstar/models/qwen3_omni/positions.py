"""Where a Qwen3-Omni prompt's tokens sit: the audio encoder's token count for
a clip of mel frames, and the thinker's 3-axis M-RoPE positions (temporal,
height, width) for a prompt of text, audio and image placeholders, with the
rope delta its decode steps add (`vision/positions.py` lays them out; an
image's temporal positions advance `position_id_per_seconds` a frame).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar.models.vision.positions import prompt_positions

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
                    per_second: int = 13, field: str = "input") -> tuple[torch.Tensor, int]:
    """[3, len(ids)] positions and the rope delta, as `prompt_positions`
    places them, each run of `audio_id` the next clip of `audio_frames`
    (mel frames) and each run of `image_id` the next grid of `image_grids`;
    a refusal names `field`."""
    return prompt_positions(ids, image_id=image_id, image_grids=image_grids, spatial_merge=spatial_merge,
                            per_second=per_second, audio_id=audio_id,
                            audio_lengths=[audio_tokens(f) for f in audio_frames], field=field)
