"""The tensor store: tensors flowing along walk edges, keyed by handles.

A step's output for a whole batch is stored once; each row that will read it
holds a reference `TensorRef(handle, row)` counted against its request. A
tensor is freed when its last reference has been taken or released, and
tearing a request down releases every reference it still holds.

Thread-safe: worker threads put and take; the engine tears requests down.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Row `row` of the tensor behind `handle` (row None: the whole tensor)."""

    handle: str
    row: int | None = None


class _Entry:
    __slots__ = ("tensor", "refs")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.refs: Counter[str] = Counter()


class TensorStore:
    def __init__(self) -> None:
        self._handles = itertools.count()  # next() on it is atomic under the GIL: unique across worker threads
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._by_owner: dict[str, set[str]] = {}

    def put(self, tensor: torch.Tensor, owners: Iterable[str]) -> str:
        """Store `tensor` with one reference per entry of `owners` (a request
        may appear several times); returns its handle."""
        handle = f"t{next(self._handles):x}"
        entry = _Entry(tensor)
        refs = entry.refs
        for owner in owners:  # not `Counter.update`: its check for a mapping costs more than the one owner
            refs[owner] = refs.get(owner, 0) + 1
        if not entry.refs:
            return handle  # nobody will read it: nothing to keep
        with self._lock:
            self._entries[handle] = entry
            for owner in entry.refs:
                self._by_owner.setdefault(owner, set()).add(handle)
        return handle

    def holds(self, ref: TensorRef) -> bool:
        """Whether `ref`'s tensor is still stored."""
        with self._lock:
            return ref.handle in self._entries

    def get(self, ref: TensorRef) -> torch.Tensor:
        """Read without consuming."""
        with self._lock:
            t = self._entries[ref.handle].tensor
        return t if ref.row is None else t[ref.row]

    def numel(self, ref: TensorRef) -> int:
        """Elements of the referenced row (or tensor), without slicing it."""
        with self._lock:
            shape = self._entries[ref.handle].tensor.shape
        n = 1
        for d in shape if ref.row is None else shape[1:]:
            n *= d
        return n

    def take(self, ref: TensorRef, owner: str) -> torch.Tensor:
        """Read and drop `owner`'s reference."""
        with self._lock:
            entry = self._entries[ref.handle]
            self._drop(ref.handle, entry, owner, 1)
        t = entry.tensor
        return t if ref.row is None else t[ref.row]

    def retain(self, ref: TensorRef, owner: str, n: int = 1) -> None:
        """Add `n` references for `owner` (a value read by several steps)."""
        with self._lock:
            self._entries[ref.handle].refs[owner] += n
            self._by_owner.setdefault(owner, set()).add(ref.handle)

    def release(self, ref: TensorRef, owner: str, missing_ok: bool = False) -> None:
        """Drop one of `owner`'s references without reading. `missing_ok`: a
        reference the owner may no longer hold (sent by another worker to a
        request the engine has since torn down) is ignored."""
        with self._lock:
            entry = self._entries.get(ref.handle)
            if entry is not None and (not missing_ok or entry.refs[owner] > 0):
                self._drop(ref.handle, entry, owner, 1)

    def drop_owner(self, owner: str) -> int:
        """Release every reference `owner` holds; returns how many tensors it
        was still holding."""
        with self._lock:
            handles = self._by_owner.pop(owner, set())
            for h in handles:
                entry = self._entries[h]
                del entry.refs[owner]
                if not entry.refs:
                    del self._entries[h]
        return len(handles)

    def _drop(self, handle: str, entry: _Entry, owner: str, n: int) -> None:
        left = entry.refs[owner] - n
        if left < 0:
            raise KeyError(f"{owner} holds no reference to {handle}")
        if left:
            entry.refs[owner] = left
            return
        del entry.refs[owner]
        owned = self._by_owner.get(owner)
        if owned is not None:
            owned.discard(handle)
            if not owned:
                del self._by_owner[owner]
        if not entry.refs:
            del self._entries[handle]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def num_owners(self) -> int:
        with self._lock:
            return len(self._by_owner)
