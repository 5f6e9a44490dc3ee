"""Fresh request ids (`mstar/http/ids.py`): `uuid.uuid4().hex`'s form, never
repeated, drawn from the OS's random bytes a batch at a time, and a forked
child's its own."""

from __future__ import annotations

import os
import uuid

import pytest

from mstar.http import ids
from mstar.http.ids import uuid4_hex


def test_an_id_is_a_uuid4_in_hex() -> None:
    for _ in range(3 * ids.BATCH):  # across refills
        made = uuid4_hex()
        parsed = uuid.UUID(hex=made)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
        assert parsed.hex == made and len(made) == 32 and made == made.lower()


def test_ids_do_not_repeat_and_their_random_bits_vary() -> None:
    made = [uuid4_hex() for _ in range(4 * ids.BATCH)]
    assert len(set(made)) == len(made)
    # every hex digit but the version's varies over a thousand ids (the variant's takes 8-b only)
    for i in range(32):
        digits = {m[i] for m in made}
        if i == 12:
            assert digits == {"4"}
        elif i == 16:
            assert digits == set("89ab")
        else:
            assert len(digits) > 8


def test_a_refill_reads_the_os_once_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    real = os.urandom

    def counted(n: int) -> bytes:
        reads.append(n)
        return real(n)

    monkeypatch.setattr(ids.os, "urandom", counted)
    monkeypatch.setattr(ids, "_pool", [])
    [uuid4_hex() for _ in range(ids.BATCH + 1)]
    assert reads == [16 * ids.BATCH] * 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_does_not_hand_out_its_parents_ids() -> None:
    uuid4_hex()  # the pool holds ids now
    left = list(ids._pool)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next id, then leave at once
        os.close(read)
        os.write(write, uuid4_hex().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert len(child) == 32 and child not in left
