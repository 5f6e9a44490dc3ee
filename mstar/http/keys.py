"""Typed keys of what the aiohttp application and each request hold: the
engine served and the models it serves as requests resolve them, when the
app was built (the `created` time `/v1/models` shows), the open realtime
sockets, the media decoder and its limits, spoken answers' transcripts, and
the request's id."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from mstar.engine.engine import Engine
    from mstar.config import MediaLimits
    from mstar.http.media import MediaDecoder
    from mstar.http.submission import Targets
    from mstar.http.text.transcripts import Transcripts

ENGINE: web.AppKey[Engine] = web.AppKey("mstar_engine")
TARGETS: web.AppKey[Targets] = web.AppKey("mstar_targets")  # the served models a request may name, resolved
STARTED = web.AppKey("mstar_started", int)      # unix time the app was built
# realtime connections open now: shutdown closes them with "going away" once their responses ended
SOCKETS = web.AppKey("mstar_sockets", set)
# realtime sessions' closes still running after their sockets went (the loop keeps tasks only weakly): shutdown
# waits for them
CLOSING = web.AppKey("mstar_realtime_closing", set)
# generation requests past admission whose handlers run, by id: the drain waits for those whose bodies are
# still arriving (nothing of them in the engine yet)
ADMITTED_NOW = web.AppKey("mstar_admitted_now", dict)
MEDIA: web.AppKey[MediaDecoder] = web.AppKey("mstar_media")  # decodes requests' audio and images off the loop
MEDIA_LIMITS: web.AppKey[MediaLimits] = web.AppKey("mstar_media_limits")  # what the decoder may be asked to decode
# spoken answers' transcripts, by audio id, for later turns that name them
TRANSCRIPTS: web.AppKey[Transcripts] = web.AppKey("mstar_transcripts")
REQUEST_ID = web.RequestKey("mstar_request_id", str)
