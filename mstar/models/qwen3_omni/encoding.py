"""The audio encoder as the runtime steps it: a batch of requests' clips in
(each request's packed in one tensor, ragged over requests), each request's
thinker-width rows out, in its placeholders' order. (Images go through the
shared `vision/encoding.py`, with their deepstack features.)

A request's clips travel as `mel` [clips, mel bins, longest clip's frames]
with `frames` [clips]; each clip is cut back to its own frames here, and all
clips of all requests go through the encoder in one call.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.models.qwen3_omni.encoders.audio import AudioEncoder
from mstar.models.qwen3_omni.positions import audio_tokens


def pack_clips(mels: list[torch.Tensor], mel_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's clips [mel bins, frames_i] as one padded tensor and their
    frame counts (none: a turn of text where the walk takes audio)."""
    longest = max((m.shape[1] for m in mels), default=1)
    packed = torch.zeros(len(mels), mel_bins, longest, dtype=mels[0].dtype if mels else torch.float32)
    for i, m in enumerate(mels):
        packed[i, :, :m.shape[1]] = m
    return packed, torch.tensor([m.shape[1] for m in mels], dtype=torch.long)


class AudioEncoding(nn.Module):
    """Component `audio`, mode `encode`."""

    def __init__(self, encoder: AudioEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def encode(self, mel: list[torch.Tensor], frames: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        clips, per_request = [], []
        for m, f in zip(mel, frames):
            counts = f.reshape(-1).tolist()
            clips += [m[i, :, :n] for i, n in enumerate(counts)]
            per_request.append(len(counts))
        weight = next(self.encoder.parameters())
        if not clips:  # turns of text only
            empty = torch.zeros(0, self.encoder.cfg.output_dim, dtype=weight.dtype, device=weight.device)
            return {"rows": [empty for _ in per_request]}
        rows = self.encoder([c.to(weight.dtype) for c in clips])
        tokens = [audio_tokens(c.shape[1]) for c in clips]
        by_clip = list(rows.split(tokens))
        out, at = [], 0
        for n in per_request:
            out.append(torch.cat(by_clip[at:at + n]) if n else rows[:0])
            at += n
        return {"rows": out}
