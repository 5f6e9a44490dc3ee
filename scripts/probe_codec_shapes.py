"""What an eager SNAC window costs the first time its shape is seen, and after.

A stream's last Orpheus window is shorter than a full one (2 or 3 frames
instead of 4), and several streams ending in one step stack into a batch of
any size, so eager windows come in shapes the process has not run before.
This prints the wall time (synchronised) of each call in a sequence of
(batch, frames) shapes, repeats included, with cuDNN on and off, so a
per-shape first-call cost shows as the difference between a shape's first
and second call.

    python scripts/probe_codec_shapes.py
"""

from __future__ import annotations

import argparse
import time

import torch

from mstar.models.snac import SNAC_24KHZ, load_snac_decoder

SHAPES = ((1, 3), (1, 3), (2, 3), (2, 3), (1, 2), (1, 2), (3, 2), (5, 3), (5, 3), (1, 4), (7, 4), (7, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg = SNAC_24KHZ
    decoder = load_snac_decoder(None, load_format="dummy", device=device, dtype=torch.float32)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"device {device}, torch {torch.__version__}, cudnn "
          f"{torch.backends.cudnn.version() if device.type == 'cuda' else '-'}")
    for cudnn in (True, False):
        torch.backends.cudnn.enabled = cudnn
        times = []
        for batch, frames in SHAPES:
            # lengths shifted per pass so the second pass sees new shapes too
            frames += 0 if cudnn else 4
            codes = [torch.randint(0, cfg.codebook_size, (batch, n), device=device) for n in cfg.level_lengths(frames)]
            seeds = torch.arange(batch, device=device)
            sync()
            t = time.perf_counter()
            with torch.inference_mode():
                decoder.decode(codes, seeds=seeds)
            sync()
            times.append(f"({batch},{frames}) {1e3 * (time.perf_counter() - t):.1f}")
        print(f"cudnn {'on ' if cudnn else 'off'}: ms per call: " + ", ".join(times), flush=True)


if __name__ == "__main__":
    main()
