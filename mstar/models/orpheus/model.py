"""OrpheusModel: text and a voice in, 24 kHz speech out.

Orpheus (Canopy Labs) is a Llama-3.2-3B body whose vocabulary carries SNAC
audio codes, plus the SNAC 24 kHz decoder. Components: `llm` (the Llama
decoder, paged KV cache, sampled) and `codec` (`OrpheusCodec` over SNAC).

Walk `speak` (the default): prefill the prompt, decode token by token until
an audio-end id, EOS, max_tokens or a host stop; the audio tokens (only ids
in the audio range enter the stream) flow to the codec in windows of 28
tokens every 7 (`PlayedWindows`), and each window's new samples reach the
client as PCM16 at 24 kHz. Text may keep arriving while it speaks
(`Engine.append`): each piece is the next human turn on the same KV cache,
spoken when the current one is done (`join_turn`). Walk `generate` is the
LLM alone, emitting token ids (benchmarks of the decode step, token-level
tests).

Where the weights come from:
- `orpheus-tiny`: builtin, CPU-sized (hidden 64, 2 layers) with the full
  Orpheus vocabulary so every special and audio id is real, seeded random
  weights and a random SNAC 24 kHz. Its weights lean toward the audio ids
  (`lean_toward_audio`), so the demo speaks (noise) instead of writing text.
  Text is tokenized with the builtin byte tokenizer: its ids (< 261) are
  inside the big vocabulary, which is all random weights need.
- `orpheus-3b` with `--load-format dummy`: the real shapes (ORPHEUS_3B and
  SNAC 24 kHz), random weights, the byte tokenizer.
- `--model /path/orpheus`: a local folder holding the Hugging Face Llama
  checkpoint and tokenizer (config.json, safetensors, tokenizer.json; e.g.
  canopylabs/orpheus-3b-0.1-ft) and a `snac/` subfolder with the codec
  (hubertsiuzdak/snac_24khz: config.json and its weights). The `snac/`
  subfolder is what tells an Orpheus folder from a plain Llama one.
"""

from __future__ import annotations

from typing import Any

import torch

from mstar.errors import ConfigError, RequestError
from mstar.graph import Component, Emit, EosToken, HostStop, Loop, MaxTokens, Step, Stream, TokenIn, Walk
from mstar.models.base import RowShape
from mstar.models.llama import LlamaModel
from mstar.models.llama.config import LlamaConfig
from mstar.models.llama.model import LlamaDecoder
from mstar.models.orpheus.codec import WINDOW_FRAMES, WINDOW_TOKENS, OrpheusCodec
from mstar.models.orpheus.tokens import (AUDIO_END_IDS, AUDIO_TOKEN_BASE, AUDIO_TOKEN_END, DEFAULT_VOICE,
                                         END_OF_TEXT, FRAME_TOKENS, LLAMA3_VOCAB_SIZE, ORPHEUS_VOCAB_SIZE,
                                         START_OF_SPEECH, VOICES, prompt_ids, turn_after, voice_text)
from mstar.models.orpheus.windows import PlayedWindows
from mstar.models.prepared import PreparedPiece
from mstar.models.prompt import PROMPT_INPUTS
from mstar.models.snac import SnacDecoder, load_snac_decoder
from mstar.types import GenerateRequest, SamplingParams

SAMPLE_RATE = 24_000
SNAC_SUBFOLDER = "snac"

# Orpheus's sampling: the defaults of generate_tokens_sync in
# orpheus_tts_pypi/orpheus_tts/engine_class.py (canopyai/Orpheus-TTS). Its
# default stop_token_ids=[49158] is not an Orpheus-3B id; the walk stops on
# AUDIO_END_IDS instead. (The fine-tuning notebook samples with top_p 0.95 and
# repetition_penalty 1.1; the README: "repetition_penalty>=1.1 is required for
# stable generations".)
DEFAULT_TEMPERATURE = 0.6
DEFAULT_TOP_P = 0.8
DEFAULT_REPETITION_PENALTY = 1.3
DEFAULT_MAX_TOKENS = 1200

# orpheus-tiny: a CPU-sized body with the full vocabulary
ORPHEUS_TINY = LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=ORPHEUS_VOCAB_SIZE, max_position_embeddings=2048,
    # untied: the head must read the hidden state differently from the embedding (lean_toward_audio)
    tie_word_embeddings=False, bos_token_id=128_000, eos_token_ids=(END_OF_TEXT,))
TINY_AUDIO_LEAN = 1.0
# orpheus-3b --load-format dummy: 28 random layers of width 3072 add ~8 per unit to the residual stream
DUMMY_3B_AUDIO_LEAN = 30.0


def speak_walk(first_frames: int = 0) -> Walk:
    """Text to speech: the LLM's audio tokens streamed into SNAC windows;
    `first_frames` (see `PlayedWindows.first`): the first audio after that
    many frames, not a full window's 4."""
    return Walk(
        Step("llm", "prefill", "prompt_ids", "token"),
        Loop(Step("llm", "decode", "token", "token"),
             until=TokenIn(AUDIO_END_IDS) | EosToken() | MaxTokens() | HostStop()),
        Stream("token", into=Step("codec", "window", "token", "pcm"),
               chunks=PlayedWindows(size=WINDOW_TOKENS, stride=FRAME_TOKENS, first=first_frames),
               accept=(AUDIO_TOKEN_BASE, AUDIO_TOKEN_END)),
        Emit("pcm", modality="audio", sample_rate=SAMPLE_RATE),
        inputs=("prompt_ids",),
        more_input="prompt_ids",  # text streamed in while it speaks: one more turn per piece
    )


class OrpheusModel(LlamaModel):
    components = {
        "llm": Component(modes=("prefill", "decode"), kv_cache=True, samples=True),
        "codec": Component(modes=("window",)),
    }
    walks = {
        "speak": speak_walk(),
        # the first frame heard 2 frames into the stream, without its right context (opt-in: `early_audio`)
        "speak_early": speak_walk(first_frames=2),
        "generate": LlamaModel.walks["generate"],
    }
    default_walk = "speak"
    tts_walk = "speak"
    takes_generation_config = False  # its speech sampling is the released engine's (`default_sampling`)
    early_tts_walk = "speak_early"
    # /v1/completions and /v1/chat/completions: the Llama's ids as text, what a plain Llama server of the
    # checkpoint answers
    written_walk = "generate"

    def __init__(self, name: str, path: str | None, load_format: str = "auto", max_model_len: int | None = None,
                 *, builtin: LlamaConfig | None = None, default_max_model_len: int | None = None,
                 audio_lean: float = 0.0, voices: tuple[str, ...] = VOICES) -> None:
        """`audio_lean`: see `lean_toward_audio` (0: plain dummy weights);
        `voices`: the speaker names the checkpoint was tuned on."""
        super().__init__(name, path, load_format, max_model_len, builtin=builtin,
                         default_max_model_len=default_max_model_len)
        if self.config.vocab_size < AUDIO_TOKEN_END:
            raise ConfigError(f"model '{name}': vocab {self.config.vocab_size} does not hold Orpheus's audio ids "
                              f"(up to {AUDIO_TOKEN_END - 1})")
        self.audio_lean = audio_lean
        self.voices = tuple(voices)
        self.default_voice = DEFAULT_VOICE if DEFAULT_VOICE in self.voices else self.voices[0]
        self.snac_path = self.path / SNAC_SUBFOLDER if self.path is not None else None
        if self.snac_path is not None and self.load_format != "dummy" and not self.snac_path.is_dir():
            raise ConfigError(f"{self.path}: an Orpheus folder needs the SNAC 24 kHz codec in '{SNAC_SUBFOLDER}/'")

    # -- what the runtime reads
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        # the config's and generation config's ids only: the builtin byte
        # tokenizer's EOS ids are ordinary text ids in Orpheus's vocabulary
        return tuple(dict.fromkeys((*self._generation_eos, *self.config.eos_token_ids)))

    @property
    def min_turn_tokens(self) -> int:
        return 2 * FRAME_TOKENS  # a stream's last window plays from two frames on (one of audio)

    def default_sampling(self, key: str | None = None) -> SamplingParams:
        """Orpheus's own sampling for speech (engine_class.py defaults):
        temperature 0.6, top_p 0.8, repetition_penalty 1.3, max_tokens 1200
        (about 14 s of audio: 7 tokens per 2048 samples)."""
        return SamplingParams(max_tokens=DEFAULT_MAX_TOKENS, temperature=DEFAULT_TEMPERATURE, top_p=DEFAULT_TOP_P,
                              repetition_penalty=DEFAULT_REPETITION_PENALTY)

    def audio_logits(self, component: str) -> tuple[int, int] | None:
        # Orpheus's own ids: its specials (the speech's end among them) and the audio codes, past Llama's text
        return (LLAMA3_VOCAB_SIZE, self.config.vocab_size) if component == "llm" else None

    def split_placement(self, num_devices: int) -> dict[str, list[int]] | None:
        # the LLM is the heavy part; the codec gets the last device to itself
        return {"llm": list(range(num_devices - 1)), "codec": [num_devices - 1]}

    # -- what the runtime calls
    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        if component == "codec":
            snac = self._snac(device)
            return OrpheusCodec(snac, snac.config.samples_per_coarse_frame).eval()
        decoder = super().build_component(component, device, dtype)
        if self.audio_lean:
            lean_toward_audio(decoder, self.audio_lean)
        return decoder

    def graph_shapes(self, component: str, mode: str) -> tuple[tuple[RowShape, ...], ...]:
        # a full window is the codec's every step but a stream's last, which holds 2 or 3 frames (fewer
        # decode nothing): those are graphs too, or the streams ending in a step wait for an eager call
        if (component, mode) != ("codec", "window"):
            return ()
        return tuple((RowShape((frames * FRAME_TOKENS,), torch.long),) for frames in range(WINDOW_FRAMES, 1, -1))

    def _snac(self, device: torch.device) -> SnacDecoder:
        folder = self.snac_path if self.snac_path is not None and self.snac_path.is_dir() else None
        snac = load_snac_decoder(folder, load_format=self.load_format if folder else "dummy", device=device,
                                 dtype=codec_dtype(device))
        cfg = snac.config
        # the 7-token frame is one level-0 code, two level-1 codes, four level-2 codes
        if cfg.level_lengths(1) != (1, 2, 4) or cfg.sampling_rate != SAMPLE_RATE:
            raise ConfigError(f"{folder}: Orpheus speaks through SNAC 24 kHz (3 levels, strides 4, 2, 1); "
                              f"this codec has {cfg.sampling_rate} Hz, vq_strides {list(cfg.vq_strides)}")
        return snac

    def prepare_inputs(self, request: GenerateRequest, sampling: SamplingParams) -> PreparedPiece:
        """Inputs `{"text": str, "voice": str | None}` -> `{"prompt_ids"}` in
        Orpheus's prompt format; `voice` None or absent is the default voice
        (tara). A prompt of a Llama (`prompt_ids`, `prompt`, `messages`) is
        prepared as any Llama's."""
        inputs = request.inputs
        if "text" not in inputs and any(name in inputs for name in PROMPT_INPUTS):
            return super().prepare_inputs(request, sampling)
        text = inputs.get("text")
        if not isinstance(text, str) or not text.strip():
            raise RequestError("the text to speak is empty", field="input")
        voice = self._voice(inputs.get("voice"))
        if self.tokenizer is None:
            raise RequestError(f"model '{self.name}' has no tokenizer: send prompt_ids", field="input")
        ids = prompt_ids(self.tokenizer.encode(voice_text(text, voice)))
        # the Llama's check of the ids against the vocabulary; a prompt that does not fit names the text
        return self.prompt_piece({"prompt_ids": ids}, field="input")

    def prepare_more(self, request: GenerateRequest, inputs: dict[str, Any]) -> PreparedPiece:
        """More text for a running `speak` request: the next human turn, in
        the request's voice (`inputs["voice"]` to change it)."""
        text = inputs.get("text")
        if not isinstance(text, str) or not text.strip():
            raise RequestError("the text to speak is empty", field="input")
        voice = self._voice(inputs.get("voice", request.inputs.get("voice")))
        if self.tokenizer is None:
            raise RequestError(f"model '{self.name}' has no tokenizer", field="input")
        ids = prompt_ids(self.tokenizer.encode(voice_text(text, voice)))
        return PreparedPiece({"prompt_ids": torch.tensor(ids, dtype=torch.long)}, len(ids))

    def join_turn(self, last_token: int, piece: dict[str, torch.Tensor], start: int) -> PreparedPiece:
        ids = [*turn_after(last_token), *piece["prompt_ids"].tolist()]
        return PreparedPiece({"prompt_ids": torch.tensor(ids, dtype=torch.long)}, len(ids))

    def _voice(self, voice: Any) -> str:
        if voice is None:
            return self.default_voice
        name = voice.strip().lower() if isinstance(voice, str) else None
        if name not in self.voices:
            raise RequestError(f"unknown voice {voice!r}; this model has {', '.join(self.voices)}", field="voice")
        return name


def codec_dtype(device: torch.device) -> torch.dtype:
    """SNAC's dtype on `device`, whatever the LLM runs in. On CUDA, float16:
    SNAC decodes a window 4 frames wide to play one, so at hundreds of
    streams it is a large share of the GPU's work, and float16 runs it on
    tensor cores. Against float32 (the snac package's dtype) a window differs
    by ~0.1 % RMS (max ~1e-3 on samples in [-1, 1]); bfloat16, with 3 fewer
    mantissa bits, by ~0.8 %, so float16 is the one used
    (tests/test_snac_gpu.py holds the bound). On the CPU, float32: CPU float16
    convolutions are slow."""
    return torch.float16 if device.type == "cuda" else torch.float32


def lean_toward_audio(decoder: LlamaDecoder, strength: float) -> None:
    """Make random weights write audio ids, so that dummy weights speak and a
    benchmark's requests carry as much audio as a real checkpoint's (a
    property of the dummy weights, not of Orpheus).

    Untied head (orpheus-tiny): every embedding gets `strength` on hidden
    unit 0, so unit 0 dominates the hidden state after the final norm, and
    the head reads unit 0 with weight 1 for audio ids and 0 for every other
    id. Tied head (orpheus-3b's shape): only the audio ids' and
    START_OF_SPEECH's embeddings (the prompt's last token) get `strength` on
    unit 0 and every other id gets 0 there; the state after START_OF_SPEECH
    or an audio id is then dominated by unit 0, and the shared matrix scores
    audio ids highest. In both cases an audio id outscores the rest by many
    logits once `strength` outweighs what the random layers add to the
    residual stream (about 1 per unit per layer with std 0.02 weights)."""
    with torch.no_grad():
        embed = decoder.embed_tokens.weight
        if decoder.tie_word_embeddings:
            embed[:, 0] = 0.0
            embed[AUDIO_TOKEN_BASE:AUDIO_TOKEN_END, 0] = strength
            embed[START_OF_SPEECH, 0] = strength
            return
        embed[:, 0] = strength
        head = decoder.lm_head.weight
        head[:, 0] = 0.0
        head[AUDIO_TOKEN_BASE:AUDIO_TOKEN_END, 0] = 1.0
