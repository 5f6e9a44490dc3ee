"""The Qwen3-Omni talker and code predictor against transformers: a tiny
random model saved as transformers saves it, the talker loaded by mstar's
loader, and transformers' `generate(return_audio=True)` with sampling off
(no repetition penalty) as the reference, for a text prompt with a system
turn, a prompt whose user turn holds audio (the talker reads the thinker's
accept-layer rows there) and one whose user turn holds an image (3-axis
positions with a rope delta).

mstar's side is driven as the runtime will drive it: `talker_prompt` builds
the prefill rows from the thinker's prompt ids, its accept-layer rows at the
placeholders (transformers' thinker gives them: mstar's encoders are not
here yet) and its first token; then `speak` steps over a dense KV cache,
drawing greedily (the talker's suppressed ids masked), with the text side of
step k from `text_side_id` (text token k + 1, then tts_eos, then tts_pad).
All in float32; codes must be equal, rows and logits close (1e-5 and 1e-4
absolute: a few float32 roundings of values of order one, where a wrong row
or weight moves them by more than 1e-2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from mstar.errors import ConfigError, RequestError
from mstar.models.qwen3_omni.builtins import QWEN3_OMNI_TINY
from mstar.models.qwen3_omni.config import Qwen3OmniConfig
from mstar.models.qwen3_omni.loader import load_talker
from mstar.models.qwen3_omni.positions import audio_tokens
from mstar.models.qwen3_omni.speech.talker import TalkerDecoder, suppressed_codes
from mstar.models.qwen3_omni.speech.talker_prompt import (TalkerPrompt, talker_embeds, talker_prompt, talker_rows,
                                                          text_side_id, user_turns, voice_id)
from mstar.types import TokenBatch
from test_qwen3_omni_thinker import DenseCache, saved  # noqa: F401  (`saved`: the fixture, a random tiny model)

IM_START, IM_END, SYSTEM, USER, ASSISTANT, NL = 151644, 151645, 8948, 872, 77091, 198
AUDIO, AUDIO_START, AUDIO_END, IMAGE, VISION_START, VISION_END = 151675, 151669, 151670, 151655, 151652, 151653
SYSTEM_TURN = [IM_START, SYSTEM, NL, 100, 101, IM_END, NL]
HEADER = [IM_START, ASSISTANT, NL]
MEL_FRAMES = 50
AUDIO_TOKENS = audio_tokens(MEL_FRAMES)
GRID = (1, 4, 4)  # one image of 4 x 4 patches: 2 x 2 tokens after the merge
THINKER_TOKENS, TALKER_TOKENS = 4, 8  # the thinker's text runs out at frame 2: tts_eos, then tts_pad


def _case(name: str) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The prompt ids and transformers' multimodal inputs of a case."""
    gen = torch.Generator().manual_seed(1)
    if name == "text":
        return SYSTEM_TURN + [IM_START, USER, NL, 200, 201, 202, 203, IM_END, NL] + HEADER, {}
    if name == "audio":
        ids = SYSTEM_TURN + [IM_START, USER, NL, 300, AUDIO_START] + [AUDIO] * AUDIO_TOKENS + [AUDIO_END, 301, IM_END,
                                                                                                NL] + HEADER
        return ids, {"input_features": torch.randn(1, 128, MEL_FRAMES, generator=gen),
                     "feature_attention_mask": torch.ones(1, MEL_FRAMES, dtype=torch.long)}
    ids = [IM_START, USER, NL, 300, VISION_START] + [IMAGE] * 4 + [VISION_END, 301, 302, IM_END, NL] + HEADER
    return ids, {"pixel_values": torch.randn(GRID[0] * GRID[1] * GRID[2], 3 * 2 * 16 * 16, generator=gen),
                 "image_grid_thw": torch.tensor([GRID])}


@dataclass
class Reference:
    """What transformers does with one prompt."""

    prompt: list[int]
    generated: list[int]             # the thinker's tokens
    hidden: torch.Tensor             # [M, Ht] its accept-layer rows where the talker reads them
    grids: list[tuple[int, int, int]]
    embeds: torch.Tensor             # [L, H] the talker's prefill input
    positions: torch.Tensor          # [3, L]
    inputs: list[torch.Tensor]       # each decode step's input row [H]
    step_positions: list[int]        # each decode step's position (equal on the three axes)
    logits: list[torch.Tensor]       # each talker forward's last logits [V]
    predictor: list[torch.Tensor]    # each code predictor forward's last logits [V_cp], G - 1 a frame
    frames: list[list[int]]          # the codes [n_frames][G]


def _reference(model: Any, cfg: Qwen3OmniConfig, name: str) -> Reference:
    prompt, media = _case(name)
    ids = torch.tensor([prompt])
    ref_calls: list[dict[str, Any]] = []
    predictor: list[torch.Tensor] = []
    codes: list[torch.Tensor] = []

    def before(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        ref_calls.append({"embeds": kwargs["inputs_embeds"][0], "positions": kwargs["position_ids"][1:, 0]})

    def after(_module: Any, _args: Any, _kwargs: Any, out: Any) -> None:
        ref_calls[-1]["logits"] = out.logits[0, -1]

    decode = model.code2wav.chunked_decode

    def capture(c: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        codes.append(c[0].T.clone())
        return decode(c, *args, **kwargs)

    hooks = [model.talker.register_forward_pre_hook(before, with_kwargs=True),
             model.talker.register_forward_hook(after, with_kwargs=True),
             model.talker.code_predictor.register_forward_hook(lambda _m, _a, out: predictor.append(out.logits[0, -1]))]
    model.code2wav.chunked_decode = capture
    try:
        seqs, _ = model.generate(input_ids=ids, return_audio=True, thinker_max_new_tokens=THINKER_TOKENS,
                                 talker_max_new_tokens=TALKER_TOKENS, thinker_do_sample=False,
                                 talker_do_sample=False, talker_repetition_penalty=1.0, **media)
    finally:
        for h in hooks:
            h.remove()
        del model.code2wav.chunked_decode
    states = model.thinker(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True,
                           **media).hidden_states
    hidden = states[cfg.talker.accept_hidden_layer][0][talker_rows(prompt, cfg.ids)]
    prefill, *steps = ref_calls
    return Reference(prompt, seqs[0, len(prompt):].tolist(), hidden, [GRID] if name == "image" else [],
                     prefill["embeds"], prefill["positions"], [s["embeds"][0] for s in steps],
                     [int(s["positions"][0, 0]) for s in steps], [c["logits"] for c in ref_calls], predictor,
                     codes[0].tolist())


@pytest.fixture(scope="module")
def parts(saved) -> tuple[TalkerDecoder, Qwen3OmniConfig, dict[str, Reference]]:
    folder, model = saved
    cfg = Qwen3OmniConfig.from_folder(folder)
    talker = TalkerDecoder(cfg.talker, cfg.thinker.vocab_size).eval()
    load_talker(talker, folder)
    with torch.inference_mode():
        refs = {name: _reference(model, cfg, name) for name in ("text", "audio", "image")}
    return talker, cfg, refs


class Rows:
    """Several requests' attention in one packed step: each row over its own
    dense cache."""

    def __init__(self, n: int) -> None:
        self.rows = [DenseCache() for _ in range(n)]
        self.query_start: list[int] = []

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        spans = list(zip(self.query_start, self.query_start[1:]))
        return torch.cat([row.forward(layer, q[a:b], k[a:b], v[a:b], scale) for row, (a, b) in zip(self.rows, spans)])


@dataclass
class Run:
    """mstar's talker over some requests, step by step."""

    prompts: list[TalkerPrompt]
    inputs: list[torch.Tensor] = field(default_factory=list)   # speak steps' input rows [B, H]
    positions: list[list[int]] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)   # [B, V] per step, prefill first
    predictor: list[torch.Tensor] = field(default_factory=list)  # [B, V_cp] per code predictor draw
    frames: list[torch.Tensor] = field(default_factory=list)   # [B, G] per speak step


def _greedy(logits: torch.Tensor, suppressed: torch.Tensor) -> torch.Tensor:
    return logits.index_fill(-1, suppressed, float("-inf")).argmax(-1)


def _speak(talker: TalkerDecoder, cfg: Qwen3OmniConfig, refs: list[Reference], steps: int) -> Run:
    """Prefill the requests as one packed batch, then `steps` speak steps
    (or until a row draws codec_eos)."""
    prompts = [talker_prompt(talker, cfg, r.prompt, r.hidden, r.generated[0], "Ethan", image_grids=r.grids)
               for r in refs]
    run, attn = Run(prompts), Rows(len(refs))
    lengths = [p.embeds.shape[0] for p in prompts]
    attn.query_start = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    total = attn.query_start[-1]
    out = talker.prefill(TokenBatch(input_ids=torch.zeros(total, dtype=torch.long),
                                    positions=torch.cat([p.positions for p in prompts], dim=1),
                                    query_start=torch.tensor(attn.query_start),
                                    logits_index=torch.tensor(attn.query_start[1:]) - 1, attn=attn,
                                    embeds={"ctx": (torch.cat([p.embeds for p in prompts]), torch.arange(total))}))
    suppressed = suppressed_codes(cfg.talker)
    run.logits.append(out["logits"])
    code = _greedy(out["logits"], suppressed)
    seen = talker.layers[0].register_forward_pre_hook(lambda _m, args: run.inputs.append(args[0]))
    attn.query_start = list(range(len(refs) + 1))
    try:
        for k in range(steps):
            if (code == cfg.talker.codec_eos_id).any():
                break
            # transformers forwards all but the thinker's last token (it stops at its token budget here)
            text = [text_side_id(r.generated[:-1], k, cfg.ids, {IM_END}, finished=True) for r in refs]
            position = [n + k + p.rope_delta for n, p in zip(lengths, prompts)]
            out = talker.speak(TokenBatch(input_ids=code, positions=torch.tensor(position).expand(3, -1),
                                          query_start=torch.tensor(attn.query_start),
                                          logits_index=torch.arange(len(refs)), attn=attn,
                                          extra={"last": out["last"], "text": talker.text_rows(torch.tensor(text))},
                                          draw=lambda logits, _j: run.predictor.append(logits) or logits.argmax(-1)))
            run.positions.append(position)
            run.logits.append(out["logits"])
            run.frames.append(out["frame"])
            code = _greedy(out["logits"], suppressed)
    finally:
        seen.remove()
    return run


@pytest.mark.parametrize("name", ["text", "audio", "image"])
@torch.inference_mode()
def test_the_talker_prompt_is_transformers(parts, name: str) -> None:
    """Rows of the user turns (system turn dropped; audio and image rows
    through the hidden projection), the 9 assistant rows and the 3-axis
    positions equal those transformers' talker prefills with."""
    talker, cfg, refs = parts
    ref = refs[name]
    prompt = talker_prompt(talker, cfg, ref.prompt, ref.hidden, ref.generated[0], "ETHAN", image_grids=ref.grids)
    assert prompt.embeds.shape == ref.embeds.shape
    torch.testing.assert_close(prompt.embeds, ref.embeds, atol=1e-5, rtol=1e-5)
    assert torch.equal(prompt.positions, ref.positions.long())
    if name == "image":  # the 2 x 2 tokens take 2 positions on each axis where the sequence takes 4
        assert prompt.rope_delta == -2 and ref.step_positions[0] == ref.embeds.shape[0] - 2
    if name == "audio":
        assert ref.hidden.shape[0] == AUDIO_TOKENS


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)"))])
@torch.inference_mode()
def test_prompts_laid_out_together_are_each_alone_and_wait_for_nothing(parts, device: str) -> None:
    """The talker prefill lays every row's prompt out at once: the rows of
    text, audio and image prompts together equal each prompt's alone (1e-6),
    and on CUDA nothing in it waits for the device (sync debug mode raises)."""
    import copy

    talker, cfg, refs = parts
    order = [refs[name] for name in ("audio", "text", "image", "audio")]
    alone = torch.cat([talker_prompt(talker, cfg, r.prompt, r.hidden, r.generated[0], "ethan",
                                     image_grids=r.grids).embeds for r in order])
    here = copy.deepcopy(talker).to(device)
    hidden = torch.cat([r.hidden for r in order]).to(device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        together = talker_embeds(here, cfg, [r.prompt for r in order], hidden, [r.generated[0] for r in order],
                                 [voice_id(cfg, "ethan")] * len(order))
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(together.cpu(), alone, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["text", "audio", "image"])
@torch.inference_mode()
def test_greedy_frames_are_transformers(parts, name: str) -> None:
    """Frame for frame, the codes transformers decodes to audio; on the way,
    each step's input row (the frame's code embeddings summed plus the text
    side), position and logits, and the code predictor's logits for each
    of its draws."""
    talker, cfg, refs = parts
    ref = refs[name]
    run = _speak(talker, cfg, [ref], TALKER_TOKENS - 1)
    assert len(ref.frames) == TALKER_TOKENS - 1  # no codec_eos: every step made a frame
    assert [f[0].tolist() for f in run.frames] == ref.frames
    assert [p[0] for p in run.positions] == ref.step_positions
    torch.testing.assert_close(torch.cat(run.inputs), torch.stack(ref.inputs), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(run.logits)[:len(ref.logits)], torch.stack(ref.logits), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(run.predictor), torch.stack(ref.predictor), atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_a_packed_batch_speaks_as_each_request_alone(parts) -> None:
    """Three requests of different prompt lengths and rope deltas, prefilled
    in one packed step and spoken together (the code predictor batched over
    their frames), give each its own transformers frames."""
    talker, cfg, refs = parts
    order = [refs["image"], refs["text"], refs["audio"]]
    run = _speak(talker, cfg, order, TALKER_TOKENS - 1)
    for row, ref in enumerate(order):
        assert [f[row].tolist() for f in run.frames] == ref.frames


def test_text_side_follows_the_thinker_in_lockstep() -> None:
    """Step k speaks text token k + 1 once the thinker has written it; its
    EOS (or its end) becomes tts_eos, then tts_pad."""
    ids = Qwen3OmniConfig.from_dict(QWEN3_OMNI_TINY).ids
    written = [7, 8, 9]
    assert [text_side_id(written, k, ids, {IM_END}, finished=False) for k in range(3)] == [8, 9, None]
    assert [text_side_id(written, k, ids, {IM_END}, finished=True) for k in range(4)] == [8, 9, ids.tts_eos,
                                                                                          ids.tts_pad]
    ended = [7, 8, IM_END]
    assert [text_side_id(ended, k, ids, {IM_END}, finished=False) for k in range(4)] == [8, ids.tts_eos,
                                                                                         ids.tts_pad, ids.tts_pad]


def test_user_turns_drop_system_and_earlier_assistant_turns() -> None:
    ids = Qwen3OmniConfig.from_dict(QWEN3_OMNI_TINY).ids
    prompt = SYSTEM_TURN + [IM_START, USER, NL, 5, IM_END, NL, IM_START, ASSISTANT, NL, 6, IM_END, NL,
                            IM_START, USER, NL, 7, IM_END, NL] + HEADER
    kept = [t for t, u in zip(prompt, user_turns(prompt, ids)) if u]
    assert kept == [IM_START, USER, NL, 5, IM_END, NL, IM_START, USER, NL, 7, IM_END, NL]


@torch.inference_mode()
def test_an_unknown_voice_or_a_prompt_without_the_assistant_header_is_refused(parts) -> None:
    talker, cfg, refs = parts
    ref = refs["text"]
    with pytest.raises(RequestError, match="chelsie, ethan") as e:
        talker_prompt(talker, cfg, ref.prompt, ref.hidden, 5, "Vivian", voice_field="audio.voice")
    assert e.value.field == "audio.voice"
    with pytest.raises(RequestError, match="assistant's header") as e:
        talker_prompt(talker, cfg, ref.prompt[:-3], ref.hidden, 5, "ethan")
    assert e.value.field == "input"


def test_a_talker_checkpoint_short_of_a_tensor_or_with_a_stray_one_is_refused(saved, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder, _ = saved
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["talker.model.layers.1.mlp.shared_expert.up_proj.weight"]
    del tensors["talker.code_predictor.lm_head.2.weight"]
    tensors["talker.code_predictor.model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = Qwen3OmniConfig.from_folder(folder)
    with pytest.raises(ConfigError, match=r"missing 2 tensor\(s\): code_predictor\.lm_head\.2\.weight, "
                                          r"layers\.1\.mlp\.shared\.gate_up\.weight; unexpected 1 tensor\(s\): "
                                          r"talker\.code_predictor\.model\.layers\.0\.mlp\.extra\.weight"):
        load_talker(TalkerDecoder(cfg.talker, cfg.thinker.vocab_size), tmp_path)
