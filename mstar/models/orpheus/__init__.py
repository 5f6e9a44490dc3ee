"""Orpheus TTS: a Llama body that writes SNAC audio codes, and the SNAC 24 kHz
decoder that turns them into speech. See `model.py` for the walks and the
checkpoint layouts, `tokens.py` for the token layout and its sources."""

from mstar.models.orpheus.codec import OrpheusCodec
from mstar.models.orpheus.model import ORPHEUS_TINY, SAMPLE_RATE, OrpheusModel, lean_toward_audio
from mstar.models.orpheus.tokens import DEFAULT_VOICE, VOICES, tokens_to_codes
from mstar.models.orpheus.windows import PlayedWindows

__all__ = ["DEFAULT_VOICE", "ORPHEUS_TINY", "OrpheusCodec", "OrpheusModel", "PlayedWindows", "SAMPLE_RATE",
           "VOICES", "lean_toward_audio", "tokens_to_codes"]
