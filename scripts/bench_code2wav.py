"""Qwen3-Omni's code2wav streaming step (one frame a row), per batch size.

The 30B-A3B shape with random weights, rows continuing from per-row state
slots as the runtime runs them: median milliseconds per step eagerly and,
on CUDA, replayed from a CUDA graph; audio seconds per wall second. With
`--profile B`, the kernels of one graph replay at batch B by device time,
and the convolutions of an eager step by input shape.

    python scripts/bench_code2wav.py --device cpu --dtype float32 --batches 1 2
    python scripts/bench_code2wav.py --device cuda --batches 1 8 32 64 --profile 32
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_env import REPO, commit, timed  # noqa: E402

from mstar.models.qwen3_omni.builtins import QWEN3_OMNI_30B_A3B  # noqa: E402
from mstar.models.qwen3_omni.config import Qwen3OmniConfig  # noqa: E402
from mstar.models.qwen3_omni.speech.code2wav import Code2Wav  # noqa: E402
from mstar.types import StateRows  # noqa: E402


def build(device: torch.device, dtype: torch.dtype) -> Code2Wav:
    cfg = Qwen3OmniConfig.from_dict(QWEN3_OMNI_30B_A3B).code2wav
    torch.manual_seed(0)
    module = Code2Wav(cfg, device=device, dtype=dtype).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            # small weights keep activations finite through 30-odd layers; snake scales are logs
            p.copy_(torch.randn_like(p) * (0.02 if p.dim() > 1 else 0.01))
    return module


def state_pool(module: Code2Wav, rows: int, device: torch.device) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(rows + 1, *shape, dtype=dtype, device=device)
            for name, shape, dtype in module.state_spec().tensors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--cudnn-benchmark", action="store_true", help="let cuDNN time its algorithms per shape")
    parser.add_argument("--profile", type=int, default=0, metavar="B", help="kernel table at batch B (CUDA)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    module = build(device, dtype)
    cfg = module.cfg
    commit_id = commit(REPO)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"code2wav step, one frame a row: {name}, torch {torch.__version__}, {args.dtype}, commit {commit_id}"
          f"{', cudnn.benchmark' if args.cudnn_benchmark else ''}")
    frame_s = cfg.samples_per_frame / 24000
    top = max(args.batches)
    pool = state_pool(module, top, device)
    gen = torch.Generator(device=device).manual_seed(1)
    with torch.inference_mode():
        for b in args.batches:
            codes = torch.randint(0, cfg.codebook_size, (b, cfg.num_quantizers, 1), device=device, generator=gen)
            rows = StateRows(pool, torch.arange(b, device=device))
            fresh = torch.zeros(b, dtype=torch.bool, device=device)
            step = lambda: module.stream(codes, rows, fresh, zeroed=True)  # noqa: E731
            eager = timed(step, device, args.iters, warmup=3)
            line = f"batch {b:4d}: eager {eager:7.2f} ms"
            graph_ms = None
            if device.type == "cuda":
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    step()
                    step()
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    step()
                graph_ms = timed(graph.replay, device, args.iters)
                line += f", graph {graph_ms:7.2f} ms"
                if b == args.profile:
                    profile(graph.replay, step)
            best = graph_ms or eager
            print(f"{line}, {b * frame_s / (best / 1e3):7.1f} audio-s/s")


def profile(replay: Callable[[], None], step: Callable[[], object]) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            replay()
        torch.cuda.synchronize()
    print("kernels of 5 graph replays, by device time:")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=25, max_name_column_width=80))
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in ("aten::convolution",)]
    rows.sort(key=lambda e: -e.device_time_total)
    print("convolutions of one eager step, by device time (us, calls, input shapes):")
    for e in rows[:20]:
        print(f"  {e.device_time_total:9.1f} {e.count:3d} {e.input_shapes[:2]}")


if __name__ == "__main__":
    main()
