"""Qwen3-Omni's components and walks in the runtime's vocabulary: the mode
signatures of each part (built from the checkpoint's placeholder ids) and one
walk per shape of request, named `chat` (text out) or `speak` (text and
speech out), with `+audio` / `+image` when the prompt carries them, so a
request runs only the encoders its prompt needs.

The thinker's prefill takes the encoders' rows at their placeholder tokens,
an image's deepstack features, and 3-axis positions; it writes the first text
token and, for the talker, its prompt's embeddings and the rows of the layer
the talker reads.
"""

from __future__ import annotations

from mstar.graph import Component, Emit, EosToken, HostStop, In, Kind, Loop, MaxTokens, Mode, Out, Step, Walk
from mstar.models.qwen3_omni.config import TokenIds

TEXT_OUT = "chat"
SPEECH_OUT = "speak"


def thinker_component(ids: TokenIds) -> Component:
    prefill = Mode("prefill", (In("ids", Kind.IDS),
                               In("audio", Kind.EMBEDS, at=ids.audio, optional=True),
                               In("image", Kind.EMBEDS, at=ids.image, optional=True),
                               In("deepstack", Kind.EMBEDS, at=ids.image, optional=True),
                               In("pos", Kind.POSITIONS, axes=3)),
                   (Out("token", Kind.TOKEN), Out("embeds", Kind.HIDDEN, rows="all"),
                    Out("hidden", Kind.HIDDEN, rows="all")),
                   kv="append", query="ids")
    decode = Mode("decode", (In("ids", Kind.IDS),), (Out("token", Kind.TOKEN),), kv="append", query="ids",
                  graph=True)
    return Component(modes=(prefill, decode), kv_cache=True, samples=True)


def walk_name(speech: bool, audio: bool, image: bool) -> str:
    return (SPEECH_OUT if speech else TEXT_OUT) + ("+audio" if audio else "") + ("+image" if image else "")


AUDIO_COMPONENT = Component(modes=(Mode("encode", (In("mel", Kind.TENSOR, ragged=True),
                                                  In("frames", Kind.TENSOR, ragged=True)),
                                              (Out("rows", Kind.TENSOR),)),))
VISION_COMPONENT = Component(modes=(Mode("encode", (In("pixels", Kind.TENSOR, ragged=True),
                                                   In("grids", Kind.TENSOR, ragged=True)),
                                               (Out("rows", Kind.TENSOR), Out("deepstack", Kind.TENSOR))),))


def _encoders(audio: bool, image: bool) -> tuple[list[Step], dict[str, str], list[str]]:
    """The encoder steps a prompt needs, what the thinker's prefill reads of
    them, and the walk inputs they take."""
    steps, reads, inputs = [], {}, []
    if audio:
        steps.append(Step("audio", "encode", {"mel": "audio_mel", "frames": "audio_frames"}, {"rows": "audio_rows"}))
        reads["audio"] = "audio_rows"
        inputs += ["audio_mel", "audio_frames"]
    if image:
        steps.append(Step("vision", "encode", {"pixels": "image_pixels", "grids": "image_grids"},
                          {"rows": "image_rows", "deepstack": "image_deepstack"}))
        reads.update(image="image_rows", deepstack="image_deepstack")
        inputs += ["image_pixels", "image_grids"]
    return steps, reads, inputs


def chat_walk(audio: bool, image: bool) -> Walk:
    """Text out: the encoders the prompt needs, the thinker's prefill, then
    its decode until EOS, the token budget or a stop string."""
    encode, reads, media = _encoders(audio, image)
    prefill_in = {"ids": "prompt_ids", "pos": "positions", **reads}
    inputs = ["prompt_ids", "positions", *media]
    return Walk(
        *encode,
        Step("thinker", "prefill", prefill_in, {"token": "text"}),
        Loop(Step("thinker", "decode", {"ids": "text"}, {"token": "text"}),
             until=EosToken() | MaxTokens() | HostStop()),
        Emit("text", modality="text"),
        inputs=tuple(inputs),
    )


def walks(audio_input: bool, image_input: bool) -> dict[str, Walk]:
    """Every walk the model serves, by name; `audio_input` / `image_input`:
    whether it has the encoder for that input."""
    out = {}
    for audio in (False, True) if audio_input else (False,):
        for image in (False, True) if image_input else (False,):
            out[walk_name(False, audio, image)] = chat_walk(audio, image)
    return out
