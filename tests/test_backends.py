"""Which attention backend a KV cache gets: FlashInfer only where its kernels
exist (CUDA, float16/bfloat16, its head sizes); elsewhere the torch reference,
or a one-line config error when FlashInfer was asked for by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mstar.config import EngineConfig
from mstar.engine.execution.backends import TorchBackend, attention_backend
from mstar.errors import ConfigError


def _cuda_cache(dtype: torch.dtype) -> SimpleNamespace:
    # only what the choice reads: no CUDA device is touched
    return SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, spec=SimpleNamespace(head_dim=128))


def test_a_float32_cache_on_cuda_gets_the_torch_reference_under_auto() -> None:
    backend = attention_backend(_cuda_cache(torch.float32), 8, 16, EngineConfig(attention_backend="auto"))
    assert isinstance(backend, TorchBackend)


def test_flashinfer_by_name_refuses_a_float32_cache_naming_the_way_out() -> None:
    with pytest.raises(ConfigError, match="float16 or bfloat16.*--attention-backend torch"):
        attention_backend(_cuda_cache(torch.float32), 8, 16, EngineConfig(attention_backend="flashinfer"))


def test_the_torch_backend_by_name_serves_float32_on_cuda() -> None:
    backend = attention_backend(_cuda_cache(torch.float32), 8, 16, EngineConfig(attention_backend="torch"))
    assert isinstance(backend, TorchBackend)
