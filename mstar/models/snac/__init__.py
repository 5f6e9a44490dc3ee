"""SNAC, the multi-scale neural audio codec, decode side: codes per level in,
a waveform out. `load_snac_decoder` builds a `SnacDecoder` from a snac folder
(or random weights); SNAC_24KHZ is the codec of Orpheus."""

from mstar.models.snac.config import SNAC_24KHZ, SnacConfig, read_config
from mstar.models.snac.loader import dummy_weights, load_snac_decoder, load_weights
from mstar.models.snac.model import SnacDecoder
from mstar.models.snac.noise import SeededNoise, TorchNoise

__all__ = ["SNAC_24KHZ", "SeededNoise", "SnacConfig", "SnacDecoder", "TorchNoise", "dummy_weights",
           "load_snac_decoder", "load_weights", "read_config"]
