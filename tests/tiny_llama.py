"""A tiny random Llama checkpoint for engine tests, saved the Hugging Face
way, with logits wide enough that greedy choices and top-k orders are not
near-ties (random init is close to uniform); and a prompt's generated ids."""

from __future__ import annotations

from pathlib import Path

import torch

from mstar.engine.engine import Engine
from mstar.types import GenerateRequest, SamplingParams


def save_tiny_llama(folder: Path, vocab: int = 384, layers: int = 3, max_positions: int = 512,
                    hidden: int = 64) -> Path:
    """`hidden`: 64 gives heads of 16; 256 heads of 64, which FlashInfer's kernels take."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=160, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


async def generated(eng: Engine, rid: str, prompt: list[int], sp: SamplingParams) -> list[int]:
    """The ids `eng` generates for `prompt` (a chunk's error fails the test)."""
    toks: list[int] = []
    async for chunk in eng.submit(GenerateRequest(rid, eng.model_name, {"prompt_ids": prompt}, sp)):
        assert chunk.error is None, chunk.error
        toks.extend(chunk.token_ids)
    return toks
