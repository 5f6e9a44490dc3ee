"""bench_decode.py's environment line and markdown: the run's settings and
versions in; a dict of environment facts and a markdown file out."""

from __future__ import annotations

import argparse
import datetime
import platform
from pathlib import Path

import torch
from bench_env import REPO, commit, version


def environment(device: torch.device, a: argparse.Namespace, dtype: torch.dtype) -> dict[str, str]:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or 'unknown'})"
    return {
        "gpu": gpu,
        "model": f"{a.model} ({a.load_format} weights, {str(dtype).removeprefix('torch.')}"
                 f"{', projections ' + a.quantization if getattr(a, 'quantization', None) else ''})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "flashinfer": version("flashinfer-python", "flashinfer"),
        "transformers": version("transformers"),
        "python": platform.python_version(),
        "mstar commit": commit(REPO),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "new tokens": str(a.new_tokens),
    }


def write_markdown(path: Path, result: dict, env: dict[str, str]) -> None:
    lines = ["# Decode step vs the bandwidth floor", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- device-to-device copy: {result['copy_GBps']:.0f} GB/s (bytes read + written, 1 GiB, median)", ""]
    lines += [("floor = (weight bytes + KV bytes read at the mean decode context) / copy bandwidth; "
               "step and host are medians over decode steps with all rows of the batch; "
               "host = step - time blocked on the device."), ""]
    lines += ["| batch | context | step ms | floor ms | step/floor | host ms |", "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['context']} | {r['step_ms']:.2f} | {r['floor_ms']:.2f} | {r['ratio']:.2f} | "
              f"{r['host_ms']:.2f} |" for r in result["rows"]]
    hf = {r["batch"]: r["tokens_per_s"] for r in result["hf"]}
    lines += ["", ("Decode tokens/s at the first context (prefill excluded; transformers: `generate` time of "
                   "N tokens minus that of 1 token):"), "",
              "| batch | mstar tokens/s | transformers tokens/s |", "|---:|---:|---:|"]
    for r in result["mstar_tokens_per_s"]:
        theirs = f"{hf[r['batch']]:.0f}" if r["batch"] in hf else "-"
        lines.append(f"| {r['batch']} | {r['tokens_per_s']:.0f} | {theirs} |")
    path.write_text("\n".join(lines) + "\n")
