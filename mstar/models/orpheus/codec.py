"""OrpheusCodec, the `codec` component: windows of audio token ids in, the
new 24 kHz samples of each window out, through the SNAC decoder.

A full window is 28 tokens, 4 frames of 2048 samples (SNAC 24 kHz: hop 512,
and the coarsest level has one code per 4 hops). Like Orpheus's decoder
(decoder.py: audio_hat[:, :, 2048:4096]) it returns only the second frame:
the first is left context, the last two right context, and the stream moves
one frame per window, so consecutive windows play consecutive frames.
SNAC computes only what the played samples depend on (`SnacDecoder.synthesize`'s
`play`): the same samples as slicing the whole window's decode.

The stream's last window is shorter (`PlayedWindows.flush`: the next window
cut short at the end of the stream). Nothing will come after it, so it plays
from its second frame to the end of its last whole frame: the frames that
earlier windows held only as right context are heard too, and no audio is
lost after the last full window. A window with fewer than 2 whole frames has
nothing after its first frame and returns [B, 0]. Across a stream the client
gets every whole frame but the first, 2048 samples each.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.models.orpheus.tokens import FRAME_TOKENS, tokens_to_codes

WINDOW_FRAMES = 4
WINDOW_TOKENS = WINDOW_FRAMES * FRAME_TOKENS  # 28


class OrpheusCodec(nn.Module):
    """`snac`: a SNAC decoder with `decode(codes: list[Tensor]) -> [B, 1, S]`.
    `samples_per_frame`: samples one frame (one coarse code) decodes to."""

    def __init__(self, snac: nn.Module, samples_per_frame: int) -> None:
        super().__init__()
        self.snac = snac
        self.samples_per_frame = samples_per_frame

    @torch.no_grad()
    def window(self, tokens: torch.Tensor, seeds: torch.Tensor | None = None) -> torch.Tensor:
        """Audio token ids [B, L] (int64, frame-aligned) -> float32 samples
        [B, S]: S = 2048 for a full window (L = 28), (L // 7 - 1) * 2048 for
        a shorter last window, 0 when it has fewer than 2 whole frames.
        Out-of-range codes are clamped (`tokens_to_codes`). `seeds` [B]: the
        SNAC noise of each row (the runtime passes one per request and
        window, so a request's audio does not depend on its batch); None:
        the global generator."""
        rows, length = tokens.shape
        frames = length // FRAME_TOKENS
        spf = self.samples_per_frame
        if frames < 2:
            return torch.zeros(rows, 0, dtype=torch.float32, device=tokens.device)
        end = 2 * spf if length == WINDOW_TOKENS else frames * spf
        # only the played samples and what they depend on: the same samples, a third of the work
        audio = self.snac.decode(tokens_to_codes(tokens), seeds=seeds, play=(spf, end))[:, 0]
        return audio.float().contiguous()
