"""The other process of tests/test_arena.py: attaches to a host arena by name.
Standard library only, so a spawned child starts fast (no torch import)."""

from __future__ import annotations

from multiprocessing import shared_memory
from multiprocessing.queues import Queue


def read_and_write(name: str, offset: int, n: int, queue: Queue) -> None:
    """Send back `n` bytes at `offset`, then write their complement just after them."""
    shm = shared_memory.SharedMemory(name=name)
    try:
        data = bytes(shm.buf[offset:offset + n])
        shm.buf[offset + n:offset + 2 * n] = bytes(255 - b for b in data)
        queue.put(data)
    finally:
        shm.close()
