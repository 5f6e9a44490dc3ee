"""How far Qwen3.5 in bfloat16 strays from float32, in mstar and in
transformers, on the GPU machine: one random checkpoint (the 9B's head and
state sizes, fewer and narrower layers) saved as a folder; greedy tokens of
several prompts from transformers' float32 `generate` (the reference),
transformers' bfloat16, and mstar's engine in bfloat16 and float32 (CUDA
graphs, Triton kernels). Prints, for each run, the log probabilities of
the first answer token's 20 most likely tokens (the prompt's prefill)
against the reference's at the same tokens (mean and largest difference),
then the tokens each prompt agrees with the reference before it first
differs, and how many of all the tokens agree position by position (a
random model's near-ties make these noisy; the log probabilities are the
measure).

    python scripts/probe_qwen35_bf16.py --new 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

import torch

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.types import GenerateRequest, SamplingParams

# a run: each prompt's greedy tokens, and its first answer token's top logprobs {token id: logprob}
Run = tuple[list[list[int]], list[dict[int, float]]]


TOP = 20


def _save(folder: Path, vocab: int) -> None:
    import transformers
    torch.manual_seed(0)
    layers = 8
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10]},
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = transformers.Qwen3_5ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.lm_head.weight.mul_(4)  # logits wide enough that greedy picks are not all near-ties
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder, safe_serialization=True)


def _hf(folder: Path, prompts: list[list[int]], new: int, dtype: torch.dtype) -> tuple[Run, list[torch.Tensor]]:
    """The run, and each prompt's first-token log probabilities over the whole vocabulary."""
    import transformers
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(folder, dtype=dtype).to("cuda").eval()
    hf.generation_config.eos_token_id = None
    tokens, tops, full = [], [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            logprobs = torch.log_softmax(hf(ids).logits[0, -1].float(), -1).cpu()
            full.append(logprobs)
            best = logprobs.topk(TOP)
            tops.append(dict(zip(best.indices.tolist(), best.values.tolist())))
            tokens.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                      do_sample=False)[0, len(p):].tolist())
    del hf
    torch.cuda.empty_cache()
    return (tokens, tops), full


async def _mstar(folder: Path, prompts: list[list[int]], new: int, dtype: str) -> Run:
    eng = Engine(EngineConfig(model=str(folder), devices=("cuda:0",), dtype=dtype,
                              scheduler=SchedulerConfig(page_size=16)))
    await eng.start()
    greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, logprobs=TOP)

    async def one(i: int, p: list[int]) -> tuple[list[int], dict[int, float]]:
        tokens: list[int] = []
        top: dict[int, float] = {}
        async for chunk in eng.submit(GenerateRequest(f"r{i}", eng.model_name, {"prompt_ids": p}, greedy)):
            if chunk.error is not None:
                raise RuntimeError(chunk.error)
            if not tokens and chunk.logprobs:
                top = dict(chunk.logprobs[0].top)
            tokens.extend(chunk.token_ids)
        return tokens, top
    try:
        got = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await eng.shutdown()
    return [t for t, _ in got], [top for _, top in got]


def _logprob_error(tops: list[dict[int, float]], reference: list[torch.Tensor]) -> tuple[float, float]:
    """Mean and largest |logprob - the reference's| over each prompt's top tokens."""
    errors = [abs(lp - ref[token].item()) for top, ref in zip(tops, reference) for token, lp in top.items()]
    return sum(errors) / len(errors), max(errors)


def _agreement(got: list[list[int]], want: list[list[int]]) -> tuple[list[int], float]:
    first = []
    same = total = 0
    for g, w in zip(got, want):
        n = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        first.append(n)
        same += sum(a == b for a, b in zip(g, w))
        total += len(w)
    return first, same / max(total, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--prompts", type=int, default=16)
    args = p.parse_args()
    vocab = 4096
    gen = torch.Generator().manual_seed(2)
    prompts = [[1, *torch.randint(3, vocab, (int(n),), generator=gen).tolist()]
               for n in torch.randint(4, 600, (args.prompts,), generator=gen)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        _save(folder, vocab)
        (reference, _), full = _hf(folder, prompts, args.new, torch.float32)
        runs = {"transformers bfloat16": _hf(folder, prompts, args.new, torch.bfloat16)[0],
                "mstar float32": asyncio.run(_mstar(folder, prompts, args.new, "float32")),
                "mstar bfloat16": asyncio.run(_mstar(folder, prompts, args.new, "bfloat16"))}
    print(f"# {torch.cuda.get_device_name(0)} | torch {torch.__version__} | mstar commit "
          f"{os.environ.get('MSTAR_COMMIT', '?')} | {args.prompts} prompts of {[len(p) for p in prompts]} tokens, "
          f"{args.new} greedy tokens each; reference: transformers float32")
    print(f"{'run':<24} {'mean |dlogprob|':>16} {'max |dlogprob|':>15} {'same tokens':>12}  "
          "tokens before the first difference, per prompt")
    for name, (tokens, tops) in runs.items():
        first, frac = _agreement(tokens, reference)
        mean, worst = _logprob_error(tops, full)
        print(f"{name:<24} {mean:16.4f} {worst:15.4f} {frac:12.3f}  {first}")
    first, frac = _agreement(runs["mstar bfloat16"][0], runs["transformers bfloat16"][0])
    print(f"{'mstar bf16 vs hf bf16':<24} {'':>16} {'':>15} {frac:12.3f}  {first}")


if __name__ == "__main__":
    main()
