"""SNAC 24 kHz window decode time, per batch size, on one device.

Windows of `--frames` coarse frames (4: one Orpheus window of 28 tokens,
8192 samples) with random codes, decoded by mstar's SnacDecoder (dummy
weights, per-row seeded noise) eagerly and, on CUDA, replayed from a CUDA
graph; with `--package`, also by `snac.SNAC.decode` with the same weights'
shapes (random init). With `--play`, only the second frame of each window,
as Orpheus plays it (the decoder computes what those samples depend on).
Prints one line per batch size: median milliseconds per call and audio
seconds a listener gets per wall second (a window's whole length, or with
`--play` its one played frame).

    python scripts/bench_snac.py --device cpu --batches 1 16
    python scripts/bench_snac.py --device cuda --batches 1 16 64 --graphs --package
"""

from __future__ import annotations

import argparse

import torch
from bench_env import timed

from mstar.models.snac import SNAC_24KHZ, load_snac_decoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--play", action="store_true",
                        help="decode only the second frame, as an Orpheus window plays it (SnacDecoder's play span)")
    parser.add_argument("--modules", action="store_true",
                        help="run the residual units as modules "
                             "(on CUDA the default fuses them: kernels/codec/snake_unit.py)")
    parser.add_argument("--graphs", action="store_true", help="also time a CUDA graph replay (CUDA only)")
    parser.add_argument("--package", action="store_true", help="also time snac.SNAC.decode")
    parser.add_argument("--profile", action="store_true",
                        help="after the timings, the kernels of eager calls at the largest batch, by device time")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cfg = SNAC_24KHZ
    decoder = load_snac_decoder(None, load_format="dummy", device=device, dtype=dtype)
    reference = None
    if args.package:
        import snac

        reference = snac.SNAC(**cfg.to_dict()).eval().to(device=device, dtype=dtype)
    audio_s = args.frames * cfg.samples_per_coarse_frame / cfg.sampling_rate
    spf = cfg.samples_per_coarse_frame
    play = (spf, 2 * spf) if args.play else None
    heard_s = spf / cfg.sampling_rate if play else audio_s   # what a window gives a listener
    fused = False if args.modules else None
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"{args.dtype}, {torch.get_num_threads()} threads, window of {args.frames} coarse frames "
          f"({audio_s * 1e3:.0f} ms of audio){', playing its second frame' if play else ''}"
          f"{', residual units as modules' if args.modules else ''}")
    for batch in args.batches:
        gen = torch.Generator().manual_seed(batch)
        codes = [torch.randint(0, cfg.codebook_size, (batch, n), generator=gen).to(device)
                 for n in cfg.level_lengths(args.frames)]
        seeds = torch.arange(batch, device=device)
        with torch.inference_mode():
            eager = timed(lambda c=codes, s=seeds: decoder.decode(c, seeds=s, play=play, fused=fused), device,
                          args.iters)
            line = f"batch {batch:3d}: eager {eager:8.2f} ms ({batch * heard_s / eager * 1e3:7.1f} audio-s/s)"
            if args.graphs and device.type == "cuda":
                graph = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):   # warm up off the default stream before capture
                    for _ in range(2):
                        decoder.decode(codes, seeds=seeds, play=play, fused=fused)
                torch.cuda.current_stream(device).wait_stream(stream)
                with torch.cuda.graph(graph):
                    out = decoder.decode(codes, seeds=seeds, play=play, fused=fused)
                replay = timed(graph.replay, device, args.iters)
                eager_out = decoder.decode(codes, seeds=seeds, play=play, fused=fused)
                graph.replay()
                diff = (out - eager_out).abs().max().item()
                line += f" | graph {replay:7.2f} ms ({batch * heard_s / replay * 1e3:7.1f} audio-s/s, " \
                        f"max |graph - eager| {diff:.1e})"
            if reference is not None:
                package = timed(lambda c=codes: reference.decode(c), device, args.iters)
                line += f" | snac package {package:8.2f} ms"
        print(line, flush=True)
    if args.profile:
        profile_kernels(decoder, cfg, args.frames, max(args.batches), device, play, fused)


def profile_kernels(decoder: torch.nn.Module, cfg, frames: int, batch: int, device: torch.device,
                    play: tuple[int, int] | None, fused: bool | None) -> None:
    """Torch's profiler over three eager window decodes of `batch` rows: its
    table of operators by device time, so the codec's largest kernels show."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(0)
    codes = [torch.randint(0, cfg.codebook_size, (batch, n), generator=gen).to(device)
             for n in cfg.level_lengths(frames)]
    seeds = torch.arange(batch, device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.inference_mode():
        decoder.decode(codes, seeds=seeds, play=play, fused=fused)
        with profile(activities=activities) as prof:
            for _ in range(3):
                decoder.decode(codes, seeds=seeds, play=play, fused=fused)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"profile: three eager decodes of {batch} windows, by {key}")
    print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
