"""The talker's prefill input for one request: the thinker's prompt ids, the
thinker's `accept_hidden_layer` rows where the talker reads them, the first
generated text token and the voice in; the talker prompt's input rows (text
side plus codec side), its 3-axis positions and rope delta out. Then, step
by step, which thinker token is the text side of each `speak` step.

The prompt is the user turns (a token belongs to the turn of the latest
`<|im_start|>` at or before it, so system turns and earlier assistant turns
drop out), then 9 assistant rows:

    row        0-2                      3-6             7              8
    text side  <|im_start|>assistant\\n  tts_pad         tts_bos        first text token
    codec side -                        nothink, think_bos, think_eos, voice   codec_pad  codec_bos

A user token's row is `text_projection` of its embedding, or, at an audio,
image or video placeholder, `hidden_projection` of the thinker's
accept-layer row there. The thinker's layer-0 row at a text token is that
token's embedding, so the talker computes text rows from ids with its copy
of the table; only the placeholders' accept-layer rows cross over.
Positions are M-RoPE positions of the talker's own sequence (the user
tokens, then 9 tts_pad): images on their grids, audio one a token as text.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from mstar.errors import RequestError
from mstar.kernels.host_copy import index_on
from mstar.models.qwen3_omni.config import Qwen3OmniConfig, TokenIds
from mstar.models.qwen3_omni.positions import mrope_positions
from mstar.models.qwen3_omni.speech.talker import TalkerDecoder
from mstar.models.vision.positions import NOT_A_TOKEN  # as the audio id: audio placeholders get text positions

ASSISTANT_ROWS = 9


@dataclass(frozen=True)
class TalkerPrompt:
    """`embeds` [L, H] in the talker's dtype and device; `positions` [3, L]
    int64; `speak` step k (k = 0, 1, ...) sits at position L + k +
    `rope_delta` on all three axes."""

    embeds: torch.Tensor
    positions: torch.Tensor
    rope_delta: int


def user_turns(prompt_ids: Sequence[int], ids: TokenIds) -> list[bool]:
    """Per prompt token: whether it belongs to a user turn (the turn's
    `<|im_start|>`, role, content, `<|im_end|>` and what follows up to the
    next `<|im_start|>`)."""
    out, role = [], None
    for i, token in enumerate(prompt_ids):
        if token == ids.im_start:
            role = prompt_ids[i + 1] if i + 1 < len(prompt_ids) else None
        out.append(role == ids.user)
    return out


def talker_rows(prompt_ids: Sequence[int], ids: TokenIds) -> torch.Tensor:
    """[P] bool: the prompt positions whose accept-layer rows the talker
    reads (audio, image and video placeholders in user turns)."""
    return torch.tensor([bool(read) for read in _user_reads(prompt_ids, ids)], dtype=torch.bool)


def voice_id(cfg: Qwen3OmniConfig, voice: str, field: str = "voice") -> int:
    """The codec id of `voice` (any case); `RequestError` naming `field`
    when the model has no such voice."""
    found = cfg.talker.voices.get(voice.lower())
    if found is None:
        raise RequestError(f"unknown voice {voice!r}; this model speaks {', '.join(sorted(cfg.talker.voices))}",
                           field=field)
    return found


def check_speakable(prompt_ids: Sequence[int], ids: TokenIds) -> None:
    """A prompt the talker can speak the answer to ends with the assistant's
    header (`<|im_start|>assistant\\n`), else `RequestError` ("input")."""
    header = len(prompt_ids) - 3
    if header < 0 or prompt_ids[header] != ids.im_start or prompt_ids[header + 1] != ids.assistant:
        raise RequestError("speech needs the prompt to end with the assistant's header <|im_start|>assistant\\n",
                           field="input")


def talker_positions(cfg: Qwen3OmniConfig, prompt_ids: Sequence[int],
                     image_grids: Sequence[tuple[int, int, int]] = ()) -> tuple[torch.Tensor, int]:
    """The talker prompt's [3, L] positions and rope delta (its user tokens,
    then the assistant rows), from the thinker's prompt alone."""
    ids = cfg.ids
    prompt = [int(t) for t in prompt_ids]
    user = user_turns(prompt, ids)
    user_ids = [t for t, u in zip(prompt, user) if u]
    starts = [i for i, token in enumerate(prompt) if token == ids.image and (i == 0 or prompt[i - 1] != ids.image)]
    grids = [grid for grid, start in zip(image_grids, starts) if user[start]]
    return mrope_positions(user_ids + [ids.tts_pad] * ASSISTANT_ROWS, audio_id=NOT_A_TOKEN, image_id=ids.image,
                           image_grids=grids, spatial_merge=cfg.vision.spatial_merge_size,
                           per_second=cfg.position_id_per_seconds)


def talker_prompt(talker: TalkerDecoder, cfg: Qwen3OmniConfig, prompt_ids: Sequence[int], hidden: torch.Tensor,
                  first_token: int, voice: str, *, image_grids: Sequence[tuple[int, int, int]] = (),
                  voice_field: str = "voice") -> TalkerPrompt:
    """`hidden` [M, Ht]: the thinker's accept-layer rows at the positions
    `talker_rows` marks, in order; `image_grids`: (t, h, w) of every image
    of the prompt, in order. The prompt must end with the assistant's
    header (`check_speakable`)."""
    ids = cfg.ids
    prompt = [int(t) for t in prompt_ids]
    check_speakable(prompt, ids)
    positions, delta = talker_positions(cfg, prompt, image_grids)
    embeds = talker_embeds(talker, cfg, [prompt], hidden, [first_token], [voice_id(cfg, voice, voice_field)])
    return TalkerPrompt(embeds, positions, delta)


def talker_embeds(talker: TalkerDecoder, cfg: Qwen3OmniConfig, prompts: Sequence[Sequence[int]],
                  hidden: torch.Tensor, firsts: Sequence[int] | torch.Tensor,
                  voice_codes: Sequence[int]) -> torch.Tensor:
    """Talker prompts' input rows (each `talker_prompt`'s `embeds`), prompt
    after prompt [sum of L, H], for prompts already checked speakable:
    `hidden` [M, Ht] the accept-layer rows they read (`talker_rows`), prompt
    after prompt; each prompt's first text token and voice codec id.

    One text projection, one hidden projection and one codec lookup for all
    prompts, their row indices built on the host and copied at once: nothing
    here waits for the device (the first tokens, if on the device, are never
    read back)."""
    ids, t = cfg.ids, cfg.talker
    weight = talker.codec_embedding.weight
    text_ids: list[int] = []  # user text tokens and each prompt's first 8 assistant rows' text side
    text_at: list[int] = []
    first_at: list[int] = []
    hidden_at: list[int] = []
    codec_ids: list[int] = []
    codec_at: list[int] = []
    row = 0
    for prompt, voice in zip(prompts, voice_codes):
        prompt = [int(token) for token in prompt]
        for token, read in zip(prompt, _user_reads(prompt, ids)):
            if read is None:
                continue
            if read:
                hidden_at.append(row)
            else:
                text_ids.append(token)
                text_at.append(row)
            row += 1
        header = len(prompt) - 3
        text_ids += prompt[header:] + [ids.tts_pad] * 4 + [ids.tts_bos]
        text_at += range(row, row + ASSISTANT_ROWS - 1)
        first_at.append(row + ASSISTANT_ROWS - 1)
        codec_ids += [t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id, voice, t.codec_pad_id,
                      t.codec_bos_id]
        codec_at += range(row + 3, row + ASSISTANT_ROWS)
        row += ASSISTANT_ROWS
    if len(hidden_at) != hidden.shape[0]:
        raise ValueError(f"the talker reads {len(hidden_at)} accept-layer rows, got {hidden.shape[0]}")
    firsts = torch.as_tensor(firsts, dtype=torch.long).reshape(-1)
    on_host = firsts.device.type == "cpu"
    lists = [text_ids + (firsts.tolist() if on_host else []), text_at + first_at, hidden_at, codec_at, codec_ids]
    text, text_at_d, hidden_at_d, codec_at_d, codec_d = index_on(sum(lists, []), weight.device).split(
        [len(v) for v in lists])
    if not on_host:
        text = torch.cat([text, firsts.to(weight.device)])
    out = torch.zeros(row, weight.shape[1], dtype=weight.dtype, device=weight.device)
    out.index_copy_(0, text_at_d, talker.text_rows(text).to(out.dtype))
    if hidden_at:
        out.index_copy_(0, hidden_at_d, talker.hidden_projection(hidden.to(weight)).to(out.dtype))
    return out.index_add_(0, codec_at_d, talker.codec_embedding(codec_d))


def _user_reads(prompt: Sequence[int], ids: TokenIds) -> list[bool | None]:
    """Per prompt token: None outside user turns, else whether the talker
    reads its accept-layer row (`talker_rows`) rather than its text."""
    placeholders = (ids.audio, ids.image, ids.video)
    return [(token in placeholders) if user else None for token, user in zip(prompt, user_turns(prompt, ids))]


def text_side_id(generated: Sequence[int], step: int, ids: TokenIds, eos: Collection[int],
                 finished: bool) -> int | None:
    """The thinker id whose `text_rows` is the text side of `speak` step
    `step`, given the thinker's `generated` tokens so far (`finished`: it
    has stopped): text token `step + 1` while the text lasts, then tts_eos
    once in place of the thinker's EOS (or after its last token), then
    tts_pad. None: not known yet, the thinker has not written that token."""
    wanted = step + 1
    end = next((i for i, token in enumerate(generated) if token in eos), None)
    if end is None and wanted < len(generated):
        return generated[wanted]
    if end is None and not finished:
        return None
    end = len(generated) if end is None else end
    return generated[wanted] if wanted < end else ids.tts_eos if wanted == end else ids.tts_pad
