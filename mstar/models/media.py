"""A request's media in, arrays a model's encoders read out: base64 text and
data URLs become bytes, audio bytes become mono float32 at the encoder's
rate, image bytes become RGB uint8 [H, W, 3].

Pure functions, no event loop: `mstar.http.media` runs them in helper
processes. Every bad input is a `RequestError` naming the request's field
(`messages[0].content[1].input_audio.data`); anything else raised is a
fault of the server. Limits are checked as early as the bytes allow: an
image's size from its header before a pixel is decoded (a small file can
claim a huge canvas), audio's length while decoding, a block at a time, so a
file whose header lies is cut off at the limit.
"""

from __future__ import annotations

import base64
import io
import struct

import numpy as np
import soundfile as sf
from PIL import Image, ImageOps

from mstar.errors import RequestError
from mstar.models.resample import resample

# The `input_audio.format` names a request may declare, and libsndfile's
# containers they cover; the container is read from the bytes, not the name.
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")
_CONTAINERS = frozenset({"WAV", "WAVEX", "RF64", "MP3", "FLAC", "OGG"})
MIN_AUDIO_RATE = 1_000
MAX_AUDIO_RATE = 384_000          # the highest rate audio interfaces record; also bounds the resampler's filter
_NOT_RECOGNISED = 1               # libsndfile's SF_ERR_UNRECOGNISED_FORMAT; its other codes say more
_BLOCK_SAMPLES = 1 << 20          # samples (frames x channels) read at a time: bounds memory for any channel count

# Pillow's names (JPEG covers a phone's MPO); an animated GIF or WebP, or an MPO, gives its first frame
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MIN_IMAGE_SIDE = 4                # narrower than this holds nothing a vision encoder can read
MAX_IMAGE_ASPECT = 200            # longer sides beyond 200x the shorter are refused by Qwen's image processors too
_WHITE = (255, 255, 255, 255)
_GREY16 = frozenset({"I", "I;16", "I;16B", "I;16L", "I;16N"})
# what Pillow raises on a corrupt or truncated file while decoding it
_IMAGE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error)
_URL_SAFE = str.maketrans("-_", "+/")


def b64(data: str, field: str) -> bytes:
    """Base64 text as bytes. Line breaks and other whitespace in the text
    (MIME-style wrapping), missing `=` padding and the URL-safe alphabet
    (`-` and `_` for `+` and `/`, as JavaScript's and Python's URL-safe
    encoders write it) are tolerated; any other character is refused, and
    so is text that mixes the two alphabets."""
    if not isinstance(data, str):
        raise RequestError(f"must be a base64 string, not {type(data).__name__}", field=field)
    if not data:
        raise RequestError("is empty", field=field)
    try:
        return base64.b64decode(data, validate=True)
    except ValueError:  # binascii.Error included; the slower lenient read only for text that needs it
        pass
    compact = "".join(data.split())
    compact += "=" * (-len(compact) % 4)
    if ("-" in compact or "_" in compact) and not ("+" in compact or "/" in compact):
        compact = compact.translate(_URL_SAFE)
    try:
        out = base64.b64decode(compact, validate=True)
    except ValueError:
        raise RequestError("is not valid base64", field=field) from None
    if not out:
        raise RequestError("is empty", field=field)
    return out


def data_url(url: str, field: str) -> tuple[str, bytes]:
    """A `data:<media type>;base64,<data>` URL as (media type, lowercased and
    possibly empty; bytes). Remote URLs are refused: this server does not
    fetch them (a request would make it reach wherever the client points)."""
    if not isinstance(url, str):
        raise RequestError(f"must be a string URL, not {type(url).__name__}", field=field)
    scheme, colon, rest = url.partition(":")
    scheme = scheme.strip().lower()
    if colon and scheme in ("http", "https"):
        raise RequestError("is an http(s) URL, and this server does not fetch URLs; send the image inline as a "
                           "data URL (data:image/png;base64,...)", field=field)
    if not colon or scheme != "data":
        raise RequestError("must be a data URL (data:image/png;base64,...)", field=field)
    header, comma, payload = rest.partition(",")
    if not comma:
        raise RequestError("is a data URL without the comma before its data", field=field)
    params = [p.strip().lower() for p in header.split(";")]
    if "base64" not in params[1:]:
        raise RequestError("must be a base64 data URL (data:<media type>;base64,...)", field=field)
    return params[0], b64(payload, field)


# ------------------------------------------------------------------ audio

def decode_audio(data: bytes, field: str, *, rate: int = 16000, max_seconds: float) -> np.ndarray:
    """WAV, MP3, FLAC or Ogg bytes as mono float32 at `rate` Hz: channels
    averaged, then resampled (`mstar.models.resample`). Refused: bytes that
    are no audio of those formats, no samples, more than `max_seconds`, rates
    outside [MIN_AUDIO_RATE, MAX_AUDIO_RATE], samples that are not finite.
    A float file's samples beyond full scale (±1) are clipped to it, each
    channel before they are mixed, as a player would: a model's features of
    1e30 overflow to NaN."""
    if not data:
        raise RequestError("is empty", field=field)
    try:
        f = sf.SoundFile(io.BytesIO(data))
    except sf.LibsndfileError as e:
        reason = "" if e.code == _NOT_RECOGNISED else f" ({e.error_string.rstrip('.')})"
        raise RequestError(f"is not audio this server reads ({', '.join(AUDIO_FORMATS)}){reason}",
                           field=field) from None
    except sf.SoundFileError:
        raise RequestError(f"is not audio this server reads ({', '.join(AUDIO_FORMATS)})", field=field) from None
    with f:
        if f.format not in _CONTAINERS:
            raise RequestError(f"is {f.format_info} audio; this server reads {', '.join(AUDIO_FORMATS)}",
                               field=field)
        src = f.samplerate
        if not MIN_AUDIO_RATE <= src <= MAX_AUDIO_RATE:
            raise RequestError(f"has a sample rate of {src} Hz, outside [{MIN_AUDIO_RATE}, {MAX_AUDIO_RATE}]",
                               field=field)
        mono = _read_mono(f, int(max_seconds * src), field, max_seconds)
    if mono.size == 0:
        raise RequestError("holds no audio samples", field=field)
    return resample(mono, src, rate)


def _read_mono(f: sf.SoundFile, limit: int, field: str, max_seconds: float) -> np.ndarray:
    """Up to `limit` frames of `f`, each channel clipped to ±1, then averaged;
    a frame past the limit, or a sample that is not finite, is refused."""
    block = max(1, _BLOCK_SAMPLES // f.channels)
    parts = []
    total = 0
    while True:
        try:
            # float64: a DOUBLE file's 1e300 or a FLOAT file's 3e38 summed over channels stays finite to clip
            frames = f.read(min(block, limit + 1 - total), dtype="float64", always_2d=True)
        except sf.SoundFileError as e:
            raise RequestError(f"could not be decoded: {e}", field=field) from None
        if len(frames) == 0:
            break
        total += len(frames)
        if total > limit:
            raise RequestError(f"is longer than the {max_seconds:g} s this server takes", field=field)
        if not np.isfinite(frames).all():
            raise RequestError("holds samples that are not finite numbers", field=field)
        np.clip(frames, -1.0, 1.0, out=frames)  # each channel, as a player would, before they are mixed
        parts.append((frames[:, 0] if f.channels == 1 else frames.mean(axis=1)).astype(np.float32))
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def audio_from_base64(data: str, field: str, *, rate: int = 16000, max_seconds: float) -> np.ndarray:
    """An `input_audio.data` string as `decode_audio` gives it."""
    return decode_audio(b64(data, field), field, rate=rate, max_seconds=max_seconds)


# ------------------------------------------------------------------ images

def decode_image(data: bytes, field: str, *, max_pixels: int, min_side: int = MIN_IMAGE_SIDE) -> np.ndarray:
    """PNG, JPEG, WebP or GIF bytes as RGB uint8 [H, W, 3], upright by the
    EXIF orientation.

    Transparency is composited on white, not dropped: the colour under a
    transparent pixel is arbitrary (often black, so black text on a
    transparent background would vanish), and white is what transformers'
    `convert_to_rgb` composites on in the image processors the models were
    trained with. Refused before decoding: more than `max_pixels` pixels, a
    side under `min_side`, or one side over MAX_IMAGE_ASPECT times the other.
    """
    if not data:
        raise RequestError("is empty", field=field)
    try:
        im = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:  # Pillow's own cap, far above any sane max_pixels
        raise RequestError(f"is an image of more than the {max_pixels} pixels this server takes", field=field) \
            from None
    except _IMAGE_ERRORS:  # UnidentifiedImageError is an OSError
        raise RequestError("is not a PNG, JPEG, WebP or GIF image", field=field) from None
    with im:
        w, h = im.size
        if w * h > max_pixels:
            raise RequestError(f"is an image of {w}x{h} pixels, more than the {max_pixels} this server takes",
                               field=field)
        if min(w, h) < min_side:
            raise RequestError(f"is an image of {w}x{h} pixels; each side must be at least {min_side}", field=field)
        if max(w, h) > MAX_IMAGE_ASPECT * min(w, h):
            raise RequestError(f"is an image of {w}x{h} pixels; one side may be at most {MAX_IMAGE_ASPECT} times "
                               "the other", field=field)
        try:
            im.load()
            ImageOps.exif_transpose(im, in_place=True)
            return _rgb(im)
        except _IMAGE_ERRORS as e:
            raise RequestError(f"could not be decoded: {e}", field=field) from None


def _rgb(im: Image.Image) -> np.ndarray:
    if im.mode in _GREY16:  # 16-bit grey: Pillow's own conversion clips at 255 instead of scaling
        grey = (np.asarray(im, dtype=np.float32) * (255 / 65535) + 0.5).clip(0, 255).astype(np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2)
    if "A" in im.getbands() or "transparency" in im.info:
        rgba = im.convert("RGBA")
        im = Image.alpha_composite(Image.new("RGBA", rgba.size, _WHITE), rgba)
    if im.mode != "RGB":
        im = im.convert("RGB")
    return np.array(im)


def image_from_data_url(url: str, field: str, *, max_pixels: int, min_side: int = MIN_IMAGE_SIDE) -> np.ndarray:
    """An `image_url.url` data URL as `decode_image` gives it; a media type
    other than image/* is refused (an empty one is read from the bytes)."""
    media_type, data = data_url(url, field)
    if media_type and not media_type.startswith("image/"):
        raise RequestError(f"is a data URL of {media_type}, not of an image", field=field)
    return decode_image(data, field, max_pixels=max_pixels, min_side=min_side)
