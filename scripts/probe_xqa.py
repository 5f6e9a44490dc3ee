"""Which row lengths, page-table widths, batch sizes and page sizes XQA's
float8 decode (FlashInfer's `xqa`, TensorRT-LLM's Hopper kernel) runs for,
and its error against a float32 reference over the same float8 pages. Each
case runs in a process of its own: a kernel fault kills only that case.

    python3 scripts/probe_xqa.py                 # every case, one line each
    python3 scripts/probe_xqa.py 1 140 9 16      # one case: batch, length, table width (pages), page size
"""

from __future__ import annotations

import subprocess
import sys

HQ, HKV, D = 24, 8, 128
CASES = [  # batch, tokens a row, table width in pages (0: just enough), page size
    (1, 560, 0, 16), (1, 144, 0, 16), (1, 140, 0, 16), (1, 140, 11, 16), (1, 560, 40, 16), (1, 545, 0, 16),
    (1, 128, 0, 16), (1, 129, 0, 16), (1, 200, 0, 16), (1, 64, 0, 16), (1, 13, 0, 16),
    (64, 140, 0, 16), (64, 144, 0, 16), (64, 560, 0, 16),
    (1, 140, 0, 32), (1, 140, 0, 64), (64, 140, 0, 64), (1, 140, 8, 64),
]


def one(batch: int, tokens: int, width: int, page: int) -> str:
    import torch
    from flashinfer.xqa import xqa

    fp8 = torch.float8_e4m3fn
    gen = torch.Generator(device="cuda").manual_seed(0)
    per_row = width or -(-tokens // page)
    pages = batch * per_row + 1
    k = torch.randn(pages, page, HKV, D, device="cuda", generator=gen).to(fp8)
    v = torch.randn(pages, page, HKV, D, device="cuda", generator=gen).to(fp8)
    table = torch.randperm(pages - 1, device="cuda", generator=gen)[:batch * per_row].view(batch, per_row).int()
    lens = torch.full((batch, 1), tokens, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 1, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    sem = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")
    scratch = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    xqa(q, k, v, table, lens.view(torch.uint32), out, scratch, sem, HKV, page, q_scale=1.0, kv_scale=1.0, sm_count=sm)
    torch.cuda.synchronize()
    # reference: float32 over the same float8 values, each row's first `tokens` tokens
    rows = table.long()
    keys = k.float()[rows].reshape(batch, per_row * page, HKV, D)[:, :tokens]
    vals = v.float()[rows].reshape(batch, per_row * page, HKV, D)[:, :tokens]
    keys, vals = (t.repeat_interleave(HQ // HKV, dim=2).transpose(1, 2) for t in (keys, vals))
    want = torch.nn.functional.scaled_dot_product_attention(q.float().transpose(1, 2), keys, vals)
    err = (out.float().transpose(1, 2) - want).abs().max().item()
    return f"ok max_err {err:.4f}"


def main() -> None:
    if len(sys.argv) == 5:
        print(one(*map(int, sys.argv[1:])), flush=True)
        return
    for case in CASES:
        r = subprocess.run([sys.executable, __file__, *map(str, case)], capture_output=True, text=True, timeout=300)
        tail = (r.stdout.strip().splitlines() or [""])[-1] if r.returncode == 0 else \
            f"FAILED rc {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1][:160]}"
        print(f"batch {case[0]:>3} tokens {case[1]:>4} width {case[2] or 'exact':>5} page {case[3]:>3}: {tail}",
              flush=True)


if __name__ == "__main__":
    main()
