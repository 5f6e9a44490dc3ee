"""Qwen3-Omni's components and walks in the runtime's vocabulary: the mode
signatures of each part (built from the checkpoint's ids) and one walk per
shape of request, named `chat` (text out) or `speak` (text and speech out),
with `+audio` / `+image` when the prompt carries them, so a request runs only
the encoders its prompt needs.

The thinker's prefill takes the encoders' rows at their placeholder tokens,
an image's deepstack features, and 3-axis positions; it writes the first text
token and, for the talker, the rows of the layer the talker reads.

Speaking, the thinker's text streams token by token into the talker's
partition (lockstep: talker step k needs text token k + 1 only): its prefill
reads the first token, each `speak` step the next one, then tts_eos once the
text is over, then tts_pad. A `speak` step completes a frame (the code
predictor runs inside it) and draws the next frame's first code; frames
stream one by one into code2wav, whose per-row state makes the streamed
waveform the whole decode's, sample for sample.
"""

from __future__ import annotations

from mstar.graph import (Component, Emit, EosToken, HostStop, In, Items, Kind, Loop, MaxTokens, Mode, Out, Partition,
                         Step, Stream, Walk)
from mstar.models.qwen3_omni.config import Qwen3OmniConfig, TokenIds
from mstar.models.vision.encoding import vision_component

TEXT_OUT = "chat"
SPEECH_OUT = "speak"
TTS = "tts"
CONVERSE = "converse"
SAMPLE_RATE = 24000  # code2wav's output: 1920 samples a frame, 80 ms


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


def talker_component(cfg: Qwen3OmniConfig) -> Component:
    """`prefill` (a prompt without media needs no thinker rows: `hidden` is
    optional), `speak` (the step's text token streamed in), `read` (the same,
    the text token taken from a script the request gave: text to speech)."""
    # the prompt, first token and voice are read in Python to lay the talker's prompt out: on the host
    prefill = Mode("prefill", (In("ids", Kind.IDS),
                               In("prompt", Kind.TENSOR, ragged=True, host=True),
                               In("hidden", Kind.TENSOR, ragged=True, optional=True),
                               In("first", Kind.TENSOR, host=True), In("voice", Kind.TENSOR, host=True),
                               In("pos", Kind.POSITIONS, axes=3, optional=True)),
                   (Out("code", Kind.TOKEN), Out("last", Kind.HIDDEN)), kv="append", query="ids")
    frame_out = (Out("code", Kind.TOKEN), Out("last", Kind.HIDDEN), Out("frame", Kind.TENSOR))
    draws = cfg.talker.num_code_groups - 1
    speak = Mode("speak", (In("ids", Kind.IDS), In("last", Kind.TENSOR), In("text", Kind.TENSOR)), frame_out,
                 kv="append", query="ids", draws=draws, graph=True)
    read = Mode("read", (In("ids", Kind.IDS), In("last", Kind.TENSOR), In("script", Kind.TENSOR, ragged=True),
                         In("at", Kind.INDEX)), frame_out, kv="append", query="ids", draws=draws)
    # urgent: a frame is a chain of small kernels (15 code-predictor forwards); beside the thinker's MoE decode
    # they would wait for SMs
    return Component(modes=(prefill, speak, read), kv_cache=True, samples=True, urgent=True)


# on a CUDA stream of its own: a frame's waveform overlaps the talker's next frame
CODE2WAV_COMPONENT = Component(modes=(Mode("frame", (In("codes", Kind.TENSOR),), (Out("pcm", Kind.TENSOR),)),),
                               state=True, own_stream=True)


def walk_name(speech: bool, audio: bool, image: bool) -> str:
    return (SPEECH_OUT if speech else TEXT_OUT) + ("+audio" if audio else "") + ("+image" if image else "")


# the clips' frame counts lay the encoder's batch out in Python: on the host
AUDIO_COMPONENT = Component(modes=(Mode("encode", (In("mel", Kind.TENSOR, ragged=True),
                                                  In("frames", Kind.TENSOR, ragged=True, host=True)),
                                              (Out("rows", Kind.TENSOR),)),))
VISION_COMPONENT = vision_component(deepstack=True)


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


def speak_walk(audio: bool, image: bool, ids: TokenIds, turns: bool = False) -> Walk:
    """Text and speech out: `chat_walk`'s thinker, its text streamed into the
    talker (special tokens stay out: the text ends where they begin) and the
    talker's frames into code2wav. With `turns` (the `converse` walk: audio
    in, full duplex) the request takes more user turns while it runs (audio
    and text pieces, `Model.prepare_more`): each is a thinker turn on its KV
    cache, and the talker starts over at each turn's first text token on its
    own cache, its prompt the turn's user rows and assistant rows, positions
    going on from its cache."""
    encode, reads, media = _encoders(audio, image)
    prefill_in = {"ids": "prompt_ids", "pos": "positions", **reads}
    talker_in = {"ids": "talker_ids", "prompt": "prompt_ids", "hidden": "prompt_hidden", "first": "next_text",
                 "voice": "voice"}
    if not turns:
        talker_in["pos"] = "talker_positions"
    talker = Partition(
        "talker",
        Step("talker", "prefill", talker_in, {"code": "code0", "last": "last"}),
        Loop(Step("talker", "speak", {"ids": "code0", "last": "last", "text": "next_text"},
                  {"code": "code0", "last": "last", "frame": "frame"}, draws="cp"),
             until=EosToken() | MaxTokens(), value="code0"),
        Stream("frame", Step("code2wav", "frame", {"codes": "frame"}, {"pcm": "pcm"}), Items()),
        Emit("pcm", modality="audio", sample_rate=SAMPLE_RATE))
    return Walk(
        *encode,
        Step("thinker", "prefill", prefill_in, {"token": "text", "hidden": "prompt_hidden"}),
        Loop(Step("thinker", "decode", {"ids": "text"}, {"token": "text"}),
             until=EosToken() | MaxTokens() | HostStop()),
        Emit("text", modality="text"),
        Stream("text", chunks=Items(fill=(ids.tts_eos, ids.tts_pad)), accept=(0, ids.im_start - 1),
               as_="next_text", into=talker, on_turn="restart" if turns else "segment"),
        inputs=("prompt_ids", "positions", "talker_ids", *(() if turns else ("talker_positions",)), "voice",
                *media),
        more_input=("prompt_ids", "positions", "talker_ids", *media) if turns else None,
    )


def tts_walk() -> Walk:
    """Text to speech without the thinker: the text is the assistant's answer
    to a user turn of the same text (a talker's prompt needs a user turn), read
    by the talker token by token (`script`, one token a frame as the thinker
    would have written it), its frames into code2wav."""
    return Walk(
        Step("talker", "prefill", {"ids": "talker_ids", "prompt": "prompt_ids", "first": "script_first",
                                   "voice": "voice", "pos": "talker_positions"},
             {"code": "code0", "last": "last"}),
        Loop(Step("talker", "read", {"ids": "code0", "last": "last", "script": "script", "at": "@i"},
                  {"code": "code0", "last": "last", "frame": "frame"}, draws="cp"),
             until=EosToken() | MaxTokens() | HostStop(), value="code0"),
        Stream("frame", Step("code2wav", "frame", {"codes": "frame"}, {"pcm": "pcm"}), Items()),
        Emit("pcm", modality="audio", sample_rate=SAMPLE_RATE),
        inputs=("prompt_ids", "talker_ids", "talker_positions", "voice", "script", "script_first"),
    )


def walks(cfg: Qwen3OmniConfig) -> dict[str, Walk]:
    """Every walk the model serves, by name."""
    out = {TTS: tts_walk(), CONVERSE: speak_walk(audio=True, image=False, ids=cfg.ids, turns=True)}
    for audio in (False, True):
        for image in (False, True):
            out[walk_name(False, audio, image)] = chat_walk(audio, image)
            out[walk_name(True, audio, image)] = speak_walk(audio, image, cfg.ids)
    return out
