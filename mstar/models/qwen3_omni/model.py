"""Qwen3-Omni as a served model: a request in (a prompt of token ids, text
or chat messages whose parts may hold decoded audio and images, read by
`intake.py`; a voice; for `tts`, text), what its walk (`walks.py`, picked by
`walk_for`) starts from out: the thinker's ids and 3-axis positions, the
encoders' inputs (log-mel, image patches), the talker's prompt shape and
voice. Each component's module is built here, from a folder's weights or
seeded random ones (a builtin shape uses the byte tokenizer); later turns of
a `converse` request come through `prepare_more` and `join_turn`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mstar.errors import CONTEXT_EXCEEDED, ConfigError, RequestError
from mstar.graph import Component
from mstar.models.base import KVSpec, Model, RowShape, StateSpec
from mstar.models.checkpoint import check_load_format, generation_eos
from mstar.models.llama.loader import dummy_param, dummy_seed, dummy_weights
from mstar.models.prepared import PreparedPiece
from mstar.models.qwen3_omni import walks
from mstar.models.qwen3_omni.config import Qwen3OmniConfig
from mstar.models.qwen3_omni.encoders.audio import AudioEncoder, load_audio_encoder
from mstar.models.qwen3_omni.encoders.mel import LogMel
from mstar.models.qwen3_omni.encoding import AudioEncoding, pack_clips
from mstar.models.qwen3_omni.intake import Intake, PromptMedia
from mstar.models.qwen3_omni.loader import load_talker, load_thinker, load_vision
from mstar.models.qwen3_omni.speaking import Code2WavSteps, TalkerSteps
from mstar.models.qwen3_omni.speech.code2wav import Code2Wav, load_code2wav
from mstar.models.qwen3_omni.speech.talker import TalkerDecoder
from mstar.models.qwen3_omni.speech.talker_prompt import check_speakable, talker_positions, voice_id
from mstar.models.qwen3_omni.positions import audio_tokens, mrope_positions
from mstar.models.qwen3_omni.thinker import ThinkerDecoder
from mstar.models.tokenizer import Tokenizer, builtin_byte_tokenizer
from mstar.models.vision.encoder import VisionEncoder
from mstar.models.vision.encoding import VisionEncoding
from mstar.models.vision.patches import MAX_PIXELS, MIN_PIXELS, ImagePatches
from mstar.models.vision.preprocessor import PatchRecipe
from mstar.types import GenerateRequest, SamplingParams

DUMMY_SEED = 0
DEFAULT_VOICE = "ethan"       # transformers' generate() speaks as Ethan unless told
TALKER_MAX_FRAMES = 4096      # the released talker's token budget: about 327 s of speech


class Qwen3OmniModel(Model):
    default_walk = walks.TEXT_OUT
    input_modalities = ("text", "audio", "image")
    tts_walk = walks.TTS
    spoken_chat_walk = walks.SPEECH_OUT  # `walk_for` adds the encoders a prompt's media need
    spoken_audio_key = "talker"

    def __init__(self, name: str, path: str | Path | None, load_format: str = "auto",
                 max_model_len: int | None = None, *, builtin: Mapping[str, Any] | None = None) -> None:
        """From the folder `path`, or (`path` None) from the config.json-style
        dict `builtin`, with seeded random weights and the byte tokenizer."""
        super().__init__(name)
        check_load_format(load_format)
        self.path = Path(path) if path is not None else None
        if self.path is None:
            if builtin is None:
                raise ConfigError(f"model '{name}' needs a folder or a builtin config")
            if load_format != "dummy":
                raise ConfigError(f"model '{name}' is a shape without a checkpoint: serve a folder of its "
                                  f"weights, or --load-format dummy for random weights of its shape")
            self.config, self.load_format = Qwen3OmniConfig.from_dict(builtin), "dummy"
            self._tokenizer: Tokenizer | None = builtin_byte_tokenizer()
            self._eos: tuple[int, ...] = (self.config.ids.im_end,)
        else:
            self.config, self.load_format = Qwen3OmniConfig.from_folder(self.path), load_format
            self._tokenizer = Tokenizer.from_folder(self.path) if (self.path / "tokenizer.json").is_file() else None
            self._eos = generation_eos(self.path) or (self.config.ids.im_end,)
        positions = self.config.thinker.max_position_embeddings
        if max_model_len is not None and not 0 < max_model_len <= positions:
            raise ConfigError(f"--max-model-len {max_model_len} is outside 1..{positions} for model '{name}'")
        self._max_model_len = max_model_len or positions
        self.components: dict[str, Component] = {
            "thinker": walks.thinker_component(self.config.ids), "audio": walks.AUDIO_COMPONENT,
            "vision": walks.VISION_COMPONENT, "talker": walks.talker_component(self.config),
            "code2wav": walks.CODE2WAV_COMPONENT}
        self.walks = walks.walks(self.config)
        # the default first: what a client naming no voice hears, wherever it asks (a realtime session takes the first)
        self.voices = tuple(sorted(self.config.talker.voices, key=lambda v: v != DEFAULT_VOICE))
        self._state_dtype = torch.float32  # code2wav's state: its compute dtype, known once it is built
        self._mel = LogMel(self.config.audio.num_mel_bins)
        # Qwen2-VL's pixel budget (the patches' defaults), mean and std 0.5
        self.patch_recipe = PatchRecipe.for_encoder(self.config.vision, MIN_PIXELS, MAX_PIXELS)
        self.intake = Intake(self.config.ids, self._tokenizer, audio=self._audio_part, image=self._image_part)

    @property
    def random_weights(self) -> bool:
        return self.load_format == "dummy"

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def eos_ids(self, key: str) -> tuple[int, ...]:
        """The talker draws codec ids: its speech ends at the codec's EOS, not
        the text's; the code predictor's draws (`cp`) end by their count."""
        return {"talker": (self.config.talker.codec_eos_id,), "cp": ()}.get(key, self._eos)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def walk_for(self, request: GenerateRequest) -> str:
        """`chat` or `speak` as asked, with the encoders the prompt's media need."""
        asked = request.walk or self.default_walk
        if asked not in (walks.TEXT_OUT, walks.SPEECH_OUT):
            return asked  # `tts`, or a walk named in full
        kinds = {part.get("type") for message in request.inputs.get("messages") or ()
                 if isinstance(message, Mapping) and isinstance(message.get("content"), list)
                 for part in message["content"] if isinstance(part, Mapping)}
        return walks.walk_name(asked == walks.SPEECH_OUT, "audio" in kinds, "image" in kinds)

    def default_sampling(self, key: str | None = None) -> SamplingParams:
        """The released generation defaults: the talker's first codes and the
        code predictor's draws (`cp`) sample; the thinker's text follows the
        request, over the folder's generation config (`generation_defaults`)."""
        if key == "talker":  # its budget within what a context of this server holds, so that it is valid here
            return SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05,
                                  max_tokens=min(TALKER_MAX_FRAMES, self._max_model_len))
        if key == "cp":
            return SamplingParams(temperature=1.0, top_k=50, top_p=0.8)
        return SamplingParams(max_tokens=None).replace(**self.generation_defaults)

    def graph_rows(self, component: str, mode: str) -> tuple[RowShape, ...] | None:
        """The talker's frame step under CUDA graphs: besides its first code,
        the last hidden state (float32 holds any serving dtype exactly) and
        the text token."""
        if (component, mode) != ("talker", "speak"):
            return None
        return RowShape((self.config.talker.decoder.hidden_size,), torch.float32), RowShape((), torch.long)

    def state_spec(self, component: str) -> StateSpec:
        if component != "code2wav":
            raise ConfigError(f"model '{self.name}' keeps no per-row state for '{component}'")
        return Code2Wav(self.config.code2wav, device="meta").state_spec(self._state_dtype)

    def kv_spec(self, component: str) -> KVSpec:
        if component not in ("thinker", "talker"):
            raise ConfigError(f"model '{self.name}' has no KV cache for '{component}'")
        cfg = self.config.thinker if component == "thinker" else self.config.talker.decoder
        # the thinker's pages keep each prompt token's `hidden` row (what its talker reads), so a spoken answer
        # whose prompt starts from cached pages still hands the talker every row: a few % more memory a page
        rows = (("hidden", cfg.hidden_size),) if component == "thinker" else ()
        return KVSpec(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                      num_q_heads=cfg.num_attention_heads, token_rows=rows)

    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        if component == "thinker":
            module = ThinkerDecoder(self.config.thinker, self.config.talker.accept_hidden_layer, device=device,
                                    dtype=dtype)
            load = load_thinker
        elif component == "audio":
            module = AudioEncoder(self.config.audio, device=device, dtype=dtype)
            load = load_audio_encoder
        elif component == "vision":
            module = VisionEncoder(self.config.vision, device=device, dtype=dtype)
            load = load_vision
        elif component == "talker":
            module = TalkerDecoder(self.config.talker, self.config.thinker.vocab_size, device=device, dtype=dtype)
            load = load_talker
        elif component == "code2wav":
            module = Code2Wav(self.config.code2wav, device=device, dtype=dtype)
            load = load_code2wav
            self._state_dtype = dtype
        else:
            raise ConfigError(f"model '{self.name}' has no component '{component}'")
        if self.load_format == "dummy":
            dummy_weights(module, seed=DUMMY_SEED)
            if component == "talker":  # its copy of the thinker's table: the thinker's random values (before any lean)
                dummy_param(module.thinker_embed.weight, "embed_tokens.weight", dummy_seed(DUMMY_SEED, 0))
            if self.path is None and component == "thinker":  # a builtin, shown with the byte tokenizer
                _lean_toward_text(module.embed_tokens.weight, module.lm_head.weight)
            if component == "code2wav":
                _unit_gain(module, skip=("code_embedding", "transformer"))
                with torch.no_grad():
                    module.conv_out.weight.mul_(0.1)  # the last at a tenth: a waveform within PCM16's range
            if component == "audio":
                _unit_gain(module)
        else:
            assert self.path is not None
            load(module, self.path)
        module.eval()
        if component == "talker":
            return TalkerSteps(module, self.config)
        wrap = {"audio": AudioEncoding, "vision": VisionEncoding, "code2wav": Code2WavSteps}.get(component)
        return wrap(module) if wrap is not None else module

    def prepare_inputs(self, request: GenerateRequest, sampling: SamplingParams) -> PreparedPiece:
        if self.walk_for(request) == walks.TTS:
            return self._prepare_tts(request)
        ids, media, field = self.intake.prompt(request.inputs, self._max_model_len, self.name)
        vocab = self.config.thinker.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", field=field)
        cfg = self.config
        mels = [mel for _, mel in media.audio]
        # the intake refused a prompt past the context before this: only now are the pictures cut
        images: list[ImagePatches] = [self.patch_recipe.patches(*picture) for _, picture in media.images]
        positions, _ = mrope_positions(ids, audio_id=cfg.ids.audio, image_id=cfg.ids.image,
                                       audio_frames=[m.shape[1] for m in mels],
                                       image_grids=[p.grid_thw for p in images],
                                       spatial_merge=cfg.vision.spatial_merge_size,
                                       per_second=cfg.position_id_per_seconds, field=field)
        values = {"prompt_ids": torch.tensor(ids, dtype=torch.long), "positions": positions}
        walk = self.walk_for(request)
        if mels or walk == walks.CONVERSE:
            values["audio_mel"], values["audio_frames"] = pack_clips(mels, cfg.audio.num_mel_bins)
        if images:
            values["image_pixels"] = torch.cat([p.pixel_values for p in images])
            values["image_grids"] = torch.tensor([p.grid_thw for p in images], dtype=torch.long)
        if walk.startswith(walks.SPEECH_OUT) or walk == walks.CONVERSE:
            check_speakable(ids, cfg.ids)
            values.update(self._talker_inputs(request, ids, [p.grid_thw for p in images]))
            if walk == walks.CONVERSE:  # its talker's positions go on from its cache, turn after turn
                del values["talker_positions"]
        return PreparedPiece(values, len(ids), field)

    def prepare_more(self, request: GenerateRequest, inputs: dict[str, Any]) -> PreparedPiece:
        """A user turn of a `converse` request: `{"audio": clip}` and/or
        `{"text": str}` (or `{"content": [parts]}`), as the ids after the
        previous answer: the turn, then the assistant's header."""
        if "content" in inputs:
            content = inputs["content"]
        else:
            content = ([{"type": "audio", "audio": inputs["audio"]}] if "audio" in inputs else []) + \
                      ([{"type": "text", "text": inputs["text"]}] if "text" in inputs else [])
        if not content:
            raise RequestError("a turn brings audio, text or content parts", field="input")
        media = PromptMedia()
        newline = self.intake.text("\n", self.name)
        ids = [*newline, self.config.ids.im_start, self.config.ids.user, *newline,
               *self.intake.content(content, "input", media, self.name), self.config.ids.im_end, *newline,
               self.config.ids.im_start, self.config.ids.assistant, *newline]
        if media.images:
            raise RequestError("a turn of a running conversation takes audio and text, not images",
                               field=media.images[0][0])
        # the placeholders must match the clips here, where a refusal fails this input alone
        mrope_positions(ids, audio_id=self.config.ids.audio, image_id=self.config.ids.image,
                        audio_frames=[m.shape[1] for _, m in media.audio])
        mel, frames = pack_clips([m for _, m in media.audio], self.config.audio.num_mel_bins)
        return PreparedPiece({"prompt_ids": torch.tensor(ids, dtype=torch.long), "audio_mel": mel,
                              "audio_frames": frames}, len(ids) + 1)

    def join_turn(self, last_token: int, piece: dict[str, torch.Tensor], start: int) -> PreparedPiece:
        """The turn after an answer: its last token (never fed back yet), the
        end of the answer's turn when the answer stopped short of it, then the
        piece; thinker positions from `start`, the talker's prompt shape."""
        cfg = self.config
        head = [last_token] if last_token == cfg.ids.im_end else [last_token, cfg.ids.im_end]
        ids = head + piece["prompt_ids"].tolist()
        frames = piece["audio_frames"].tolist()
        positions, _ = mrope_positions(ids, audio_id=cfg.ids.audio, image_id=cfg.ids.image, audio_frames=frames,
                                       per_second=cfg.position_id_per_seconds)
        talker, _ = talker_positions(cfg, ids)
        values = {"prompt_ids": torch.tensor(ids, dtype=torch.long), "positions": positions + start,
                  "talker_ids": torch.full((talker.shape[1],), cfg.ids.tts_pad, dtype=torch.long),
                  "audio_mel": piece["audio_mel"], "audio_frames": piece["audio_frames"]}
        return PreparedPiece(values, len(ids))

    def _talker_inputs(self, request: GenerateRequest, ids: list[int],
                       grids: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
        """The talker's prompt shape (placeholder ids, 3-axis positions) and the voice's codec id."""
        cfg = self.config
        voice = request.inputs.get("voice", self.voices[0] if self.voices else DEFAULT_VOICE)
        if not isinstance(voice, str):
            raise RequestError("must be a voice's name", field="voice")
        positions, _ = talker_positions(cfg, ids, grids)
        return {"voice": torch.tensor(voice_id(cfg, voice)), "talker_positions": positions,
                "talker_ids": torch.full((positions.shape[1],), cfg.ids.tts_pad, dtype=torch.long)}

    def _prepare_tts(self, request: GenerateRequest) -> PreparedPiece:
        """`text` to speech: the talker's prompt is a user turn of the text,
        then the assistant's header; the text is what the talker reads."""
        text = request.inputs.get("text")
        if not isinstance(text, str) or not text.strip():
            raise RequestError("must be a non-empty string", field="input")
        if self._tokenizer is None:
            raise RequestError(f"model '{self.name}' has no tokenizer to read text with", field="model")
        script = list(self._tokenizer.encode(text, add_special_tokens=False))
        ids = self.config.ids
        newline = list(self._tokenizer.encode("\n", add_special_tokens=False))
        prompt = [ids.im_start, ids.user, *newline, *script, ids.im_end, *newline, ids.im_start, ids.assistant,
                  *newline]
        if len(prompt) > self._max_model_len:
            raise RequestError(f"the text takes more than the model's {self._max_model_len} tokens", field="input",
                               code=CONTEXT_EXCEEDED)
        values = {"prompt_ids": torch.tensor(prompt, dtype=torch.long), "script": torch.tensor(script),
                  "script_first": torch.tensor(script[0]), **self._talker_inputs(request, prompt, [])}
        return PreparedPiece(values, values["talker_ids"].numel(), "input")

    def _image_part(self, image: Any, field: str) -> tuple[tuple[Any, str], int]:
        """A decoded picture (RGB uint8 [H, W, 3]) kept as it is with its
        field, and the tokens it makes, from its size alone: it is cut into
        patches once the prompt is known to fit the context."""
        t, h, w = self.patch_recipe.grid(image, field)
        return (image, field), t * h * w // self.patch_recipe.merge_size ** 2

    def _audio_part(self, audio: Any, field: str) -> tuple[torch.Tensor, int]:
        """A decoded clip (16 kHz mono float) as log-mel, and the tokens it makes."""
        wav = torch.as_tensor(audio)
        mel, = self._mel([wav], [field])
        return mel, audio_tokens(mel.shape[1])


def _unit_gain(module: torch.nn.Module, skip: tuple[str, ...] = ()) -> None:
    """Random matrices and kernels of unit gain, seeded, for the parameters
    not under `skip`. At the dummy 0.02 everywhere code2wav's waveform rounds
    to silence in PCM16 and the audio encoder's rows come out near 1e-5, so a
    random model would neither make a sound one can hear nor tell one clip
    from another, as a real checkpoint does."""
    gen = torch.Generator().manual_seed(DUMMY_SEED)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() > 1 and not name.startswith(skip):
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen) * (0.9 / fan_in ** 0.5))


PRINTABLE = range(32, 127)  # the byte tokenizer's printable ASCII ids
TEXT_LEAN = 8.0


def _lean_toward_text(embed: torch.Tensor, head: torch.Tensor) -> None:
    """Make a builtin's random thinker write printable bytes, which its byte
    tokenizer shows as text (its vocabulary is the real model's, so random
    weights would write ids the tokenizer cannot show): every embedding gets
    `TEXT_LEAN` on hidden unit 0, so that unit dominates the residual stream,
    and the head reads unit 0 only for printable ids. The talker's copy of
    the table keeps the plain random values: unit 0 would drown its text
    rows, and with them what its voices change."""
    with torch.no_grad():
        embed[:, 0] = TEXT_LEAN
        head[:, 0] = 0.0
        head[PRINTABLE.start:PRINTABLE.stop, 0] = 1.0
