"""The delta net's fused decode update (`kernels.delta_step.recurrent_step`)
on the GPU machine at one layer of Qwen3.5-9B's shape: time per call and the
bandwidth it reaches (the rows' states read and written once) for each
block of state columns a program covers and its warps.

    python scripts/probe_delta_decode.py --rows 1 64 256
"""

from __future__ import annotations

import argparse

import torch

from mstar.kernels import delta_step

HK, HV, DK, DV = 16, 32, 128, 128


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    dev = torch.device("cuda:0")
    print(f"# {torch.cuda.get_device_name(0)} | torch {torch.__version__} | one layer, Hk {HK} Hv {HV} Dk {DK} Dv {DV}")
    print(f"{'rows':>5} {'block_v':>8} {'warps':>6} {'us':>8} {'GB/s':>8}")
    for rows in args.rows:
        q, k = (torch.randn(rows, HK, DK, device=dev, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(rows, HV, DV, device=dev, dtype=torch.bfloat16)
        a, b = (torch.randn(rows, HV, device=dev, dtype=torch.bfloat16) for _ in range(2))
        a_log, dt_bias = torch.zeros(HV, device=dev), torch.ones(HV, device=dev)
        state = torch.zeros(rows + 1, HV, DK, DV, device=dev)
        slots = torch.arange(rows, device=dev)
        moved = 2 * rows * HV * DK * DV * 4
        for block_v in (16, 32, 64):
            for warps in (2, 4, 8):
                def call() -> None:
                    delta_step.recurrent_step(q, k, v, a, b, a_log, dt_bias, state, slots, torch.bfloat16,
                                              block_v=block_v, warps=warps)
                for _ in range(3):
                    call()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.iters):
                    call()
                end.record()
                torch.cuda.synchronize()
                us = start.elapsed_time(end) / args.iters * 1e3
                print(f"{rows:5d} {block_v:8d} {warps:6d} {us:8.1f} {moved / us / 1e3:8.0f}", flush=True)


if __name__ == "__main__":
    main()
