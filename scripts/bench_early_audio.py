"""How far `early_audio`'s first frame is from the full window's, through the
snac reference package (24 kHz configuration, CPU).

Orpheus plays frame 1 of a stream from the window of frames 0-3 (two frames
of right context); `early_audio` (`PlayedWindows(first=2)`) plays it from the
window of frames 0-1, 14 tokens into the stream instead of 28. For random
codes, both windows are decoded by `snac.SNAC.decode` and frame 1's 2048
samples compared: relative L2 difference, over the frame and its halves.
The decoder's noise blocks are bypassed, so the difference is the missing
right context alone. With `--weights` (a local snac checkpoint folder's
`pytorch_model.bin`) the trained decoder is measured; without it, random
weights, which say little of how it sounds.

    python scripts/bench_early_audio.py [--seeds 8] [--weights /path/to/snac_24khz/pytorch_model.bin]
"""

from __future__ import annotations

import argparse
import platform

import torch
from snac import SNAC

from bench_env import REPO, commit

FRAME = 2048  # samples a coarse code decodes to at 24 kHz


def decoder(weights: str | None) -> SNAC:
    torch.manual_seed(0)
    model = SNAC(sampling_rate=24000, encoder_dim=48, encoder_rates=[4, 4, 8, 8], decoder_dim=1024,
                 decoder_rates=[8, 8, 4, 4], attn_window_size=None, codebook_size=4096, codebook_dim=8,
                 vq_strides=[4, 2, 1], noise=True, depthwise=True).eval()
    if weights:
        model.load_state_dict(torch.load(weights, map_location="cpu"))
    for module in model.modules():
        if type(module).__name__ == "NoiseBlock":
            module.forward = lambda x: x   # the same samples from both windows but for the context
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--weights", default=None)
    a = p.parse_args()
    print(f"# python {platform.python_version()} | torch {torch.__version__} | mstar {commit(REPO)} | "
          f"snac decoder, {'weights ' + a.weights if a.weights else 'random weights'}, noise bypassed")
    model = decoder(a.weights)
    total = []
    for seed in range(a.seeds):
        g = torch.Generator().manual_seed(seed)
        codes = [torch.randint(0, 4096, (1, 4 * k), generator=g) for k in (1, 2, 4)]   # 4 frames
        with torch.no_grad():
            full = model.decode(codes)[0, 0, FRAME:2 * FRAME]
            early = model.decode([c[:, :c.shape[1] // 2] for c in codes])[0, 0, FRAME:2 * FRAME]
        diff = early - full
        rel = (diff.norm() / full.norm()).item()
        halves = [(diff[h].norm() / full[h].norm()).item() for h in (slice(0, FRAME // 2), slice(FRAME // 2, None))]
        total.append(rel)
        print(f"seed {seed}: frame 1 relative L2 {rel:.4f} (first half {halves[0]:.4f}, second {halves[1]:.4f}); "
              f"max |diff| {diff.abs().max():.4f} of max |sample| {full.abs().max():.4f}")
    print(f"mean relative L2 over {a.seeds} seeds: {sum(total) / len(total):.4f}")


if __name__ == "__main__":
    main()
