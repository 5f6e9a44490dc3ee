"""A model's components built on one device: the components placed there
in, a `ComponentRunner` each out, with what the runner needs. For a KV
component: the KV cache (sized from the memory left once every component's
weights are in place), its page pool, its attention backend and its decode
CUDA graphs, and the graphs of its other modes worth them. For any other:
the CUDA graphs of the modes the model declares row shapes for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Sequence

import structlog
import torch
from torch import nn

from mstar.config import EngineConfig
from mstar.engine.execution.backends import (attention_backend, decode_graphs, kv_mode_graphs, mixed_graphs,
                                             mode_graphs, sampler_graphs)
from mstar.engine.memory.kv_cache import FP8_KV, KVCache
from mstar.errors import ConfigError
from mstar.models.layers import VocabHead, quantize_linears
from mstar.kernels.sampling.draw import compile_wide_draw
from mstar.engine.memory.sizing import kv_cache_log_fields, kv_cache_pages
from mstar.engine.memory.state_slots import StatePool
from mstar.engine.execution.runner import ComponentRunner
from mstar.engine.worker.groups.group_shape import graph_outputs
from mstar.engine.movement.tensor_store import TensorStore
from mstar.models.base import KVSpec, Model
from mstar.scheduler import PagePool

log = structlog.get_logger("mstar.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# CPU workers (`cpu:0`, `cpu:1`: replicas on one host) may be handed one module by a model that keeps its
# modules (the toys do). torch takes `cpu:1` for another device than the parameters' `cpu`, so `.to` copies
# each parameter and swaps the copy in (`param.data =`), freeing the storage another worker's `.to` may be
# copying from that moment: under CPU load now and then a weight came out as freed memory's bytes (1e34,
# or an image of NaNs). So CPU workers build one at a time; GPU workers build their own modules at once.
_CPU_BUILDS = threading.Lock()


def resolve_dtype(model: Model, config: EngineConfig, device: torch.device) -> torch.dtype:
    """`--dtype`, or the model's own choice for `device` under `auto`."""
    return DTYPES.get(config.dtype) or model.default_dtype(device)


def build_runners(model: Model, names: Sequence[str], device: torch.device, store: TensorStore,
                  config: EngineConfig) -> dict[str, tuple[ComponentRunner, PagePool | None]]:
    """Components `names` on `device`: each one's runner, and its page pool
    (None without a KV cache). Every component's weights go on the device
    first, then the per-row state, then the KV caches, sized together from
    what memory is left: each KV component gets the same number of pages
    (a request's thinker and talker hold about as many tokens each)."""
    dtype = resolve_dtype(model, config, device)
    with _CPU_BUILDS if device.type == "cpu" else contextlib.nullcontext():
        modules = _modules(model, names, device, dtype, config)
    cfg = config.scheduler
    kv_names = [name for name in names if model.components[name].kv_cache]
    states = {name: _state_pool(model, name, device, config) for name in names if model.components[name].state}
    num_pages = 0
    if kv_names:
        num_pages = cfg.num_pages or kv_cache_pages(
            device, [kv_spec(model, name, config) for name in kv_names], cfg.page_size, dtype,
            kv_dtype=kv_cache_dtype(config, device, dtype),
            gpu_memory_utilization=cfg.gpu_memory_utilization, cpu_bytes=cfg.kv_cache_memory * 2**30,
            max_model_len=model.max_model_len)
    return {name: _runner(model, name, modules[name], device, dtype, store, config, num_pages, states.get(name))
            for name in names}


def _modules(model: Model, names: Sequence[str], device: torch.device, dtype: torch.dtype,
             config: EngineConfig) -> dict[str, nn.Module]:
    """Components `names` built on `device`, made ready to serve (fp8
    weights, restricted heads, eager flags, kernels compiled)."""
    modules = {name: model.build_component(name, device, dtype) for name in names}
    if config.quantization == "fp8":
        _fp8({name: m for name, m in modules.items() if model.components[name].kv_cache}, device, dtype)
    if config.audio_logits_only:
        _audio_logits(model, modules)
    for module in modules.values():  # a module that captures graphs of its own runs eagerly when told to
        if hasattr(module, "enforce_eager"):
            module.enforce_eager = config.enforce_eager
        for part in module.modules():  # kernels compiled on first use compile now, not in a request's step
            if hasattr(part, "compile_kernels"):
                part.compile_kernels()
    return modules


def kv_cache_dtype(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """What K and V pages are stored in: the model's dtype, or float8 e4m3 under `--kv-cache-dtype fp8`
    (opt-in: every key and value is rounded to it)."""
    if config.kv_cache_dtype == "auto":
        return dtype
    if config.kv_cache_dtype != "fp8":
        raise ConfigError(f"--kv-cache-dtype takes auto or fp8, not '{config.kv_cache_dtype}'")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError(f"--kv-cache-dtype fp8 needs compute capability 8.9 or later; {device} has "
                          f"{torch.cuda.get_device_capability(device)}")
    return FP8_KV


def _fp8(modules: dict[str, nn.Module], device: torch.device, dtype: torch.dtype) -> None:
    """`--quantization fp8`: the decoder layers' projections of the KV
    components (`modules`), before the KV cache takes the memory they give back."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError(f"--quantization fp8 needs compute capability 8.9 or later; {device} has "
                          f"{torch.cuda.get_device_capability(device)}")
    if device.type == "cuda" and dtype != torch.bfloat16:
        raise ConfigError(f"--quantization fp8 on CUDA takes --dtype bfloat16, not {dtype}")
    for name, module in modules.items():
        log.info("fp8 weights", device=str(device), component=name, linears=quantize_linears(module))
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _audio_logits(model: Model, modules: dict[str, nn.Module]) -> None:
    """`--audio-logits-only`: the heads of the components with an audio
    window compute those ids' logits only (the model's speech walks draw
    nothing else; `Engine` serves only those walks)."""
    for name, module in modules.items():
        window = model.audio_logits(name)
        if window is None:
            continue
        head = getattr(module, "lm_head", None)
        if not isinstance(head, VocabHead):
            raise ConfigError(f"--audio-logits-only: component '{name}' of model '{model.name}' has no "
                              f"vocabulary head to restrict")
        head.restrict(*window)
        log.info("audio logits only", component=name, ids=f"{window[0]}..{window[1] - 1}")


def kv_spec(model: Model, name: str, config: EngineConfig) -> KVSpec:
    """The model's KV spec of component `name`; its token rows only while
    the prefix cache is on (without it no prompt starts from a page another
    prompt wrote, and the rows would take memory for nothing)."""
    spec = model.kv_spec(name)
    return spec if config.scheduler.prefix_caching else dataclasses.replace(spec, token_rows=())


def _state_pool(model: Model, name: str, device: torch.device, config: EngineConfig) -> StatePool:
    """Per-row state before the KV cache: the cache takes what memory is left."""
    cfg = config.scheduler
    state = StatePool(model.state_spec(name), cfg.state_slots or cfg.max_num_seqs, device)
    log.info("state slots", device=str(device), component=name, slots=state.num_slots,
             mib=round(state.num_slots * StatePool.bytes_per_slot(state.spec) / 2**20, 1))
    return state


def _runner(model: Model, name: str, module: nn.Module, device: torch.device, dtype: torch.dtype,
            store: TensorStore, config: EngineConfig, num_pages: int,
            state: StatePool | None) -> tuple[ComponentRunner, PagePool | None]:
    spec = model.components[name]
    if not spec.kv_cache:
        graphs_by_mode = mode_graphs(model, name, spec.modes, module, device, config)
        if graphs_by_mode:
            log.info("cuda graphs", device=str(device), component=name,
                     modes={m: g.buckets for m, g in graphs_by_mode.items()})
        return ComponentRunner(name, spec, module, device, store, None, mode_graphs=graphs_by_mode,
                               state=state), None
    cfg = config.scheduler
    kvspec = kv_spec(model, name, config)
    need = -(-model.max_model_len // cfg.page_size)
    if num_pages < need:
        raise ValueError(f"{name}: {num_pages} KV pages cannot hold one request of "
                         f"max_model_len {model.max_model_len} ({need} pages)")
    kv_dtype = kv_cache_dtype(config, device, dtype)
    kv = KVCache(kvspec, num_pages, cfg.page_size, device, dtype, kv_dtype)
    log.info("kv cache", device=str(device), component=name,
             **kv_cache_log_fields(num_pages, cfg.page_size, kvspec, dtype, kv_dtype))
    # decode graphs replay a component with per-row state too, its rows' slots copied in; its mixed steps run eagerly
    outputs = graph_outputs(spec, "decode") if spec.samples and hasattr(module, "decode") else None
    # mixed steps' graphs: decode steps that keep only logits, of one position axis (M-RoPE ones mix eagerly)
    mixes = cfg.mixed_steps and outputs == ("logits",) and spec.position_axes == 1 and not spec.state
    attention = attention_backend(kv, kvspec.num_q_heads, need, config, mixed=mixes)
    graphs = decode_graphs(module.decode, attention, device, config, outputs, spec.position_axes, state) \
        if outputs is not None else None
    mixed = mixed_graphs(module.decode, attention, graphs, device) if mixes else None
    draws = None
    if graphs is not None and (logits := graphs.static_output("logits")) is not None:
        window = getattr(module, "vocab_window", None)
        first, end = window or (0, logits.shape[1])
        compile_wide_draw(logits[:, first:end], first)   # before serving: a first wide batch would wait for Triton
        draws = sampler_graphs(graphs, model.default_sampling(), device, window)
    by_mode = kv_mode_graphs(model, name, spec, module, attention, device, config)
    log.info("attention", device=str(device), component=name, backend=type(attention).__name__,
             cuda_graphs=graphs.buckets if graphs is not None else None,
             mixed_graphs=len(mixed.buckets) if mixed is not None else None,
             mode_graphs={m: g.buckets for m, g in by_mode.items()} or None)
    runner = ComponentRunner(name, spec, module, device, store, kv, attention, graphs, state=state,
                             kv_graphs=by_mode, mixed_graphs=mixed, sampler_graphs=draws)
    return runner, PagePool(num_pages, cfg.page_size, frozenset(kv.rows))
