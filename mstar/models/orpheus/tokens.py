"""Orpheus's token layout: the special ids around a prompt, the audio-code
ids, the prompt format, and audio tokens -> the three levels of SNAC codes.

Every number comes from Canopy Labs' published code (github.com/canopyai/
Orpheus-TTS, read at the subrepo copy of commit 835ac7cd in
Scikous/Vtuber-AI:TTS_Wizard/Orpheus_TTS/) or from their fine-tuning notebook
(the copy in unslothai/unsloth:tests/saving/text_to_speech_models/
test_orpheus.py, and its data-prep half, which names the ids). Where a number
is cited as `engine_class.py` or `decoder.py` it is
`orpheus_tts_pypi/orpheus_tts/<file>` of that repository.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# -- the vocabulary: Llama 3's 128,256 tokens, then Orpheus's own
# data-prep notebook: tokeniser_length = 128256 and every id below is
# "tokeniser_length + k"; the tokenizer names them <custom_token_k>
LLAMA3_VOCAB_SIZE = 128_256
BEGIN_OF_TEXT = 128_000      # Llama 3 <|begin_of_text|>: the tokenizer prepends it to the text
END_OF_TEXT = 128_009        # Llama 3 <|eot_id|>: engine_class.py end_tokens[0]
START_OF_SPEECH = 128_257    # notebook start_of_speech; engine_class.py end_tokens[3]
END_OF_SPEECH = 128_258      # notebook end_of_speech: eos_token_id of the notebook's generate(), and
                             # stop_token_ids=[128258] of realtime_streaming_example/main.py
START_OF_HUMAN = 128_259     # notebook start_of_human; engine_class.py start_token
END_OF_HUMAN = 128_260       # notebook end_of_human; engine_class.py end_tokens[1]
START_OF_AI = 128_261        # notebook start_of_ai; engine_class.py end_tokens[2]
END_OF_AI = 128_262          # notebook end_of_ai: what follows END_OF_SPEECH in training rows
PAD = 128_263                # notebook pad_token (left padding of batched prompts)

# audio codes: notebook audio_tokens_start = tokeniser_length + 10; decoder.py
# turn_token_into_id: id of <custom_token_N> minus 10 minus (index % 7) * 4096
AUDIO_TOKEN_BASE = 128_266
CODEBOOK_SIZE = 4096         # SNAC 24 kHz codebook_size; the per-position stride of the ids
FRAME_TOKENS = 7             # tokens per frame: 1 + 2 + 4 codes of SNAC's three levels
AUDIO_TOKEN_END = AUDIO_TOKEN_BASE + FRAME_TOKENS * CODEBOOK_SIZE   # 156,938 (exclusive)
ORPHEUS_VOCAB_SIZE = 156_940  # canopylabs/orpheus-3b-0.1-ft config.json vocab_size

# the SNAC level of each position of a frame: decoder.py convert_to_audio and the
# notebook's redistribute_codes put position 0 in level 0, positions 1 and 4 in
# level 1, positions 2, 3, 5, 6 in level 2, each in this order
FRAME_LEVELS = (0, 1, 2, 2, 1, 2, 2)
LEVEL_POSITIONS = ((0,), (1, 4), (2, 3, 5, 6))

# -- the prompt: engine_class.py _format_prompt ("larger" models):
#    [START_OF_HUMAN] + tokenizer(f"{voice}: {text}") + [END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]
# (the notebook stops after END_OF_HUMAN; the package also opens the AI turn and the speech,
#  as the training rows do, so the first sampled token is already audio)
PROMPT_PREFIX = (START_OF_HUMAN,)
PROMPT_SUFFIX = (END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH)

# -- the voices of the English fine-tune, in the README's order ("Prompting":
#    "tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"); tara is
#    _format_prompt's default. (engine_class.py's available_voices list lacks
#    tara and dan and has "julia": the README is the fuller list.)
VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
DEFAULT_VOICE = "tara"

# -- what ends the audio: END_OF_SPEECH (above); END_OF_AI closes the turn
#    right after it in training rows, so a model that skips END_OF_SPEECH still stops
AUDIO_END_IDS = (END_OF_SPEECH, END_OF_AI)


def voice_text(text: str, voice: str | None) -> str:
    """The text half of the prompt: `"{voice}: {text}"`, or the bare text
    without a voice (_format_prompt's `voice=None` branch)."""
    return f"{voice}: {text}" if voice else text


def prompt_ids(text_ids: Sequence[int]) -> list[int]:
    """The full prompt around the tokenized `voice_text` (with its BOS)."""
    return [*PROMPT_PREFIX, *text_ids, *PROMPT_SUFFIX]


def turn_after(last_token: int) -> list[int]:
    """What closes a spoken turn that ended on `last_token`, before the next
    human turn: the token itself (the cache has not read it), then the
    END_OF_SPEECH and END_OF_AI that training rows put after the audio, as
    far as the model did not write them."""
    if last_token == END_OF_AI:
        return [last_token]
    if last_token == END_OF_SPEECH:
        return [last_token, END_OF_AI]
    return [last_token, END_OF_SPEECH, END_OF_AI]


def tokens_to_codes(tokens: torch.Tensor) -> list[torch.Tensor]:
    """Audio token ids [B, L] (frame-aligned: position 0 is a frame's first
    token) -> SNAC codes [B, F], [B, 2F], [B, 4F] for the F = L // 7 whole
    frames; an incomplete trailing frame is dropped.

    Position k of a frame holds `AUDIO_TOKEN_BASE + k * 4096 + code`. A token
    whose code falls outside [0, 4096) (the model put a token of another
    position here) is clamped into the codebook: the frame keeps its length,
    so the audio keeps its timing, and only that frame is off. Orpheus's own
    decoder drops the whole window instead, which leaves a gap.
    """
    b, length = tokens.shape
    frames = length // FRAME_TOKENS
    offsets = AUDIO_TOKEN_BASE + CODEBOOK_SIZE * torch.arange(FRAME_TOKENS, device=tokens.device)
    codes = (tokens[:, :frames * FRAME_TOKENS].reshape(b, frames, FRAME_TOKENS).long() - offsets)
    codes = codes.clamp_(0, CODEBOOK_SIZE - 1)
    # slices, not index lists: an index list is a host tensor, which a CUDA graph cannot capture
    return [torch.cat([codes[:, :, p:p + 1] for p in pos], dim=2).reshape(b, frames * len(pos))
            for pos in LEVEL_POSITIONS]


def codes_to_tokens(codes: Sequence[torch.Tensor]) -> torch.Tensor:
    """The inverse of `tokens_to_codes` (the notebook's tokenise_audio layout):
    codes [B, F], [B, 2F], [B, 4F] -> token ids [B, 7F]."""
    b, frames = codes[0].shape
    out = torch.empty(b, frames, FRAME_TOKENS, dtype=torch.long, device=codes[0].device)
    for level, pos in enumerate(LEVEL_POSITIONS):
        out[:, :, list(pos)] = codes[level].reshape(b, frames, len(pos)).long()
    out += AUDIO_TOKEN_BASE + CODEBOOK_SIZE * torch.arange(FRAME_TOKENS, device=out.device)
    return out.reshape(b, frames * FRAME_TOKENS)
