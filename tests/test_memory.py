"""KV cache sizing: host budgets on CPU, and the CUDA arithmetic through a
fake `mem_get_info`, so both branches run without a GPU."""

from __future__ import annotations

import pytest
import torch

from mstar.engine.memory.kv_cache import KVCache
from mstar.engine.memory.sizing import GiB, kv_cache_log_fields, kv_cache_pages
from mstar.errors import ConfigError
from mstar.models.base import KVSpec
from mstar.models.registry import load_model

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, num_q_heads=4)
PAGE = 16
CUDA = torch.device("cuda:0")


def fake_info(free: int, total: int):
    seen: list[torch.device] = []

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        seen.append(device)
        return free, total

    mem_get_info.seen = seen  # type: ignore[attr-defined]
    return mem_get_info


def test_cpu_pages_from_host_bytes() -> None:
    per_page = KVCache.bytes_per_page(SPEC, PAGE, torch.float32)
    assert per_page == 2 * 2 * PAGE * 2 * 16 * 4
    assert kv_cache_pages(torch.device("cpu"), SPEC, PAGE, torch.float32, gpu_memory_utilization=0.9,
                          cpu_bytes=10.5 * per_page) == 10
    # the same as the worker's old sizing
    assert kv_cache_pages(torch.device("cpu"), SPEC, PAGE, torch.float32, gpu_memory_utilization=0.9,
                          cpu_bytes=0.25 * GiB) == KVCache.pages_for_memory(SPEC, PAGE, torch.float32, 0.25 * GiB)


def test_cpu_too_small_for_max_model_len() -> None:
    per_page = KVCache.bytes_per_page(SPEC, PAGE, torch.float32)
    with pytest.raises(ConfigError, match=r"needs 4 pages") as e:
        kv_cache_pages(torch.device("cpu"), SPEC, PAGE, torch.float32, gpu_memory_utilization=0.9,
                       cpu_bytes=3 * per_page, max_model_len=49)
    assert "--kv-cache-memory" in str(e.value)
    assert kv_cache_pages(torch.device("cpu"), SPEC, PAGE, torch.float32, gpu_memory_utilization=0.9,
                          cpu_bytes=3 * per_page, max_model_len=48) == 3


def test_cuda_budget_arithmetic() -> None:
    per_page = KVCache.bytes_per_page(SPEC, PAGE, torch.bfloat16)
    total, free = 100 * GiB, 90 * GiB          # 10 GiB in use (weights)
    info = fake_info(free, total)
    pages = kv_cache_pages(CUDA, SPEC, PAGE, torch.bfloat16, gpu_memory_utilization=0.9, cpu_bytes=0,
                           reserve_bytes=2 * GiB, mem_get_info=info)
    budget = 0.9 * total - (total - free) - 2 * GiB  # 78 GiB
    assert pages == int(budget // per_page) - 1      # minus the scratch page
    assert (pages + 1) * per_page <= budget < (pages + 2) * per_page
    assert info.seen == [CUDA]
    # cpu_bytes plays no part on CUDA
    assert pages == kv_cache_pages(CUDA, SPEC, PAGE, torch.bfloat16, gpu_memory_utilization=0.9,
                                   cpu_bytes=1e15, reserve_bytes=2 * GiB, mem_get_info=info)


def test_kv_components_on_one_device_share_its_budget() -> None:
    """A thinker and a smaller talker on one GPU: one budget, the same number
    of pages each, and all of them (scratch pages included) inside it; on
    CPU each gets the whole `cpu_bytes`."""
    talker = KVSpec(num_layers=SPEC.num_layers // 2, num_kv_heads=SPEC.num_kv_heads, head_dim=SPEC.head_dim,
                    num_q_heads=SPEC.num_q_heads)
    sizes = [KVCache.bytes_per_page(s, PAGE, torch.bfloat16) for s in (SPEC, talker)]
    total, free = 100 * GiB, 90 * GiB
    pages = kv_cache_pages(CUDA, [SPEC, talker], PAGE, torch.bfloat16, gpu_memory_utilization=0.9, cpu_bytes=0,
                           reserve_bytes=2 * GiB, mem_get_info=fake_info(free, total))
    budget = 0.9 * total - (total - free) - 2 * GiB
    assert (pages + 1) * sum(sizes) <= budget < (pages + 2) * sum(sizes)
    alone = kv_cache_pages(CUDA, SPEC, PAGE, torch.bfloat16, gpu_memory_utilization=0.9, cpu_bytes=0,
                           reserve_bytes=2 * GiB, mem_get_info=fake_info(free, total))
    assert pages < alone
    cpu_bytes = 64 * sizes[0]
    assert kv_cache_pages(torch.device("cpu"), [SPEC, talker], PAGE, torch.float32, gpu_memory_utilization=0.9,
                          cpu_bytes=cpu_bytes) == kv_cache_pages(torch.device("cpu"), SPEC, PAGE, torch.float32,
                                                                 gpu_memory_utilization=0.9, cpu_bytes=cpu_bytes)


def test_cuda_orpheus_on_h200() -> None:
    """The real shape: 28 layers x 8 KV heads x 128, bf16, 16-token pages on a
    141 GiB device with 6.6 GB of weights loaded."""
    model = load_model("orpheus-3b", "dummy")
    spec = model.kv_spec("llm")
    per_page = KVCache.bytes_per_page(spec, PAGE, torch.bfloat16)
    assert per_page == 2 * 28 * 16 * 8 * 128 * 2  # 1.75 MiB: 112 KiB per token
    total = int(140.4 * GiB)
    info = fake_info(total - int(7.2 * GiB), total)
    pages = kv_cache_pages(CUDA, spec, PAGE, torch.bfloat16, gpu_memory_utilization=0.9, cpu_bytes=0,
                           max_model_len=model.max_model_len, mem_get_info=info)
    assert 65_000 < pages < 70_000                      # ~1.1 M tokens
    fields = kv_cache_log_fields(pages, PAGE, spec, torch.bfloat16)
    assert fields["pages"] == pages and fields["tokens"] == pages * PAGE
    assert 113 < fields["gib"] < 118


def test_cuda_not_enough_for_max_model_len() -> None:
    per_page = KVCache.bytes_per_page(SPEC, PAGE, torch.bfloat16)
    total = 10 * GiB
    # 0.5 * 10 GiB - 4.9 GiB used - 0 reserve = 0.1 GiB
    info = fake_info(total - int(4.9 * GiB), total)
    room = int(0.1 * GiB) // per_page - 1
    with pytest.raises(ConfigError) as e:
        kv_cache_pages(CUDA, SPEC, PAGE, torch.bfloat16, gpu_memory_utilization=0.5, cpu_bytes=0,
                       reserve_bytes=0, max_model_len=(room + 1) * PAGE, mem_get_info=info)
    msg = str(e.value)
    assert "10.0 GiB total" in msg and "4.9 GiB already in use" in msg and f"needs {room + 1} pages" in msg
    assert kv_cache_pages(CUDA, SPEC, PAGE, torch.bfloat16, gpu_memory_utilization=0.5, cpu_bytes=0,
                          reserve_bytes=0, max_model_len=room * PAGE, mem_get_info=info) == room
    # the reserve alone can eat the budget: a clear error, not a negative count
    with pytest.raises(ConfigError, match="0 pages"):
        kv_cache_pages(CUDA, SPEC, PAGE, torch.bfloat16, gpu_memory_utilization=0.5, cpu_bytes=0,
                       reserve_bytes=GiB, mem_get_info=info)


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.5])
def test_cuda_utilization_must_be_a_fraction(utilization: float) -> None:
    with pytest.raises(ConfigError, match="gpu-memory-utilization"):
        kv_cache_pages(CUDA, SPEC, PAGE, torch.bfloat16, gpu_memory_utilization=utilization, cpu_bytes=0,
                       mem_get_info=fake_info(GiB, GiB))
