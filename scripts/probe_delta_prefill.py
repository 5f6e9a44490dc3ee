"""A gated delta net's prompt pass on the GPU machine: mstar's torch chunked
delta rule (`kernels.delta_rule.chunked_delta_rule`, one row at a time)
against fla-core's Triton `chunk_gated_delta_rule` (if installed), at one
layer of Qwen3.5-9B's shape; time per layer and the largest difference of
outputs and final states from float32 recurrence-equal references.

    python scripts/probe_delta_prefill.py --tokens 512 4096 --rows 1 8
"""

from __future__ import annotations

import argparse
import time

import torch

from mstar.kernels import delta_rule

HK, HV, DK, DV = 16, 32, 128, 128


def _inputs(rows: int, n: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=dev).manual_seed(rows * 10_000 + n)
    q = torch.randn(rows, n, HK, DK, device=dev, generator=gen, dtype=torch.bfloat16)
    k = torch.randn(rows, n, HK, DK, device=dev, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(rows, n, HV, DV, device=dev, generator=gen, dtype=torch.bfloat16)
    a = torch.randn(rows, n, HV, device=dev, generator=gen, dtype=torch.bfloat16)
    b = torch.randn(rows, n, HV, device=dev, generator=gen, dtype=torch.bfloat16)
    s0 = torch.randn(rows, HV, DK, DV, device=dev, generator=gen) * 0.1
    return q, k, v, a, b, s0


def _timed(fn, repeat: int = 5) -> tuple[float, object]:
    out = fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeat * 1e3, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = p.parse_args()
    dev = torch.device("cuda:0")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        chunk_gated_delta_rule = None
        print(f"# fla-core not importable: {e}")
    a_log = torch.empty(HV, device=dev).uniform_(0, 2.7)
    dt_bias = torch.ones(HV, device=dev)
    print(f"# {torch.cuda.get_device_name(0)} | torch {torch.__version__} | one layer, Hk {HK} Hv {HV} Dk {DK} Dv {DV}")
    print(f"{'rows':>5} {'tokens':>7} {'mstar ms':>9} {'fla ms':>8} {'max |out diff|':>15} {'max |state diff|':>17}")
    for rows in args.rows:
        for n in args.tokens:
            q, k, v, a, b, s0 = _inputs(rows, n, dev)
            g, beta = delta_rule.gates(a, b, a_log, dt_bias)
            groups = HV // HK
            qn = delta_rule._l2norm(q).repeat_interleave(groups, dim=2) * DK ** -0.5
            kn = delta_rule._l2norm(k).repeat_interleave(groups, dim=2)

            def ours() -> tuple[torch.Tensor, torch.Tensor]:
                outs = [delta_rule.chunked_delta_rule(qn[i], kn[i], v[i].float(), g[i], beta[i].float(), s0[i])
                        for i in range(rows)]
                return torch.stack([o for o, _ in outs]), torch.stack([s for _, s in outs])
            ms_ours, (out_ours, s_ours) = _timed(ours)
            line = f"{rows:5d} {n:7d} {ms_ours:9.2f}"
            if chunk_gated_delta_rule is not None:
                flat = [x.reshape(1, rows * n, *x.shape[2:]) for x in (q, k, v, g, beta)]
                cu = torch.arange(0, (rows + 1) * n, n, device=dev, dtype=torch.long)

                def fla() -> tuple[torch.Tensor, torch.Tensor]:
                    return chunk_gated_delta_rule(*flat, initial_state=s0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
                ms_fla, (out_fla, s_fla) = _timed(fla)
                diff = (out_fla.float().reshape(rows, n, HV, DV) - out_ours).abs().max().item()
                sdiff = (s_fla.float() - s_ours).abs().max().item()
                line += f" {ms_fla:8.2f} {diff:15.3e} {sdiff:17.3e}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
