"""The media decoders (`mstar.models.media`) and the resampler: audio files
of every rate and container become the mono 16 kHz signal they hold, images
become upright RGB, and every bad input is a RequestError naming its field."""

from __future__ import annotations

import base64
import contextlib
import io
import math
import struct
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from mstar.errors import RequestError
from mstar.models import media
from mstar.models.qwen3_omni.encoders.mel import LogMel
from mstar.models.resample import resample

AUDIO = "messages[0].content[1].input_audio.data"
IMAGE = "messages[0].content[2].image_url.url"


def tone(rate: int, seconds: float, hz: float, amp: float = 1.0) -> np.ndarray:
    return amp * np.sin(2 * np.pi * hz * np.arange(round(rate * seconds)) / rate)


def encoded(x: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def png(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


@contextlib.contextmanager
def refused(field: str, *words: str) -> Iterator[None]:
    """The block raises a 400 RequestError naming `field`, its message holding `words`."""
    with pytest.raises(RequestError) as info:
        yield
    err = info.value
    assert err.field == field and err.status == 400, (err.field, err.status)
    for word in words:
        assert word in err.message, f"{word!r} not in {err.message!r}"


# ------------------------------------------------------------- resampler

RATES = (8000, 11025, 16000, 22050, 24000, 44100, 48000, 96000)


@pytest.mark.parametrize("src", RATES)
@pytest.mark.parametrize("dst", (16000, 24000))
def test_resampler_equals_scipy_resample_poly(src: int, dst: int) -> None:
    signal = pytest.importorskip("scipy.signal")
    x = np.random.default_rng(src).standard_normal(src // 3 + 7).astype(np.float32)
    g = math.gcd(src, dst)
    ours = resample(x, src, dst)
    theirs = signal.resample_poly(x.astype(np.float64), dst // g, src // g)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, atol=2e-6)


@pytest.mark.parametrize("src", RATES)
def test_resampled_sine_is_the_sine_at_the_new_rate(src: int) -> None:
    out = resample(tone(src, 0.5, 440.0, 0.5), src, 16000)
    want = tone(16000, 0.5, 440.0, 0.5)
    assert out.shape == want.shape
    inner = slice(400, -400)  # the filter's reach: 25 ms at each end sees the zeros beyond the signal
    np.testing.assert_allclose(out[inner], want[inner], atol=1e-3)


@pytest.mark.parametrize("src, hz", ((44100, 12000.0), (48000, 12000.0), (96000, 30000.0)))
def test_tones_above_the_new_nyquist_are_filtered_out(src: int, hz: float) -> None:
    # without the low-pass they would fold down into the band as loud as they came in
    out = resample(tone(src, 0.5, hz), src, 16000)
    assert np.sqrt(np.mean(out[400:-400] ** 2)) < 1e-3


def test_resampler_keeps_lengths_of_any_size() -> None:
    for n in (0, 1, 2, 5):
        assert resample(np.ones(n), 44100, 16000).shape == (math.ceil(n * 160 / 441),)
    same = np.arange(5, dtype=np.float32)
    out = resample(same, 16000, 16000)
    assert np.array_equal(out, same) and out is not same


# ------------------------------------------------------------- audio

@pytest.mark.parametrize("rate", (8000, 16000, 24000, 44100, 48000))
@pytest.mark.parametrize("channels", (1, 2))
def test_wav_is_mono_16k(rate: int, channels: int) -> None:
    s, d = tone(rate, 1.0, 440.0, 0.5), tone(rate, 1.0, 1000.0, 0.25)
    x = s if channels == 1 else np.stack([s + d, s - d], axis=1)  # the channels' mean is s
    out = media.decode_audio(encoded(x, rate, "WAV", "PCM_16"), AUDIO, max_seconds=2)
    want = tone(16000, 1.0, 440.0, 0.5)
    assert out.dtype == np.float32 and out.shape == want.shape
    np.testing.assert_allclose(out[400:-400], want[400:-400], atol=2e-3)


def test_other_rates_are_asked_for() -> None:
    out = media.decode_audio(encoded(tone(48000, 0.5, 440.0, 0.5), 48000, "WAV"), AUDIO, rate=24000, max_seconds=1)
    np.testing.assert_allclose(out[600:-600], tone(24000, 0.5, 440.0, 0.5)[600:-600], atol=2e-3)


@pytest.mark.parametrize("fmt, subtype, atol", (("FLAC", "PCM_16", 2e-3), ("WAV", "FLOAT", 2e-3),
                                                ("MP3", None, 0.1), ("OGG", "VORBIS", 0.1)))
def test_compressed_audio_decodes(fmt: str, subtype: str | None, atol: float) -> None:
    if fmt not in sf.available_formats():
        pytest.skip(f"this libsndfile does not write {fmt}")
    s = tone(44100, 1.0, 440.0, 0.5)
    out = media.decode_audio(encoded(np.stack([s, s], axis=1), 44100, fmt, subtype), AUDIO, max_seconds=2)
    want = tone(16000, 1.0, 440.0, 0.5)
    assert abs(out.size - want.size) <= 160  # lossy codecs may pad a frame's worth at the end
    n = min(out.size, want.size)
    np.testing.assert_allclose(out[400:n - 400], want[400:n - 400], atol=atol)


def test_base64_audio_decodes_like_its_bytes() -> None:
    data = encoded(tone(24000, 0.2, 300.0, 0.3), 24000, "WAV")
    wrapped = "\n".join(base64.b64encode(data).decode()[i:i + 76] for i in range(0, 4 * len(data) // 3, 76))
    out = media.audio_from_base64(wrapped, AUDIO, max_seconds=1)  # MIME-style line breaks are fine
    assert np.array_equal(out, media.decode_audio(data, AUDIO, max_seconds=1))


def test_audio_up_to_the_limit_passes_and_past_it_is_refused() -> None:
    x = tone(16000, 2.0, 440.0, 0.5)
    assert media.decode_audio(encoded(x, 16000, "WAV"), AUDIO, max_seconds=2.0).size == 32000
    with refused(AUDIO, "longer than the 1.5 s"):
        media.decode_audio(encoded(x, 16000, "WAV"), AUDIO, max_seconds=1.5)
    with refused(AUDIO, "longer"):  # a compressed file is cut off while decoding, whatever its header says
        media.decode_audio(encoded(x, 16000, "FLAC"), AUDIO, max_seconds=1.5)


@pytest.mark.parametrize("data, words", (
    (b"", ("empty",)),
    (b"this is not audio at all" * 10, ("not audio", "wav, mp3, flac, ogg")),
    (encoded(np.zeros(0), 16000, "WAV"), ("no audio samples",)),
    (encoded(np.full(100, np.nan), 16000, "WAV", "FLOAT"), ("not finite",)),
    (encoded(np.zeros(100), 500, "WAV"), ("500 Hz",)),
    (encoded(np.zeros(100), 16000, "AIFF"), ("AIFF", "wav, mp3, flac, ogg")),
    # named, not shown: a float WAV's PEAK chunk holds the time it was written, and test ids made of its bytes
    # would differ between the workers that collect them
), ids=("empty", "text", "no-samples", "nan", "500-hz", "aiff"))
def test_bad_audio_is_refused(data: bytes, words: tuple[str, ...]) -> None:
    with refused(AUDIO, *words):
        media.decode_audio(data, AUDIO, max_seconds=10)


def test_float_audio_beyond_full_scale_is_clipped_to_it() -> None:
    """A float file may hold any finite value; past ±1 it is clipped, as a
    player would, so a model's features of it stay finite (1e30's power
    overflows float32 to NaN)."""
    loud = np.concatenate([np.full(8000, 1e30), tone(16000, 0.5, 440.0, 3.0)])
    out = media.decode_audio(encoded(loud, 16000, "WAV", "FLOAT"), AUDIO, max_seconds=2)
    assert np.array_equal(out, np.clip(loud, -1, 1).astype(np.float32))
    [features] = LogMel()([torch.from_numpy(out)])
    # clipped per channel, then mixed: a channel at 5 beside a silent one is half scale, not full
    stereo = np.stack([np.full(1000, 5.0), np.zeros(1000)], axis=1)
    assert np.array_equal(media.decode_audio(encoded(stereo, 16000, "WAV", "FLOAT"), AUDIO, max_seconds=1),
                          np.full(1000, 0.5, dtype=np.float32))
    # past float32 (a DOUBLE file), and a FLOAT file's largest values summed over channels, stay finite to clip
    huge = np.stack([np.full(1000, 3e38), np.full(1000, 3e38)], axis=1)
    assert np.array_equal(media.decode_audio(encoded(huge, 16000, "WAV", "FLOAT"), AUDIO, max_seconds=1),
                          np.ones(1000, dtype=np.float32))
    buf = io.BytesIO()
    sf.write(buf, np.full(1000, -1e300), 16000, format="WAV", subtype="DOUBLE")
    assert np.array_equal(media.decode_audio(buf.getvalue(), AUDIO, max_seconds=1), -np.ones(1000, np.float32))
    [wild] = LogMel()([torch.from_numpy(loud.astype(np.float32))])
    assert not bool(torch.isfinite(wild).all())  # what clipping keeps out
    assert bool(torch.isfinite(features).all())


def test_truncated_audio() -> None:
    x = tone(16000, 1.0, 440.0)
    flac, ogg, wav = (encoded(x, 16000, fmt) for fmt in ("FLAC", "OGG", "WAV"))
    with refused(AUDIO, "could not be decoded"):  # the stream breaks off mid-frame
        media.decode_audio(flac[: len(flac) // 2], AUDIO, max_seconds=10)
    with refused(AUDIO, "malformed"):             # libsndfile's reason comes along
        media.decode_audio(ogg[: len(ogg) // 2], AUDIO, max_seconds=10)
    # a WAV's samples are what is there: its first half
    out = media.decode_audio(wav[: 44 + 16000], AUDIO, max_seconds=10)
    np.testing.assert_allclose(out[400:-400], x[400:8000 - 400], atol=2e-3)


# ------------------------------------------------------------- base64 and data URLs

def test_base64_refusals_name_the_field() -> None:
    assert media.b64("aGk", AUDIO) == b"hi"  # padding may be left off
    raw = bytes([0xfb, 0xff, 0xfe, 0x3e, 0x3f])   # both alphabets' last two characters
    assert base64.urlsafe_b64encode(raw).decode() == "-__-Pj8="
    assert media.b64("-__-Pj8=", AUDIO) == media.b64("-__-Pj8", AUDIO) == raw   # URL-safe, padded or not
    with refused(AUDIO, "not valid base64"):
        media.b64("-__+Pj8=", AUDIO)   # both alphabets at once: neither encoder writes that
    with refused(AUDIO, "not valid base64"):
        media.b64("not base64!", AUDIO)
    with refused(AUDIO, "empty"):
        media.b64("", AUDIO)
    with refused(AUDIO, "base64 string"):
        media.b64(12, AUDIO)  # type: ignore[arg-type]


def test_data_urls() -> None:
    assert media.data_url("data:image/PNG;base64,aGk=", IMAGE) == ("image/png", b"hi")
    assert media.data_url("data:;base64,aGk=", IMAGE) == ("", b"hi")
    with refused(IMAGE, "does not fetch URLs", "data:image/png;base64"):
        media.data_url("https://example.com/cat.png", IMAGE)
    with refused(IMAGE, "must be a data URL"):
        media.data_url("file:///etc/passwd", IMAGE)
    with refused(IMAGE, "must be a data URL"):
        media.data_url("cat.png", IMAGE)
    with refused(IMAGE, "base64 data URL"):
        media.data_url("data:image/png,%89PNG", IMAGE)
    with refused(IMAGE, "comma"):
        media.data_url("data:image/png;base64", IMAGE)
    with refused(IMAGE, "not valid base64"):
        media.data_url("data:image/png;base64,@@@@", IMAGE)
    with refused(IMAGE, "string URL"):
        media.data_url(None, IMAGE)  # type: ignore[arg-type]


# ------------------------------------------------------------- images

def test_png_with_alpha_is_composited_on_white() -> None:
    rgba = np.zeros((8, 8, 4), dtype=np.uint8)
    rgba[:, :4] = (10, 20, 200, 255)   # opaque blue on the left
    rgba[:, 4:6] = (0, 0, 0, 0)        # transparent black: white once composited
    rgba[:, 6:] = (0, 0, 0, 128)       # half-transparent black: mid grey
    out = media.decode_image(png(rgba), IMAGE, max_pixels=1000)
    assert out.dtype == np.uint8 and out.shape == (8, 8, 3)
    assert (out[:, :4] == (10, 20, 200)).all()
    assert (out[:, 4:6] == 255).all()
    assert (abs(out[:, 6:].astype(int) - 127) <= 1).all()


def test_palette_transparency_is_composited_too() -> None:
    im = Image.new("P", (6, 6), 0)
    im.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    im.paste(1, (0, 0, 3, 6))
    buf = io.BytesIO()
    im.save(buf, format="PNG", transparency=0)  # palette entry 0 (black) is transparent
    out = media.decode_image(buf.getvalue(), IMAGE, max_pixels=1000)
    assert (out[:, :3] == (255, 0, 0)).all() and (out[:, 3:] == 255).all()


def test_jpeg_is_turned_upright_by_its_exif_orientation() -> None:
    rgb = np.zeros((20, 40, 3), dtype=np.uint8)
    rgb[:, :20] = (255, 0, 0)   # stored: red left, blue right
    rgb[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6            # "rotate 90 degrees clockwise to display"
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG", quality=95, exif=exif.tobytes())
    out = media.decode_image(buf.getvalue(), IMAGE, max_pixels=1000)
    assert out.shape == (40, 20, 3)  # displayed: red on top, blue below
    assert out[5, 10, 0] > 200 and out[5, 10, 2] < 60
    assert out[34, 10, 2] > 200 and out[34, 10, 0] < 60


def test_sixteen_bit_grey_is_scaled_not_clipped() -> None:
    grey = np.array([[0, 257 * 100, 65535, 65535]] * 4, dtype=np.uint16)
    buf = io.BytesIO()
    Image.fromarray(grey).save(buf, format="PNG")
    out = media.decode_image(buf.getvalue(), IMAGE, max_pixels=1000)
    assert out.shape == (4, 4, 3) and (out[:, :, 0] == [0, 100, 255, 255]).all()


def test_webp_and_gif_decode() -> None:
    rgb = np.full((16, 16, 3), (30, 160, 90), dtype=np.uint8)
    for fmt in ("WEBP", "GIF"):
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
        out = media.decode_image(buf.getvalue(), IMAGE, max_pixels=1000)
        assert out.shape == (16, 16, 3) and (abs(out.astype(int) - rgb) <= 8).all(), fmt


def test_multi_frame_images_give_their_first_frame() -> None:
    red, blue = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))
    for fmt in ("GIF", "MPO"):  # MPO: the JPEG a phone writes with a second picture in it
        buf = io.BytesIO()
        red.save(buf, format=fmt, save_all=True, append_images=[blue])
        out = media.decode_image(buf.getvalue(), IMAGE, max_pixels=1000)
        assert out.shape == (8, 8, 3) and out[4, 4, 0] > 240 and out[4, 4, 2] < 20, fmt


def claiming(width: int, height: int) -> bytes:
    """A small PNG whose header claims `width` x `height` (its pixel data is
    8 x 8): decoding it would fail, so a refusal naming the size came first."""
    data = png(np.zeros((8, 8, 3), dtype=np.uint8))
    ihdr = b"IHDR" + struct.pack(">II", width, height) + data[24:29]
    return data[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + data[33:]


def test_images_past_max_pixels_are_refused_from_their_header() -> None:
    with refused(IMAGE, "5000x4000", "19999999"):
        media.decode_image(claiming(5000, 4000), IMAGE, max_pixels=20_000_000 - 1)
    with refused(IMAGE, "could not be decoded"):  # allowed that size, it is decoded, and is found short
        media.decode_image(claiming(500, 400), IMAGE, max_pixels=200_000)
    with refused(IMAGE, "more than the 1000000"):  # past Pillow's own bomb cap too
        media.decode_image(claiming(60000, 60000), IMAGE, max_pixels=1_000_000)


@pytest.mark.parametrize("shape, words", (((3, 30), ("3", "at least 4")), ((8, 1700), ("at most 200 times",))))
def test_images_too_small_or_too_thin_are_refused(shape: tuple[int, int], words: tuple[str, ...]) -> None:
    with refused(IMAGE, *words):
        media.decode_image(png(np.zeros((*shape, 3), dtype=np.uint8)), IMAGE, max_pixels=10**6)


def test_bad_images_are_refused() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="BMP")
    with refused(IMAGE, "not a PNG, JPEG, WebP or GIF"):
        media.decode_image(buf.getvalue(), IMAGE, max_pixels=1000)
    with refused(IMAGE, "not a PNG, JPEG, WebP or GIF"):
        media.decode_image(b"<svg xmlns='http://www.w3.org/2000/svg'/>", IMAGE, max_pixels=1000)
    with refused(IMAGE, "empty"):
        media.decode_image(b"", IMAGE, max_pixels=1000)
    data = png(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    with refused(IMAGE, "could not be decoded"):
        media.decode_image(data[: len(data) // 2], IMAGE, max_pixels=10_000)


def test_image_data_urls() -> None:
    rgb = np.random.default_rng(1).integers(0, 256, (12, 10, 3), dtype=np.uint8)
    url = "data:image/png;base64," + base64.b64encode(png(rgb)).decode()
    assert np.array_equal(media.image_from_data_url(url, IMAGE, max_pixels=1000), rgb)
    with refused(IMAGE, "text/plain", "not of an image"):
        media.image_from_data_url("data:text/plain;base64," + url.split(",")[1], IMAGE, max_pixels=1000)
