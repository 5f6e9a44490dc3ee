"""Which attention backend and which CUDA graphs a component gets.

The torch reference (`TorchPagedAttention`) runs everywhere and is the oracle;
FlashInfer serves CUDA devices when it is installed. Decode steps replay CUDA
graphs when the backend can plan into static buffers and graphs are not
switched off; so do mixed steps (a decode group's rows with new rows' prompt
tokens) that fit a bucket, the plain modes whose row shapes the model
declares, and the KV modes declared `graph=True` that it gives row shapes for.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import structlog
import torch
from torch import nn

from mstar.config import EngineConfig
from mstar.engine.memory.attention import TorchPagedAttention
from mstar.engine.execution.graphs.cuda_graphs import DecodeGraphs
from mstar.engine.memory.kv_cache import KVCache
from mstar.engine.memory.state_slots import StatePool
from mstar.engine.execution.graphs.kv_mode_graphs import KVModeGraphs
from mstar.engine.execution.graphs.mixed_graphs import MIXED_TOKEN_BUCKETS, MixedGraphs
from mstar.engine.execution.graphs.mode_graphs import ModeGraphs
from mstar.engine.execution.sampler import SamplingTensors
from mstar.engine.execution.graphs.sampler_graphs import SamplerGraphs
from mstar.errors import ConfigError
from mstar.graph import Component
from mstar.models.base import Model
from mstar.scheduler.group_steps import MIXED_ROWS
from mstar.types import AttentionContext, SamplingParams, TokenBatch

log = structlog.get_logger("mstar.backends")

FLASHINFER_HEAD_DIMS = (64, 128, 256)  # the head sizes its prefill and decode kernels are built for
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)  # the KV dtypes they are built for


class AttentionBackend(Protocol):
    def plan(self, query_start: torch.Tensor, context_lens: torch.Tensor,
             block_tables: torch.Tensor | Sequence[Sequence[int]], causal: bool = True) -> AttentionContext: ...


class TorchBackend:
    """The reference: plain torch over the pages, on any device."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def plan(self, query_start: torch.Tensor, context_lens: torch.Tensor,
             block_tables: torch.Tensor | Sequence[Sequence[int]], causal: bool = True) -> AttentionContext:
        return TorchPagedAttention(self.cache, query_start, context_lens, block_tables, causal)


def attention_backend(cache: KVCache, num_q_heads: int, max_pages_per_row: int,
                      config: EngineConfig, mixed: bool = False) -> AttentionBackend:
    """`mixed`: plan CUDA-graph mixed steps too (`mixed_graphs.py`)."""
    choice = config.attention_backend
    if choice == "torch" or (choice == "auto" and cache.device.type != "cuda"):
        return TorchBackend(cache)
    if cache.device.type != "cuda":
        raise ConfigError("--attention-backend flashinfer needs a CUDA device")
    if cache.dtype not in FLASHINFER_DTYPES:
        if choice == "flashinfer":
            raise ConfigError(f"FlashInfer's kernels take float16 or bfloat16 KV caches, not {cache.dtype}: "
                              "use --attention-backend torch, or --dtype bfloat16")
        log.info("KV cache dtype outside FlashInfer's kernels: using the torch reference attention",
                 dtype=str(cache.dtype))
        return TorchBackend(cache)
    try:
        from mstar.engine.memory.flashinfer_attention import FlashInferAttention
    except ImportError as e:
        if choice == "flashinfer":
            raise ConfigError(f"FlashInfer is not importable: {e}") from e
        log.warning("flashinfer is not installed: using the torch reference attention", error=str(e))
        return TorchBackend(cache)
    if num_q_heads < 1:
        raise ConfigError("the model's KVSpec does not give its number of query heads")
    if cache.spec.head_dim not in FLASHINFER_HEAD_DIMS:
        if choice == "flashinfer":
            raise ConfigError(f"FlashInfer's kernels take head_dim {FLASHINFER_HEAD_DIMS}, "
                              f"not {cache.spec.head_dim}")
        log.info("head_dim outside FlashInfer's kernels: using the torch reference attention",
                 head_dim=cache.spec.head_dim)
        return TorchBackend(cache)
    buckets = () if config.enforce_eager else config.cuda_graph_batch_sizes
    mixed = mixed and bool(buckets)
    return FlashInferAttention(cache, num_q_heads, graph_batch_sizes=buckets, max_pages_per_row=max_pages_per_row,
                               mixed_tokens=MIXED_TOKEN_BUCKETS if mixed else (),
                               mixed_rows=MIXED_ROWS if mixed else 0, mixed_buckets=doubling_buckets(buckets))


def decode_graphs(step: Callable[[TokenBatch], dict[str, torch.Tensor]], backend: AttentionBackend,
                  device: torch.device, config: EngineConfig, outputs: Sequence[str] = ("logits",),
                  axes: int = 1, state: StatePool | None = None) -> DecodeGraphs | None:
    """Captured decode graphs, or None where they cannot or should not run."""
    if config.enforce_eager or device.type != "cuda" or not hasattr(backend, "plan_graph"):
        return None
    graphs = DecodeGraphs(step, backend, config.cuda_graph_batch_sizes, device, outputs, axes, state)
    graphs.capture()
    return graphs


def mixed_graphs(step: Callable[[TokenBatch], dict[str, torch.Tensor]], backend: AttentionBackend,
                 decode: DecodeGraphs | None, device: torch.device) -> MixedGraphs | None:
    """Captured mixed-step graphs, where the backend plans them (beside the
    decode graphs)."""
    if decode is None or not getattr(backend, "mixed_graph_buckets", None):
        return None
    graphs = MixedGraphs(step, backend, device)  # type: ignore[arg-type]
    graphs.capture()
    return graphs


def sampler_graphs(decode: DecodeGraphs, default: SamplingParams, device: torch.device,
                   window: tuple[int, int] | None = None) -> SamplerGraphs | None:
    """Graphs of the draws from the decode graphs' logits (of ids `window`
    only, where the head computes no others), those of the model's `default`
    sampling captured now (others on first use)."""
    logits = decode.static_outputs("logits")
    if not logits:
        return None
    graphs = SamplerGraphs(logits, device, window)
    graphs.capture(SamplingTensors.build([default], [0], [0], device))
    return graphs


def mode_graphs(model: Model, component: str, modes: Sequence[str], module: nn.Module, device: torch.device,
                config: EngineConfig) -> dict[str, ModeGraphs]:
    """Captured graphs of the plain modes the model declares row shapes for
    (`Model.graph_shapes`), by mode; empty where graphs cannot or should not run."""
    if config.enforce_eager or device.type != "cuda":
        return {}
    graphs = {}
    for mode in modes:
        shapes = model.graph_shapes(component, mode)
        if not shapes:
            continue
        graphs[mode] = ModeGraphs(f"{component}.{mode}", getattr(module, mode), shapes,
                                  halfway_buckets(doubling_buckets(config.cuda_graph_batch_sizes)), device)
        graphs[mode].capture()
    return graphs


def kv_mode_graphs(model: Model, component: str, spec: Component, module: nn.Module, backend: AttentionBackend,
                   device: torch.device, config: EngineConfig) -> dict[str, KVModeGraphs]:
    """Captured graphs of a KV component's modes declared `graph=True` with
    a signature that the model gives row shapes for (`Model.graph_rows`:
    the inputs besides the query, in signature order), by mode."""
    if config.enforce_eager or device.type != "cuda" or not hasattr(backend, "plan_graph"):
        return {}
    graphs = {}
    for mode, sig in spec.signatures.items():
        shapes = model.graph_rows(component, mode) if sig.graph else None
        if shapes is None:
            continue
        names = [i.name for i in sig.inputs if i.name != sig.query]
        if len(names) != len(shapes):
            raise ValueError(f"{component}.{mode}: graph_rows gives {len(shapes)} row shapes for {names}")
        graphs[mode] = KVModeGraphs(f"{component}.{mode}", getattr(module, mode), backend,
                                    doubling_buckets(config.cuda_graph_batch_sizes), device, dict(zip(names, shapes)),
                                    spec.position_axes, sig.draws)
        graphs[mode].capture()
    return graphs


def doubling_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    """The powers of two among `buckets`, and the largest: the sizes of the
    graph sets captured once per other dimension (mixed steps: per token
    bucket; a KV mode: per draw; plain modes: per row shape, halfway between
    these), where each extra size costs captures and buffers of its own."""
    ordered = sorted(set(buckets))
    return tuple(b for b in ordered if b & (b - 1) == 0 or b == ordered[-1])


def halfway_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    """`buckets` plus a bucket halfway between each neighbouring pair (1, 2,
    3, 4, 6, 8, 12, ...): a plain mode's cost grows with its padded rows (a
    codec window is real work, not a launch), so padding stays under a
    third instead of under a half."""
    ordered = sorted(set(buckets))
    halves = {(a + b) // 2 for a, b in zip(ordered, ordered[1:]) if b - a > 1}
    return tuple(sorted(set(ordered) | halves))
