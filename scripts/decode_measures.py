"""What bench_decode.py measures besides the engine: a device and a Llama
config in; the device's copy bandwidth, the bytes a decode step must read
(its bandwidth floor), and transformers' `generate` throughput with the same
architecture out.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from mstar.engine.memory.kv_cache import KVCache
from mstar.engine.memory.state_slots import StatePool
from mstar.models.base import KVSpec, StateSpec
from mstar.models.llama.config import LlamaConfig

GiB = 1 << 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gbps(device: torch.device, nbytes: int = GiB, repeats: int = 10) -> float:
    """Median device-to-device copy bandwidth in GB/s, counting the bytes read
    and the bytes written (2 x `nbytes` per copy), as a decode step's weight
    reads are counted against it."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(2):  # first touches and clock ramp-up are not the device's bandwidth
        dst.copy_(src)
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e9


def weight_bytes_per_step(cfg: LlamaConfig, itemsize: int) -> int:
    """Bytes of weights one decode step reads: every matrix, norm and bias
    once. The embedding table counts once when it is the (tied) LM head; an
    untied table is only gathered at B rows, which is negligible."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    if cfg.attention_bias:
        layer += q + 2 * kv + h
    if cfg.mlp_bias:
        layer += 2 * i + h
    return itemsize * (cfg.num_hidden_layers * layer + h + cfg.vocab_size * h)


def kv_bytes_per_step(spec: KVSpec, dtype: torch.dtype, batch: int, context: float) -> int:
    """K and V bytes a decode step reads: every row's context, all layers."""
    return int(batch * context * KVCache.bytes_per_page(spec, 1, dtype))


def hf_config_dict(cfg: LlamaConfig) -> dict[str, Any]:
    """Our config as transformers' LlamaConfig keyword arguments."""
    s = cfg.rope_scaling
    scaling = None if s.rope_type == "default" else {
        "rope_type": s.rope_type, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position_embeddings}
    return {
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) or None, "pad_token_id": None,
    }


def build_hf(cfg: LlamaConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' LlamaForCausalLM of the same shape with its own random
    init: weight values do not change the speed."""
    import transformers

    hf_cfg = transformers.LlamaConfig(**hf_config_dict(cfg))
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_cfg)
    return model.to(dtype).eval()


@torch.inference_mode()
def hf_decode_tokens_per_s(model: torch.nn.Module, batch: int, context: int, new_tokens: int,
                           device: torch.device, repeats: int = 3) -> float:
    """Greedy `generate` of exactly `new_tokens` per row after `context`
    prompt tokens; decode only: the time of a 1-token generate (prefill and
    the first token) is subtracted, as mstar's decode throughput excludes
    prefill too."""
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, 256, (batch, context), generator=gen).to(device)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        _sync(device)
        assert out.shape == (batch, context + n), out.shape
        return time.perf_counter() - t0

    run(new_tokens)  # warm-up: kernels, allocator
    full = statistics.median(run(new_tokens) for _ in range(repeats))
    first = statistics.median(run(1) for _ in range(repeats))
    return batch * (new_tokens - 1) / max(full - first, 1e-9)


def module_weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of a decoder module's weights one decode step reads: every
    parameter once (a tied table counted once, as the head), but an untied
    input embedding, of which a step gathers only its rows."""
    embed = getattr(module, "embed_tokens", None)
    head = getattr(module, "lm_head", None)
    skip = embed.weight if embed is not None and head is not None and embed.weight is not head.weight else None
    return sum(p.numel() * p.element_size() for p in module.parameters() if p is not skip)


def state_bytes_per_step(spec: StateSpec, batch: int) -> int:
    """Per-row state bytes a decode step moves: each row's state read and written once."""
    return 2 * batch * StatePool.bytes_per_slot(spec)


def build_hf_qwen35(config: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' Qwen3_5ForCausalLM of a dense config.json's shape (its
    text config), with its own random init."""
    import transformers

    text = dict(config.get("text_config") or config)
    text.pop("model_type", None)
    with torch.device(device):
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text))
    return model.to(dtype).eval()
