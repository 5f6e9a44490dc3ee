"""A toy image generator, small random modules in float32: a decoder over
the paged KV cache reads a prompt (prefill, writing only its cache), then
a fixed number of denoising steps each predicts a velocity for a block of
latent rows that attends to the whole prompt and to all of itself, read-only
(`kv="read"`, non-causal: the block's keys are never kept), a scheduler step
moves the latent, and a linear "VAE" decodes the last one to pixels (a
partition of its own, fed the final latent by a `Last` stream, so it may run
on another device). Served through the
engine, and run unbatched by a test as its reference.

`generate_cfg` guides the way BAGEL does: an image's tokens prefilled, the
cache forked into "no_text" (sharing them) and "no_image" (empty), the text
prefilled on "main" and "no_image", then every denoising step predicts a
velocity on all three rows in one batched step and a combine step joins
them (classifier-free guidance). The final latent streams (`Last`) into the
VAE, a partition of its own that may run on another device."""

from __future__ import annotations

import torch
from torch import nn

from mstar.graph import Component, Each, Emit, Fork, In, Kind, Last, Loop, MaxSteps, Mode, Out, Step, Stream, Walk
from mstar.models.prepared import PreparedPiece
from mstar.types import GenerateRequest, SamplingParams, TokenBatch
from toys.audio_decoder import HEAD_DIM, HIDDEN, LAYERS, VOCAB, Layer, ToyModel

PIXELS = 3  # channels per latent row

PREFILL = Mode("prefill", (In("ids", Kind.IDS),), (), kv="append", query="ids")
VELOCITY = Mode("velocity", (In("x", Kind.EMBEDS), In("t", Kind.INDEX)), (Out("v", Kind.HIDDEN, rows="all"),),
                kv="read", query="x", causal=False)
SCHED_STEP = Mode("step", (In("x", Kind.TENSOR), In("v", Kind.TENSOR), In("n", Kind.TENSOR)), (Out("x", Kind.TENSOR),))
CFG_STEP = Mode("cfg", (In("x", Kind.TENSOR), In("v", Kind.TENSOR), In("n", Kind.TENSOR), In("scale", Kind.TENSOR)),
                (Out("x", Kind.TENSOR),))
VAE_DECODE = Mode("decode", (In("z", Kind.TENSOR),), (Out("image", Kind.TENSOR),))


class Denoiser(nn.Module):
    """prefill: token ids into the cache; velocity: latent rows [N, HIDDEN] at
    denoising step t -> v [N, HIDDEN]. Rotary on one position axis."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.time = nn.Embedding(64, HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)
        inv_freq = 1.0 / (10_000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _run(self, x: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
        angles = batch.positions.reshape(-1).float()[:, None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        for i, layer in enumerate(self.layers):
            x = layer(x, i, batch.attn, cos, sin)
        return self.norm(x)

    def prefill(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        self._run(self.embed(batch.input_ids), batch)
        return {}

    def velocity(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        rows, index = batch.embeds["x"]
        x = torch.zeros(batch.input_ids.shape[0], HIDDEN, dtype=rows.dtype, device=rows.device)
        x = x.index_copy(0, index, self.proj(rows))
        qs = batch.query_start.to(x.device)
        row = torch.repeat_interleave(torch.arange(qs.numel() - 1, device=x.device), qs[1:] - qs[:-1])
        x = x + self.time(batch.extra["t"].to(x.device)[row])
        return {"v": self.out(self._run(x, batch))}


class Scheduler(nn.Module):
    def step(self, x: torch.Tensor, v: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return x - v / n.to(x.dtype).reshape(-1, 1, 1)

    def cfg(self, x: torch.Tensor, v: torch.Tensor, n: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """`v` [B, 3, N, H]: the velocities of "main", "no_text" and "no_image"."""
        s = scale.to(x.dtype).reshape(-1, 1, 1)
        full, no_text, no_image = v[:, 0], v[:, 1], v[:, 2]
        guided = no_text + s * (full - no_text) + 0.5 * s * (full - no_image)
        return self.step(x, guided, n)


class Vae(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, PIXELS)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Latent rows [..., N, HIDDEN] -> pixels [..., N, PIXELS]; from a
        stream, [B, 1, N, HIDDEN] (its one-item chunks) -> [B, N, PIXELS]."""
        return torch.tanh(self.proj(z.squeeze(1) if z.dim() == 4 else z))


class ToyImageModel(ToyModel):
    components = {
        "llm": Component(modes=(PREFILL, VELOCITY), kv_cache=True),
        "sched": Component(modes=(SCHED_STEP, CFG_STEP)),
        "vae": Component(modes=(VAE_DECODE,)),
    }
    walks = {
        "generate": Walk(
            Step("llm", "prefill", {"ids": "prompt_ids"}, ()),
            Loop((Step("llm", "velocity", {"x": "latent", "t": "@i"}, {"v": "v"}),
                  Step("sched", "step", {"x": "latent", "v": "v", "n": "num_steps"}, {"x": "latent"})),
                 until=MaxSteps(value="num_steps"), value="latent"),
            Stream("latent", Step("vae", "decode", {"z": "latent"}, {"image": "image"}), Last()),
            Emit("image", modality="data"),
            inputs=("prompt_ids", "latent", "num_steps")),
        "generate_cfg": Walk(
            Step("llm", "prefill", {"ids": "image_ids"}, ()),
            Fork(("no_text", "share"), ("no_image", "fresh")),
            Each(Step("llm", "prefill", {"ids": "text_ids"}, ()), only=("main", "no_image")),
            Loop((Each(Step("llm", "velocity", {"x": "latent", "t": "@i"}, {"v": "v"})),
                  Step("sched", "cfg", {"x": "latent", "v": "v", "n": "num_steps", "scale": "scale"},
                       {"x": "latent"})),
                 until=MaxSteps(value="num_steps"), value="latent"),
            Stream("latent", Step("vae", "decode", {"z": "latent"}, {"image": "image"}), Last()),
            Emit("image", modality="data"),
            inputs=("image_ids", "text_ids", "latent", "num_steps", "scale")),
    }
    default_walk = "generate"

    def __init__(self, name: str = "toy-image", seed: int = 0) -> None:
        super().__init__(name)
        torch.manual_seed(seed)
        self.denoiser = Denoiser().eval()
        self.scheduler = Scheduler()
        self.vae = Vae().eval()

    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
        module = {"llm": self.denoiser, "sched": self.scheduler, "vae": self.vae}[component]
        return module.to(device, dtype)

    def prepare_inputs(self, request: GenerateRequest, sampling: SamplingParams) -> PreparedPiece:
        inputs = request.inputs
        values = {"latent": inputs["latent"].float(), "num_steps": torch.tensor(int(inputs["num_steps"]))}
        if request.walk == "generate_cfg":
            values |= {"image_ids": torch.tensor(list(inputs["image_ids"]), dtype=torch.long),
                       "text_ids": torch.tensor(list(inputs["text_ids"]), dtype=torch.long),
                       "scale": torch.tensor(float(inputs["scale"]))}
            return PreparedPiece(values, len(inputs["image_ids"]) + 2 * len(inputs["text_ids"]))
        ids = list(inputs["prompt_ids"])
        return PreparedPiece({"prompt_ids": torch.tensor(ids, dtype=torch.long), **values}, len(ids))
