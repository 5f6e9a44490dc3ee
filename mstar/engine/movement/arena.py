"""The host arena: one region of host memory, allocated at startup, that
host-side payloads are carved from (step outputs staged from the GPU, audio on
its way to clients), so nothing allocates page-locked memory per chunk.

Blocks flow: a worker thread `alloc`s a block, a device-to-host copy lands in
its `tensor`, the rows travel to the event loop, and the event loop `release`s
the block once the rows have been read; the block goes back to its size
class's free list and the next `alloc` of that class gets it again.

The region is POSIX shared memory (a helper process can map it by name, see
`attach`) seen as one uint8 tensor; on a machine with CUDA it is registered
with the driver once (page-locked), so copies into it are truly asynchronous.

Thread-safe: `alloc` and `release` take one lock (a few list operations).
"""

from __future__ import annotations

import sys
import threading
import warnings
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Self

import numpy as np
import torch

MIN_BLOCK = 4096           # the smallest size class; every class is a multiple, so blocks stay page aligned
MAX_BLOCK = 16 << 20       # the largest class: bigger payloads are rare and go to the normal allocator
ALIGNMENT = 256            # what a block's start guarantees (any dtype, vector loads, DMA)

_lingering: list[shared_memory.SharedMemory] = []  # force-closed regions whose views still live (see close)


@dataclass(eq=False)
class ArenaBlock:
    """One block of the arena: `tensor` is the caller's view (its shape and
    dtype), `offset` where the block starts in the region, `size` its size
    class in bytes (>= tensor.nbytes). `release()` hands it back; the view
    must not be used afterwards (the next alloc of the class reuses it)."""

    tensor: torch.Tensor
    offset: int
    size: int
    _arena: HostArena = field(repr=False)
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        """Back to the free list; idempotent, callable from any thread."""
        self._arena._free(self)

    @property
    def released(self) -> bool:
        return self._released

    @property
    def arena_name(self) -> str:
        """The shared-memory name of its arena (what another process maps)."""
        return self._arena.name


def size_class(nbytes: int) -> int:
    """The smallest power of two >= `nbytes`, at least MIN_BLOCK."""
    return max(MIN_BLOCK, 1 << max(0, nbytes - 1).bit_length())


class HostArena:
    """`capacity_bytes` of shared host memory handed out in power-of-two
    blocks of MIN_BLOCK..`max_block` bytes.

    `pin`: None pins when CUDA is available (and warns, unpinned, if the
    driver refuses); True requires pinning (raises without CUDA or on failure);
    False never pins. `pinned` says what happened.
    """

    def __init__(self, capacity_bytes: int, *, name: str | None = None, pin: bool | None = None,
                 max_block: int = MAX_BLOCK) -> None:
        if capacity_bytes < MIN_BLOCK:
            raise ValueError(f"capacity_bytes must be at least {MIN_BLOCK}, got {capacity_bytes}")
        if max_block < MIN_BLOCK or max_block & (max_block - 1):
            raise ValueError(f"max_block must be a power of two >= {MIN_BLOCK}, got {max_block}")
        if pin and not torch.cuda.is_available():
            raise RuntimeError("HostArena(pin=True) needs CUDA")
        # whole pages: the tail past the last page could not hold a block anyway
        self._capacity = capacity_bytes - capacity_bytes % MIN_BLOCK
        self.max_block = max_block
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=self._capacity)
        self.name: str = self._shm.name
        # numpy holds a buffer export on the mapping, and the tensor holds numpy: while any view of the
        # region lives, the mapping cannot be closed under it (SharedMemory.close raises instead)
        self._buf: torch.Tensor | None = torch.frombuffer(np.frombuffer(self._shm.buf, dtype=np.uint8),
                                                          dtype=torch.uint8)
        self._ptr = self._buf.data_ptr()
        self.pinned = False
        if pin or (pin is None and torch.cuda.is_available()):
            self._register(required=bool(pin))
        self._lock = threading.Lock()
        self._free_lists: dict[int, list[int]] = {}
        self._top = 0          # bump pointer: the region above it was never handed out
        self._in_use: dict[int, int] = {}   # offset -> size class of every block handed out
        self._in_use_bytes = 0
        self._misses = 0
        self._closed = False

    def _register(self, required: bool) -> None:
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(self._ptr, self._capacity, 0)
        if rc != cudart.cudaError.success:
            msg = f"cudaHostRegister of the host arena ({self._capacity} bytes) failed: {rc}"
            if required:
                self._buf = None  # its buffer export would keep close() from unmapping
                self._shm.close()
                self._shm.unlink()
                raise RuntimeError(msg)
            warnings.warn(msg + "; the arena stays pageable (device-to-host copies will block)", stacklevel=3)
            return
        self.pinned = True

    # -- allocation ---------------------------------------------------------------------------------

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> ArenaBlock | None:
        """A block viewed as a contiguous `shape` tensor of `dtype`, or None
        (counted in `misses`) when it exceeds `max_block` or the region has no
        room: the caller then allocates normally."""
        shape = tuple(shape)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        with self._lock:
            if self._closed:
                raise RuntimeError("HostArena is closed")
            taken = self._take(size_class(nbytes))
            if taken is None:
                self._misses += 1
                return None
            buf = self._buf  # read under the lock: close() drops it
        offset, size = taken
        view = buf[offset:offset + nbytes].view(dtype).view(shape)
        return ArenaBlock(view, offset, size, self)

    def _take(self, cls: int) -> tuple[int, int] | None:
        """(offset, size) of a block for class `cls` (lock held): its free
        list, else fresh space, else a free block of a larger class (used whole,
        so `size` may exceed `cls`)."""
        if cls > self.max_block:
            return None
        size = cls
        free = self._free_lists.get(cls)
        if free:
            offset = free.pop()
        elif self._top + cls <= self._capacity:
            offset = self._top
            self._top += cls
        else:
            offset = None
            bigger = cls * 2
            while bigger <= self.max_block:
                if self._free_lists.get(bigger):
                    offset, size = self._free_lists[bigger].pop(), bigger
                    break
                bigger *= 2
            if offset is None:
                return None
        self._in_use[offset] = size
        self._in_use_bytes += size
        return offset, size

    def _free(self, block: ArenaBlock) -> None:
        with self._lock:
            if block._released:
                return
            block._released = True
            size = self._in_use.pop(block.offset)
            self._in_use_bytes -= size
            if not self._closed:
                self._free_lists.setdefault(size, []).append(block.offset)

    # -- state --------------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Bytes in the region (capacity_bytes rounded down to whole pages)."""
        return self._capacity

    @property
    def in_use_bytes(self) -> int:
        """Bytes of the blocks handed out and not yet released (whole size classes)."""
        return self._in_use_bytes

    @property
    def blocks_in_use(self) -> int:
        return len(self._in_use)

    @property
    def misses(self) -> int:
        """Allocations refused: too large for any class, or no room left."""
        return self._misses

    @property
    def tensor(self) -> torch.Tensor:
        """The whole region as uint8 (for tests and diagnostics)."""
        if self._buf is None:
            raise RuntimeError("HostArena is closed")
        return self._buf

    # -- teardown -----------------------------------------------------------------------------------

    def close(self, *, force: bool = False) -> None:
        """Unregister, unmap and unlink the region. Refuses (RuntimeError)
        while blocks are in use, since their views would dangle; `force=True`
        closes anyway with a warning: the name is unlinked at once, and the
        mapping stays until the last view of it is gone (or the process ends).
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            if self._in_use and not force:
                raise RuntimeError(f"HostArena.close: {len(self._in_use)} blocks still in use "
                                   f"({self._in_use_bytes} bytes); release them first or close(force=True)")
            if self._in_use:
                warnings.warn(f"HostArena closed with {len(self._in_use)} blocks in use", stacklevel=2)
            self._closed = True
        if self.pinned:
            # the views left after a forced close read pageable memory: still valid, no longer locked
            cudart = torch.cuda.cudart()
            rc = cudart.cudaHostUnregister(self._ptr)
            if rc != cudart.cudaError.success:
                warnings.warn(f"cudaHostUnregister of the host arena failed: {rc}", stacklevel=2)
            self.pinned = False
        self._buf = None
        self._shm.unlink()
        try:
            self._shm.close()
        except BufferError:
            # views still map it; SharedMemory.__del__ would retry and complain, so keep it referenced
            _lingering.append(self._shm)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # while an exception unwinds, blocks are often still held: close anyway rather than mask it
        self.close(force=exc_type is not None)

    def __repr__(self) -> str:
        return (f"HostArena(name={self.name!r}, capacity={self._capacity}, in_use={self._in_use_bytes}, "
                f"blocks={len(self._in_use)}, misses={self._misses}, pinned={self.pinned})")


def attach(name: str) -> tuple[shared_memory.SharedMemory, torch.Tensor]:
    """Map an arena made by another process: (the mapping, the region as
    uint8). Drop the tensor (and its views) before `shm.close()`; never
    unlink, the creating process owns the name."""
    if sys.version_info >= (3, 13):
        shm = shared_memory.SharedMemory(name=name, track=False)
    else:
        # before 3.13 attaching registers the name with the resource tracker; a multiprocessing child
        # shares its parent's tracker, where the duplicate is harmless
        shm = shared_memory.SharedMemory(name=name)
    return shm, torch.frombuffer(np.frombuffer(shm.buf, dtype=np.uint8), dtype=torch.uint8)


def stage_to_host(rows: torch.Tensor | list[torch.Tensor], arena: HostArena | None, stage_cpu: bool = False,
                  ) -> tuple[torch.Tensor | list[torch.Tensor], torch.cuda.Event | None, list[ArenaBlock]]:
    """Rows copied to the host without blocking, into arena blocks where they
    fit: (host rows, the copy's event, the blocks used). Like
    `transfer.to_host`: a list gives a list, a tensor a tensor; rows not on
    CUDA come back as they are, with no event and no blocks.

    With `stage_cpu`, rows on the host are copied into the arena as well (no
    event): a CPU worker given an arena stages its outputs the same way.

    The caller waits on the event before reading the rows, and releases the
    blocks only after that (the GPU writes into them until then). Rows that
    got no block (misses, or `arena` None) are page-locked copies from torch's
    caching host allocator, which keeps them until the copy has run.
    """
    first = rows[0] if isinstance(rows, list) and rows else rows
    on_cpu = not isinstance(first, torch.Tensor) or first.device.type != "cuda"
    if on_cpu and not (stage_cpu and arena is not None and isinstance(first, torch.Tensor)):
        return rows, None, []
    blocks: list[ArenaBlock] = []

    def copy(r: torch.Tensor) -> torch.Tensor:
        block = arena.alloc(tuple(r.shape), r.dtype) if arena is not None else None
        if block is None:
            return torch.empty(r.shape, dtype=r.dtype, pin_memory=True).copy_(r, non_blocking=True)
        blocks.append(block)
        return block.tensor.copy_(r, non_blocking=True)

    host = [copy(r) for r in rows] if isinstance(rows, list) else copy(rows)
    if on_cpu:  # `stage_cpu`: host rows copied into the arena too (a CPU worker with an arena)
        return host, None, blocks
    ready = torch.cuda.Event()
    ready.record()
    return host, ready, blocks
