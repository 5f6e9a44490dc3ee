"""Qwen3OmniConfig: a Hugging Face `Qwen3OmniMoeForConditionalGeneration`
config.json dict in, the frozen numbers of its five parts out (thinker text
decoder, audio encoder, vision encoder, talker with its code predictor,
code2wav).

transformers reads some fields that its config classes do not declare
(`head_dim`, `vision_start_token_id`, the talker's shared expert size) and
gives others class defaults of another model (audio token ids,
`position_id_per_seconds`, `accept_hidden_layer`). A wrong default here would
load and then speak nonsense, so every field a part needs must be in the
file: a missing one is a `ConfigError` naming its path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mstar.errors import ConfigError
from mstar.models.checkpoint import read_json
from mstar.models.vision.config import VisionEncoderConfig

MODEL_TYPE = "qwen3_omni_moe"


class _Fields:
    """One sub-dict of config.json, read field by field; errors name the path."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"qwen3-omni config: {where} must be an object")
        self.data, self.where = data, where

    def need(self, name: str, kind: type = int) -> Any:
        if name not in self.data:
            raise ConfigError(f"qwen3-omni config: {self.where}.{name} is missing")
        return self._cast(name, self.data[name], kind)

    def get(self, name: str, default: Any, kind: type = int) -> Any:
        return self._cast(name, self.data[name], kind) if name in self.data else default

    def fill(self, cls: type, **given: Any) -> Any:
        """A `cls` dataclass with `given` fields, and every other one an int
        this object must hold."""
        return cls(**given, **{name: self.need(name) for name in cls.__dataclass_fields__ if name not in given})

    def sub(self, name: str) -> _Fields:
        return _Fields(self.need(name, dict), f"{self.where}.{name}")

    def rope(self) -> tuple[float, tuple[int, ...]]:
        """(theta, mrope_section) from `rope_parameters` (transformers 5) or
        `rope_theta` + `rope_scaling` (transformers 4)."""
        params = self.data.get("rope_parameters") or {}
        scaling = self.data.get("rope_scaling") or {}
        theta = params.get("rope_theta", self.data.get("rope_theta"))
        if theta is None:
            raise ConfigError(f"qwen3-omni config: {self.where}.rope_parameters.rope_theta is missing")
        section = params.get("mrope_section", scaling.get("mrope_section", ()))
        return float(theta), tuple(int(s) for s in section)

    def _cast(self, name: str, value: Any, kind: type) -> Any:
        if kind is dict:
            if not isinstance(value, Mapping):
                raise ConfigError(f"qwen3-omni config: {self.where}.{name} must be an object")
            return value
        if kind in (tuple, list):
            return tuple(int(v) for v in value)
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise ConfigError(f"qwen3-omni config: {self.where}.{name} must be {kind.__name__}, "
                              f"got {value!r}") from None


@dataclass(frozen=True)
class MoeDecoderConfig:
    """The thinker's or the talker's decoder: every layer is MoE (the talker's
    with a gated shared expert)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int
    rope_theta: float
    mrope_section: tuple[int, ...]
    rms_norm_eps: float
    max_position_embeddings: int

    @classmethod
    def read(cls, f: _Fields, shared_expert: bool) -> MoeDecoderConfig:
        theta, section = f.rope()
        cfg = cls(hidden_size=f.need("hidden_size"), num_hidden_layers=f.need("num_hidden_layers"),
                  num_attention_heads=f.need("num_attention_heads"), num_key_value_heads=f.need("num_key_value_heads"),
                  head_dim=f.need("head_dim"), vocab_size=f.need("vocab_size"),
                  num_experts=f.get("num_experts", None) or f.need("num_local_experts"),
                  num_experts_per_tok=f.need("num_experts_per_tok"),
                  moe_intermediate_size=f.need("moe_intermediate_size"),
                  norm_topk_prob=f.get("norm_topk_prob", False, bool),
                  shared_expert_intermediate_size=f.need("shared_expert_intermediate_size") if shared_expert else 0,
                  rope_theta=theta, mrope_section=section, rms_norm_eps=f.get("rms_norm_eps", 1e-6, float),
                  max_position_embeddings=f.get("max_position_embeddings", 32768))
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError(f"qwen3-omni config: {f.where}: {cfg.num_attention_heads} heads are not a multiple of "
                              f"{cfg.num_key_value_heads} KV heads")
        if section and (len(section) != 3 or sum(section) != cfg.head_dim // 2):
            raise ConfigError(f"qwen3-omni config: {f.where}: mrope_section {list(section)} must be 3 numbers "
                              f"summing to head_dim / 2 = {cfg.head_dim // 2}")
        if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
            raise ConfigError(f"qwen3-omni config: {f.where}: num_experts_per_tok {cfg.num_experts_per_tok} is "
                              f"outside 1..{cfg.num_experts}")
        return cfg


@dataclass(frozen=True)
class AudioEncoderConfig:
    num_mel_bins: int
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    n_window: int            # half a conv chunk: chunks are 2 * n_window mel frames
    n_window_infer: int      # mel frames of one attention window
    downsample_hidden_size: int
    output_dim: int
    max_source_positions: int

    @classmethod
    def read(cls, f: _Fields) -> AudioEncoderConfig:
        cfg = f.fill(cls)
        # transformers counts 13 tokens per 2 * n_window frames, which only a
        # 100-frame chunk makes; other values encode more rows than the prompt holds
        if cfg.n_window != 50:
            raise ConfigError(f"qwen3-omni config: {f.where}.n_window is {cfg.n_window}; only 50 (1 s chunks) "
                              "gives the token counts transformers prompts with")
        if cfg.n_window_infer < 2 * cfg.n_window:
            raise ConfigError(f"qwen3-omni config: {f.where}.n_window_infer {cfg.n_window_infer} is shorter than "
                              f"one chunk ({2 * cfg.n_window} frames)")
        if cfg.d_model % cfg.encoder_attention_heads:
            raise ConfigError(f"qwen3-omni config: {f.where}: d_model {cfg.d_model} is not a multiple of "
                              f"{cfg.encoder_attention_heads} heads")
        if f.get("activation_function", "gelu", str) != "gelu":
            raise ConfigError(f"qwen3-omni config: {f.where}.activation_function must be gelu")
        return cfg


@dataclass(frozen=True)
class CodePredictorConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_code_groups: int
    rope_theta: float
    rms_norm_eps: float

    @classmethod
    def read(cls, f: _Fields) -> CodePredictorConfig:
        return f.fill(cls, rope_theta=f.rope()[0], rms_norm_eps=f.get("rms_norm_eps", 1e-6, float))


@dataclass(frozen=True)
class TalkerConfig:
    decoder: MoeDecoderConfig
    code_predictor: CodePredictorConfig
    num_code_groups: int
    thinker_hidden_size: int
    accept_hidden_layer: int   # the thinker layer whose output its multimodal prompt rows read
    projection_size: int       # the text and hidden projections' inner width
    codec_pad_id: int
    codec_bos_id: int
    codec_eos_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    voices: Mapping[str, int]  # voice name (lower case) -> its codec id in the talker's prompt

    @classmethod
    def read(cls, f: _Fields) -> TalkerConfig:
        text = f.sub("text_config")
        voices = f.need("speaker_id", dict)
        cfg = cls(decoder=MoeDecoderConfig.read(text, shared_expert=True),
                  code_predictor=CodePredictorConfig.read(f.sub("code_predictor_config")),
                  num_code_groups=f.need("num_code_groups"), thinker_hidden_size=f.need("thinker_hidden_size"),
                  accept_hidden_layer=f.need("accept_hidden_layer"), projection_size=text.need("intermediate_size"),
                  codec_pad_id=f.need("codec_pad_id"), codec_bos_id=f.need("codec_bos_id"),
                  codec_eos_id=f.need("codec_eos_token_id"), codec_nothink_id=f.need("codec_nothink_id"),
                  codec_think_bos_id=f.need("codec_think_bos_id"), codec_think_eos_id=f.need("codec_think_eos_id"),
                  voices={str(k).lower(): int(v) for k, v in voices.items()})
        if cfg.code_predictor.num_code_groups != cfg.num_code_groups:
            raise ConfigError(f"qwen3-omni config: {f.where}: num_code_groups {cfg.num_code_groups} differs from the "
                              f"code predictor's {cfg.code_predictor.num_code_groups}")
        if cfg.code_predictor.hidden_size != cfg.decoder.hidden_size:
            raise ConfigError(f"qwen3-omni config: {f.where}: the code predictor reads the talker's hidden state "
                              f"({cfg.decoder.hidden_size}) without a projection, but is "
                              f"{cfg.code_predictor.hidden_size} wide")
        if not cfg.voices:
            raise ConfigError(f"qwen3-omni config: {f.where}.speaker_id names no voice")
        return cfg


@dataclass(frozen=True)
class Code2WavConfig:
    codebook_size: int
    num_quantizers: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    sliding_window: int
    decoder_dim: int
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]
    rope_theta: float
    rms_norm_eps: float

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsample_rates) * math.prod(self.upsampling_ratios)

    @classmethod
    def read(cls, f: _Fields) -> Code2WavConfig:
        return f.fill(cls, upsample_rates=f.need("upsample_rates", tuple),
                      upsampling_ratios=f.need("upsampling_ratios", tuple), rope_theta=f.rope()[0],
                      rms_norm_eps=f.get("rms_norm_eps", 1e-5, float))


@dataclass(frozen=True)
class TokenIds:
    """The special ids the prompt, the encoders' placeholders and the talker use."""

    audio: int
    audio_start: int
    image: int
    video: int
    vision_start: int
    im_start: int
    im_end: int
    system: int
    user: int
    assistant: int
    tts_pad: int
    tts_bos: int
    tts_eos: int


@dataclass(frozen=True)
class Qwen3OmniConfig:
    thinker: MoeDecoderConfig
    audio: AudioEncoderConfig
    vision: VisionEncoderConfig
    talker: TalkerConfig
    code2wav: Code2WavConfig
    ids: TokenIds
    position_id_per_seconds: int   # M-RoPE positions per second of video time

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Qwen3OmniConfig:
        top = _Fields(data, "config")
        if data.get("model_type") not in (None, MODEL_TYPE):
            raise ConfigError(f"qwen3-omni config: model_type is {data.get('model_type')!r}, not {MODEL_TYPE!r}")
        thinker = top.sub("thinker_config")
        talker = TalkerConfig.read(top.sub("talker_config"))
        cfg = cls(thinker=MoeDecoderConfig.read(thinker.sub("text_config"), shared_expert=False),
                  audio=AudioEncoderConfig.read(thinker.sub("audio_config")),
                  vision=VisionEncoderConfig.from_dict(thinker.need("vision_config", dict),
                                                       f"qwen3-omni config: {thinker.where}.vision_config",
                                                       deepstack=True),
                  talker=talker, code2wav=Code2WavConfig.read(top.sub("code2wav_config")),
                  ids=TokenIds(audio=thinker.need("audio_token_id"), audio_start=thinker.need("audio_start_token_id"),
                               image=thinker.need("image_token_id"), video=thinker.need("video_token_id"),
                               vision_start=thinker.need("vision_start_token_id"),
                               im_start=top.need("im_start_token_id"), im_end=top.need("im_end_token_id"),
                               system=top.need("system_token_id"), user=top.need("user_token_id"),
                               assistant=top.need("assistant_token_id"), tts_pad=top.need("tts_pad_token_id"),
                               tts_bos=top.need("tts_bos_token_id"), tts_eos=top.need("tts_eos_token_id")),
                  position_id_per_seconds=thinker.need("position_id_per_seconds"))
        cfg._check()
        return cfg

    @classmethod
    def from_folder(cls, folder: Path) -> Qwen3OmniConfig:
        return cls.from_dict(read_json(Path(folder) / "config.json"))

    def _check(self) -> None:
        """The widths the parts hand each other must agree."""
        width = self.thinker.hidden_size
        for name, got in (("thinker_config.audio_config.output_dim", self.audio.output_dim),
                          ("thinker_config.vision_config.out_hidden_size", self.vision.out_hidden_size),
                          ("talker_config.thinker_hidden_size", self.talker.thinker_hidden_size)):
            if got != width:
                raise ConfigError(f"qwen3-omni config: {name} is {got}, but the thinker is {width} wide")
        if not 0 < self.talker.accept_hidden_layer <= self.thinker.num_hidden_layers:
            raise ConfigError(f"qwen3-omni config: talker_config.accept_hidden_layer {self.talker.accept_hidden_layer} "
                              f"is outside 1..{self.thinker.num_hidden_layers}")
        if self.code2wav.num_quantizers != self.talker.num_code_groups:
            raise ConfigError(f"qwen3-omni config: code2wav_config.num_quantizers {self.code2wav.num_quantizers} "
                              f"differs from the talker's {self.talker.num_code_groups} code groups")
        if len(self.vision.deepstack_visual_indexes) > self.thinker.num_hidden_layers:
            raise ConfigError("qwen3-omni config: more deepstack levels than thinker layers")
