"""Spoken answers' transcripts, kept for later turns: an answer's audio id in
(a chat message `{"role": "assistant", "audio": {"id": ...}}`, as OpenAI's
multi-turn audio conversations send it), the transcript that answer spoke
out, as the message's content.

A model reads an earlier spoken answer as its text (Qwen3-Omni's thinker
wrote it; its talker spoke it), so the transcript is all a later turn needs.
Each is kept `KEEP_S` seconds from its answer (its `expires_at`), the
`MAX_KEPT` newest at most, on the server that made it: behind a cluster
front a later turn may reach another replica, which does not know the id.
The event loop owns the store; parsing, off the loop, only marks the
messages that name an id (`AUDIO_ID`). Importable without torch.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from mstar.errors import RequestError
from mstar.http.text.chat_messages import AUDIO_ID, ChatMessage

KEEP_S = 3600      # OpenAI keeps an answer's audio for later turns about an hour
MAX_KEPT = 10_000  # transcripts of a few KB each: tens of MB at most


class Transcripts:
    """Audio id -> (transcript, when it expires), the newest `max_kept`."""

    def __init__(self, keep_s: float = KEEP_S, max_kept: int = MAX_KEPT) -> None:
        self.keep_s = keep_s
        self.max_kept = max_kept
        self._kept: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def expires_at(self, created: int) -> int:
        """The unix time an answer made at `created` stops being known here."""
        return int(created + self.keep_s)

    def keep(self, audio_id: str, transcript: str, created: int) -> None:
        self._kept[audio_id] = (transcript, self.expires_at(created))
        self._kept.move_to_end(audio_id)
        while len(self._kept) > self.max_kept:
            self._kept.popitem(last=False)

    def resolve(self, messages: Sequence[ChatMessage]) -> tuple[ChatMessage, ...]:
        """`messages` with each earlier spoken answer's transcript as its
        content; an id not known here (or expired) is a 400 naming it."""
        now = time.time()
        out = []
        for m in messages:
            ref = m.get(AUDIO_ID)
            if ref is None:
                out.append(m)
                continue
            audio_id, field = ref
            kept = self._kept.get(audio_id)
            if kept is None or kept[1] < now:
                self._kept.pop(audio_id, None)
                raise RequestError(f"no spoken answer '{audio_id}' is kept on this server (answers are kept "
                                   f"{self.keep_s:g} s where they were made); send its transcript as the "
                                   "message's content instead", field=field)
            out.append({"role": m["role"], "content": kept[0]})
        return tuple(out)
