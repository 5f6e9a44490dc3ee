"""Audio at one sample rate in, the same audio at another out: a polyphase
windowed-sinc resampler in numpy.

The rate ratio is reduced to up/down (44.1 kHz -> 16 kHz: 160/441). The
signal is, in effect, upsampled by `up` (zeros between samples), low-passed
at the lower of the two Nyquist rates and kept every `down`th sample; the
polyphase form computes only the kept samples, each from the one sub-filter
(`up` of them) its position falls on, so the work is about 20 taps per output
sample per `max(up, down) / up`, whatever the ratio.

The filter is a Kaiser-windowed sinc (beta 5, 10 zero crossings of the
lower-rate sinc either side), the same design `scipy.signal.resample_poly`
uses by default, so the two agree to float32 rounding; its output is
`ceil(len * up / down)` samples aligned with the input's first one.
"""

from __future__ import annotations

import functools
import math

import numpy as np

KAISER_BETA = 5.0
ZERO_CROSSINGS = 10   # of the lower rate's sinc, each side of the centre tap
_ROWS = 1 << 14       # output samples of one sub-filter computed per matrix product (bounds the temporary)


@functools.lru_cache(maxsize=16)
def _bank(up: int, down: int) -> tuple[np.ndarray, int]:
    """The filter split into its `up` phases, [up, taps] float32 (phase p holds
    taps p, p + up, p + 2up, ..., zero-padded), and the filter's centre tap."""
    width = max(up, down)
    half = ZERO_CROSSINGS * width
    n = np.arange(2 * half + 1) - half
    cutoff = 1.0 / width  # of the upsampled rate's Nyquist: the lower rate's Nyquist
    h = cutoff * np.sinc(cutoff * n) * np.kaiser(2 * half + 1, KAISER_BETA)
    h *= up / h.sum()  # unit gain at DC once the zeros between input samples are counted
    taps = -(-h.size // up)
    padded = np.zeros(taps * up)
    padded[:h.size] = h
    return padded.reshape(taps, up).T.astype(np.float32).copy(), half


def resample(x: np.ndarray, src: int, dst: int) -> np.ndarray:
    """Mono audio `x` at `src` Hz as float32 at `dst` Hz."""
    if src <= 0 or dst <= 0:
        raise ValueError(f"sample rates must be positive, got {src} and {dst}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"resample takes mono audio, got shape {x.shape}")
    if src == dst:
        return x.copy()
    g = math.gcd(src, dst)
    up, down = dst // g, src // g
    bank, half = _bank(up, down)
    taps = bank.shape[1]
    n_out = -(-x.size * up // down)
    out = np.empty(n_out, dtype=np.float32)
    if n_out == 0:
        return out
    # Output k reads sub-filter p = (k*down + half) % up against input samples
    # i0, i0 - 1, ..., i0 - taps + 1 with i0 = (k*down + half) // up; outputs
    # k, k + up, k + 2up, ... share p, and their i0 step by `down`.
    last_i0 = ((n_out - 1) * down + half) // up
    lead = taps - 1
    xp = np.zeros(lead + max(x.size, last_i0 + 1), dtype=np.float32)
    xp[lead:lead + x.size] = x
    step = xp.strides[0]
    inverse = pow(down, -1, up) if up > 1 else 0
    for p in range(up):
        first = ((p - half) * inverse) % up  # the first output on phase p
        if first >= n_out:
            continue
        i0 = (first * down + half) // up
        rows = (n_out - 1 - first) // up + 1
        reversed_taps = bank[p, ::-1]
        for r0 in range(0, rows, _ROWS):
            r = min(_ROWS, rows - r0)
            start = i0 + r0 * down  # in xp's numbering that is lead + start - (taps - 1)
            windows = np.lib.stride_tricks.as_strided(xp[start:], shape=(r, taps), strides=(down * step, step),
                                                      writeable=False)
            out[first + r0 * up:first + (r0 + r) * up:up] = windows @ reversed_taps
    return out
