"""Qwen3.5's components and walks in the runtime's vocabulary.

`llm` (the decoder: KV pages for its attention layers, a state slot per row
for its delta nets) prefills and decodes token ids by name. With a vision
tower it also has `prefill_image`: token ids, the tower's rows at the image
placeholders and 3-axis positions in, the first token out; the runtime sets
the row's rope delta from those positions, and the decode steps after it go
on from there.

`generate` serves text prompts (their prefill may run in chunks);
`generate+image` first runs the tower (`vision`) over the prompt's images,
then `prefill_image` (a step of a mode with a signature runs whole: the
runtime does not split one, so no chunk boundary falls inside an image).
"""

from __future__ import annotations

from mstar.graph import Component, Emit, EosToken, HostStop, In, Kind, Loop, MaxTokens, Mode, Out, Step, Walk
from mstar.models.base import text_walk
from mstar.models.qwen3_5.config import Qwen35Config
from mstar.models.vision.encoding import vision_component

GENERATE = "generate"
GENERATE_IMAGE = "generate+image"


def components(cfg: Qwen35Config) -> dict[str, Component]:
    modes: tuple[str | Mode, ...] = ("prefill", "decode")
    if cfg.image_tokens is None:
        return {"llm": Component(modes=modes, kv_cache=True, samples=True, state=True)}
    prefill = Mode("prefill_image", (In("ids", Kind.IDS), In("image", Kind.EMBEDS, at=cfg.image_tokens.image),
                                     In("pos", Kind.POSITIONS, axes=3)),
                   (Out("token", Kind.TOKEN),), kv="append", query="ids")
    return {"llm": Component(modes=(*modes, prefill), kv_cache=True, samples=True, state=True),
            "vision": vision_component(deepstack=False)}


def walks(cfg: Qwen35Config) -> dict[str, Walk]:
    out = {GENERATE: text_walk("llm")}
    if cfg.vision is not None:
        out[GENERATE_IMAGE] = Walk(
            Step("vision", "encode", {"pixels": "image_pixels", "grids": "image_grids"}, {"rows": "image_rows"}),
            Step("llm", "prefill_image", {"ids": "prompt_ids", "image": "image_rows", "pos": "positions"},
                 {"token": "token"}),
            Loop(Step("llm", "decode", "token", "token"), until=EosToken() | MaxTokens() | HostStop()),
            Emit("token", modality="text"),
            inputs=("prompt_ids", "positions", "image_pixels", "image_grids"),
        )
    return out
