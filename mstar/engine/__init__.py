"""The runtime behind `mstar.engine.engine.Engine`; at package level only
what is needed before torch loads: the built-in model names a command line
lists, and the media decoders the HTTP layer runs in its helper processes
(which never load torch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def builtin_models() -> tuple[str, ...]:
    """The names `--model` serves without a folder."""
    from mstar.models.registry import BUILTINS

    return tuple(sorted(BUILTINS))


def media_decoders() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The functions that turn a request's media into what the models'
    encoders read, for the HTTP layer to run off its event loop: base64
    audio -> mono float32, an image data URL -> RGB uint8 (`mstar.models.media`)."""
    from mstar.models import media

    return media.audio_from_base64, media.image_from_data_url


def audio_resampler() -> Callable[[Any, int, int], Any]:
    """`resample(x, src, dst)`: mono float32 audio from one rate to another
    (`mstar.models.resample`, numpy only), for audio the HTTP layer gets as
    raw PCM (a realtime session's input buffer)."""
    from mstar.models.resample import resample

    return resample
