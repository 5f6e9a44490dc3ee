"""Fresh random ids for requests: `uuid.uuid4().hex`, drawn from the OS's
random bytes a few hundred ids at a time instead of 16 bytes per id.

`uuid.uuid4()` reads `os.urandom(16)` for each id, and CPython lets the GIL
go around that read: a request's intake on the event loop made two (its log
id, its engine request's id), and at each a thread waiting for the GIL
could take it (on the CPU box, one call in 15-30 beside a thread busy in
Python), the loop then waiting to get it back for up to a switch interval
(5 ms by default). An id also costs ~0.8 us here, not ~2.2. The ids are the
same: 122 random bits from `os.urandom` in uuid4's layout (version 4, the
RFC 4122 variant), 32 lowercase hex digits.
"""

from __future__ import annotations

import os

BATCH = 256  # ids a read of the OS's random bytes makes
# uuid4's fixed bits, as `uuid.UUID(version=4)` sets them: the variant (bits 62-63: 0b10), the version (76-79: 4)
_CLEAR = ~((0xc000 << 48) | (0xf000 << 64))
_SET = (0x8000 << 48) | (4 << 76)

_pool: list[str] = []
_forks_watched: list[bool] = []


def uuid4_hex() -> str:
    """What `uuid.uuid4().hex` returns (any thread may call it)."""
    try:
        return _pool.pop()
    except IndexError:  # list.pop and list.extend are atomic under the GIL: a race only refills twice
        if not _forks_watched:  # at the first draw, not at import: a forked child must not hand out its parent's
            _forks_watched.append(True)
            os.register_at_fork(after_in_child=_pool.clear)
        _pool.extend(_hexes(os.urandom(16 * BATCH)))
        return _pool.pop()


def _hexes(raw: bytes) -> list[str]:
    return [f"{int.from_bytes(raw[i:i + 16], 'big') & _CLEAR | _SET:032x}" for i in range(0, len(raw), 16)]
