"""Log-mel features for Qwen3-Omni's audio encoder: mono float 16 kHz
waveforms in (a batch of clips of any lengths, on any device), per clip a
float32 [n_mels, frames] spectrogram out, as the model's Whisper feature
extractor makes it for that clip alone.

A clip of L samples gives L // 160 frames (100 a second): a 400-point
periodic Hann STFT every 160 samples over the clip reflect-padded by 200 at
each end, its last frame dropped; power through a Slaney mel filter bank
(0-8 kHz); log10 floored at 1e-10, then at the clip's maximum minus 8; and
(x + 4) / 4. The processor pads the clips of one call to the longest with
zeros, which gives a shorter clip other frames at its end (and one more when
its length is not a multiple of 160); here every clip is its own, so a clip's
features never depend on what it is batched with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mstar.errors import RequestError

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160
MIN_SAMPLES = N_FFT // 2 + 1   # the reflect padding needs more samples than it adds

Device = torch.device | str | None


def mel_frames(samples: int) -> int:
    """Valid mel frames of a clip of `samples` samples (the processor's
    attention-mask sum for that clip alone)."""
    return samples // HOP


def _hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    """Slaney's mel scale: linear to 1 kHz, logarithmic above."""
    linear = hz * 3.0 / 200.0
    log = 15.0 + torch.log(hz.clamp(min=1e-12) / 1000.0) * (27.0 / math.log(6.4))
    return torch.where(hz >= 1000.0, log, linear)


def _mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    linear = mel * 200.0 / 3.0
    log = 1000.0 * torch.exp((mel - 15.0) * (math.log(6.4) / 27.0))
    return torch.where(mel >= 15.0, log, linear)


def mel_filters(n_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE,
                max_hz: float = 8000.0) -> torch.Tensor:
    """[n_fft // 2 + 1, n_mels] triangular filters, evenly spaced on the
    Slaney mel scale from 0 Hz to `max_hz`, each scaled to unit area
    (Slaney's norm). Built in float64 and returned as float32."""
    bins = torch.linspace(0.0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    edges = _mel_to_hz(torch.linspace(0.0, float(_hz_to_mel(torch.tensor(max_hz, dtype=torch.float64))), n_mels + 2,
                                      dtype=torch.float64))
    lo, mid, hi = edges[:-2], edges[1:-1], edges[2:]
    rising = (bins[:, None] - lo) / (mid - lo)
    falling = (hi - bins[:, None]) / (hi - mid)
    tri = torch.minimum(rising, falling).clamp(min=0.0)
    return (tri * (2.0 / (hi - lo))).float()


class LogMel:
    """The feature extractor on `device`; call it with a list of clips."""

    def __init__(self, n_mels: int = 128, *, device: Device = None) -> None:
        self.n_mels = n_mels
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.filters = mel_filters(n_mels).to(self.device)
        self.window = torch.hann_window(N_FFT, device=self.device)

    def __call__(self, clips: Sequence[torch.Tensor], fields: Sequence[str] | None = None) -> list[torch.Tensor]:
        """Per clip (1-D samples at 16 kHz) its features [n_mels, L // 160],
        float32 on this extractor's device. `fields` names each clip in the
        request (default `audio[i]`); a clip that is not 1-D, has fewer than
        201 samples or a sample that is not finite is a `RequestError` naming
        its field."""
        names = list(fields) if fields is not None else [f"audio[{i}]" for i in range(len(clips))]
        if len(names) != len(clips):
            raise ValueError(f"{len(clips)} clips but {len(names)} field names")
        if not clips:
            return []
        for clip, name in zip(clips, names):
            self._check_shape(clip, name)
        flat = torch.cat([c.to(self.device, torch.float32) for c in clips])
        if not bool(torch.isfinite(flat).all()):
            for clip, name in zip(clips, names):
                if not bool(torch.isfinite(clip).all()):
                    raise RequestError("audio has a sample that is not a finite number (NaN or infinity)",
                                       field=name)
        lengths = torch.tensor([c.numel() for c in clips], device=self.device)
        frames = [mel_frames(c.numel()) for c in clips]
        signal = self._reflect_padded(flat, lengths)
        spec = torch.stft(signal, N_FFT, HOP, window=self.window, center=False, return_complex=True)
        power = spec[..., :max(frames)].abs() ** 2                       # [B, bins, F]
        logmel = torch.matmul(self.filters.T, power).clamp(min=1e-10).log10()  # [B, n_mels, F]
        valid = torch.arange(logmel.shape[-1], device=self.device) < (lengths // HOP)[:, None]
        top = logmel.masked_fill(~valid[:, None, :], -torch.inf).amax(dim=(1, 2), keepdim=True)
        logmel = (torch.maximum(logmel, top - 8.0) + 4.0) / 4.0
        return [logmel[i, :, :n] for i, n in enumerate(frames)]

    def _reflect_padded(self, flat: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, max L + N_FFT]: each clip reflect-padded by N_FFT / 2 at both
        ends (without repeating the edge sample), gathered from the
        concatenated clips in one indexing; what lies past a shorter clip's
        padded end only feeds frames that are dropped."""
        pad = N_FFT // 2
        starts = torch.cumsum(lengths, 0) - lengths
        pos = (torch.arange(int(lengths.max()) + 2 * pad, device=self.device) - pad).abs()[None, :]
        last = (lengths - 1)[:, None]
        pos = torch.where(pos > last, 2 * last - pos, pos).clamp(min=0)
        return flat[starts[:, None] + pos]

    def _check_shape(self, clip: torch.Tensor, field: str) -> None:
        if clip.dim() != 1:
            raise RequestError(f"audio must be one channel of samples, got shape {list(clip.shape)}", field=field)
        if not clip.dtype.is_floating_point:
            raise RequestError(f"audio samples must be floats, got {clip.dtype}", field=field)
        if clip.numel() == 0:
            raise RequestError("audio is empty", field=field)
        if clip.numel() < MIN_SAMPLES:
            # the count after resampling to 16 kHz: a duration reads the same whatever rate was sent
            raise RequestError(f"audio is {1000 * clip.numel() / SAMPLE_RATE:.3g} ms long ({clip.numel()} samples "
                               f"at 16 kHz); at least {1000 * MIN_SAMPLES / SAMPLE_RATE:.3g} ms ({MIN_SAMPLES} "
                               "samples) are needed", field=field)
