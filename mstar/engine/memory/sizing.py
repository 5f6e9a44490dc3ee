"""KV cache sizing: a device, the page shapes of the KV components placed
there and the memory settings in, the number of KV pages each allocates out.

On CUDA the budget is what `--gpu-memory-utilization` allows of the whole
device, less what is already in use (this process's weights, other processes)
and less a reserve for what is allocated after the cache (activations, CUDA
graph pools, attention and sampler workspaces); the KV components on the
device share it, the same number of pages each. Call it once per device,
after every component's weights are on it and before anything else big is
allocated. On CPU the budget is `--kv-cache-memory` GiB per component.

`mem_get_info` is injectable so the CUDA arithmetic is testable on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mstar.engine.memory.kv_cache import KVCache
from mstar.errors import ConfigError
from mstar.models.base import KVSpec

GiB = 1 << 30
# What the runtime allocates on the device after the cache is sized. For an
# Orpheus-3B shape: a prefill step of 8192 packed tokens holds ~0.3 GB of MLP
# activations; logits, the penalty's float32 copy and a top-p sort over 256 rows x 157k vocab take
# ~0.5 GB; FlashInfer keeps ~0.25 GB of plan/work buffers per wrapper; CUDA
# graph pools (each decode bucket keeps its logits: ~0.5 GB over the 22
# default buckets, ~1.5 GB with --cuda-graph-max-batch 512, which the share
# --gpu-memory-utilization leaves over holds) and allocator fragmentation
# take the rest. 2 GiB covers that with room; it is ~1.5% of an H200, so a
# fixed size costs little on big devices.
DEFAULT_RESERVE_BYTES = 2 * GiB

MemGetInfo = Callable[[torch.device], tuple[int, int]]  # device -> (free, total) bytes


def kv_cache_pages(device: torch.device, spec: KVSpec | Sequence[KVSpec], page_size: int, dtype: torch.dtype, *,
                   gpu_memory_utilization: float, cpu_bytes: float, kv_dtype: torch.dtype | None = None,
                   reserve_bytes: int = DEFAULT_RESERVE_BYTES, max_model_len: int | None = None,
                   mem_get_info: MemGetInfo | None = None) -> int:
    """Pages for each KV component on `device` (`spec`: one, or every one
    placed there: on CUDA they share the budget, the same number of pages
    each; on CPU each gets `cpu_bytes`); a `ConfigError` with the numbers
    when they cannot hold one request of `max_model_len` tokens (one page
    when None)."""
    device = torch.device(device)
    specs = [spec] if isinstance(spec, KVSpec) else list(spec)
    sizes = [KVCache.bytes_per_page(s, page_size, dtype, kv_dtype) for s in specs]
    per_page = sum(sizes) if device.type == "cuda" else max(sizes)
    need = -(-max_model_len // page_size) if max_model_len else 1
    if device.type == "cuda":
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
        if mem_get_info is None:
            # memory that torch's caching allocator holds but no tensor uses
            # (an engine shut down in this process) would read as in use
            torch.cuda.empty_cache()
        free, total = (mem_get_info or torch.cuda.mem_get_info)(device)
        used = total - free
        budget = gpu_memory_utilization * total - used - reserve_bytes
        # KVCache allocates one scratch page beyond the pool: it must fit too
        pages = int(budget // per_page) - 1 if budget > 0 else 0
        if pages < need:
            raise ConfigError(
                f"KV cache on {device}: {_gib(total)} GiB total, {_gib(used)} GiB already in use, "
                f"utilization {gpu_memory_utilization} and reserve {_gib(reserve_bytes)} GiB leave "
                f"{_gib(max(budget, 0))} GiB = {max(pages, 0)} pages of {per_page} bytes; "
                f"max_model_len {max_model_len} needs {need} pages ({_gib((need + 1) * per_page)} GiB). "
                f"Raise --gpu-memory-utilization, lower --max-model-len, or free the device")
        return pages
    # host memory is soft: the scratch page rides on top of the budget, as before
    pages = int(cpu_bytes // per_page)
    if pages < need:
        raise ConfigError(
            f"KV cache on {device}: --kv-cache-memory {_gib(cpu_bytes)} GiB holds {pages} pages of "
            f"{per_page} bytes; max_model_len {max_model_len} needs {need} pages "
            f"({_gib(need * per_page)} GiB). Raise --kv-cache-memory or lower --max-model-len")
    return pages


def kv_cache_log_fields(num_pages: int, page_size: int, spec: KVSpec, dtype: torch.dtype,
                        kv_dtype: torch.dtype | None = None) -> dict[str, int | float | str]:
    """What a startup log line says about a cache: pages, tokens, GiB (scratch page included), K and V's dtype."""
    per_page = KVCache.bytes_per_page(spec, page_size, dtype, kv_dtype)
    return {"pages": num_pages, "tokens": num_pages * page_size, "gib": _gib((num_pages + 1) * per_page),
            "kv_dtype": str(kv_dtype or dtype).removeprefix("torch.")}


def _gib(n: float) -> float:
    return round(n / GiB, 2)
