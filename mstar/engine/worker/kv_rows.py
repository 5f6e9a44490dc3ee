"""A partition's rows of the paged KV cache: one `KVRow` per KV component a
partition steps (a thinker's; a talker's and its code predictor's side by
side), with its pages, how many tokens they hold, where its positions stand,
its sampler's draw counter, what its repetition penalty has seen and how
often it generated each id (its presence and frequency penalties').

The methods below are the only writers of a row (`tests/test_kv_rows.py`
holds every other module to that), so a row's state moves in a few named
ways: admitted with pages, advanced by a step that ran, restarted, handed to
and back from a decode group, swapped out and in, released. While a decode
group holds a row, the group's tensors are the live copy; it hands the row
back (`back_from_group`) when the row leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mstar.engine.memory.kv_cache import SwappedKV
from mstar.engine.movement.transfer import to_device
from mstar.scheduler import PagePool


@dataclass(eq=False, slots=True)
class KVRow:
    component: str
    pages: list[int] = field(default_factory=list)
    branch: str = "main"              # after a fork: which of the partition's rows of the component
    kv_len: int = 0                   # tokens its pages hold
    rope_delta: int = 0               # its next position minus kv_len (set by a step given its positions)
    generated: int = 0                # tokens it sampled so far (the sampler's draw counter)
    drawn: dict[str, int] = field(default_factory=dict)  # tokens its modes drew themselves, by sampling key
    seen: torch.Tensor | None = None  # [vocab] bool, for the repetition penalty
    outputs: torch.Tensor | None = None  # [vocab] float32 counts of the ids it generated (presence, frequency)
    swapped: SwappedKV | None = None  # preempted: its KV, in host memory until it resumes
    slot: int | None = None           # its slot of the component's per-row state (a recurrent layer's)
    slot_new: bool = False            # its slot was zeroed for it and no step has run on it yet
    swapped_state: dict[str, torch.Tensor] | None = None  # preempted: its slot's state, in host memory
    token_ids: list[int] | None = None  # the ids its pages hold from position 0, while they are followed
    grows: bool = False               # takes its pages as it goes (`--kv-reservation`): the rows preempted for pages

    @property
    def start(self) -> int:
        """The position its next token takes."""
        return self.kv_len + self.rope_delta

    def admit(self, pages: list[int], cached_tokens: int = 0) -> None:
        """The scheduler admitted a step of this row with `pages` more; with
        `cached_tokens`, a new row whose first pages hold that much of its
        prompt already (a prefix cache hit)."""
        if cached_tokens:
            assert not self.pages and self.kv_len == 0, "a cached prefix starts a row"
            self.kv_len = cached_tokens
        self.pages.extend(pages)

    def takes_pages(self, as_it_goes: bool) -> None:
        """Its first step (a turn's) is queued: it takes its pages as it goes,
        and may be preempted for them, or reserves all it may hold at once."""
        self.grows = as_it_goes

    def fork_from(self, main: KVRow, pages: list[int]) -> None:
        """A branch that starts with what `main` holds, in `pages` (its full
        pages shared, a copy of its partial last one), taking pages as `main` does."""
        self.pages, self.kv_len, self.rope_delta, self.grows = pages, main.kv_len, main.rope_delta, main.grows

    def follow(self, prompt: list[int]) -> None:
        """Follow the ids its pages hold, from its first step's `prompt` on:
        when it ends, its full pages may enter the prefix cache, what it
        generated included."""
        self.token_ids = list(prompt)

    def sampled(self, token: int) -> None:
        """It sampled `token`, which its loop's next step feeds into its pages."""
        if self.token_ids is not None:
            self.token_ids.append(token)

    def unfollow(self) -> None:
        """A step other than its token loop's writes its pages: their ids are not known here."""
        self.token_ids = None

    def full_pages(self, page_size: int) -> tuple[list[int], list[int]]:
        """The followed ids of its full pages, and those pages (none unfollowed)."""
        if self.token_ids is None:
            return [], []
        n = min(self.kv_len, len(self.token_ids)) // page_size
        return self.token_ids[:n * page_size], self.pages[:n]

    def take_slot(self, slot: int) -> None:
        """Admitted with a slot of per-row state (zeroed by the caller)."""
        self.slot, self.slot_new = slot, True

    def stepped_on_slot(self) -> None:
        """A step ran on its slot: the state in it is no longer empty."""
        self.slot_new = False

    def add_page(self, page: int) -> None:
        """One more page for a growing decode row."""
        self.pages.append(page)

    def advance(self, n: int, rope_delta: int | None, sampled: bool, reset: bool = False) -> None:
        """A step that ran appended `n` tokens (after a restart of the cache,
        with `reset`), gave positions that move its rope delta, and sampled."""
        self.kv_len = n if reset else self.kv_len + n
        if reset:
            self.rope_delta = 0
        if rope_delta is not None:
            self.rope_delta = rope_delta
        if sampled:
            self.generated += 1

    def drew(self, key: str, n: int) -> None:
        """A step's mode drew `n` tokens itself under sampling key `key`."""
        self.drawn[key] = self.drawn.get(key, 0) + n

    def saw_in(self, mask: torch.Tensor) -> None:
        """Its repetition penalty's seen mask is now `mask`: its row of a
        step's masks (`seen_masks`), with what it was shown marked."""
        self.seen = mask

    def counted_in(self, counts: torch.Tensor) -> None:
        """Its output counts are now `counts`: its row of a step's counts
        (`count_outputs`), with the token it drew counted."""
        self.outputs = counts

    def new_turn(self) -> None:
        """A later turn starts: the penalties look at it alone."""
        self.seen = self.outputs = None

    def into_group(self) -> None:
        """A decode group takes the row over; its seen mask and output counts go with it."""
        self.seen = self.outputs = None

    def back_from_group(self, kv_len: int, generated: int, drawn: tuple[str, int] | None = None) -> None:
        """A decode group hands the row back as its last step left it
        (`drawn`: its mode's own draws so far, under their sampling key)."""
        self.kv_len, self.generated = kv_len, generated
        if drawn is not None:
            self.drawn[drawn[0]] = drawn[1]

    def keep_seen(self, seen: torch.Tensor | None) -> None:
        """The seen mask a decode group kept for the row, handed back."""
        self.seen = seen

    def keep_outputs(self, outputs: torch.Tensor | None) -> None:
        """The output counts a decode group kept for the row, handed back."""
        self.outputs = outputs

    def swap_out(self, swapped: SwappedKV, state: dict[str, torch.Tensor] | None = None) -> None:
        """Preempted: its KV went to host memory, its pages back to the pool;
        with `state`, its slot's state went too and the slot is free."""
        self.swapped, self.pages = swapped, []
        if self.seen is not None:  # its own copy: a view would hold the whole step's masks while it waits
            self.seen = self.seen.clone()
        if self.outputs is not None:
            self.outputs = self.outputs.clone()
        if state is not None:
            self.swapped_state, self.slot = state, None

    def swapped_in(self) -> tuple[SwappedKV, dict[str, torch.Tensor] | None]:
        """Its KV is coming back into the pages it was admitted with, and its
        state (if it had one) into the slot it was admitted with."""
        swapped, state = self.swapped, self.swapped_state
        assert swapped is not None
        self.swapped = self.swapped_state = None
        return swapped, state

    def release(self, pool: PagePool | None, slots: PagePool | None = None) -> bool:
        """Give its pages (and its state slot) back; whether it held pages
        (a row of a plain component with state has none, and no pool)."""
        held = bool(self.pages)
        if held:
            assert pool is not None
            pool.free(self.pages)
        self.pages = []
        if self.slot is not None and slots is not None:
            slots.free([self.slot])
        self.slot = None
        return held


def seen_masks(rows: Sequence[KVRow], ids: Sequence[torch.Tensor | None], vocab: int,
               device: torch.device) -> torch.Tensor:
    """The repetition penalty's seen masks of a step's rows, [B, V] bool:
    each row's mask so far (none: nothing seen), with `ids[i]` marked where
    given (a penalised row's new tokens); such a row keeps its row of the
    result as its mask from now on. One scatter marks every row: a mask of
    its own a row was three launches, hundreds for a burst of admissions.
    A row's view holds the whole [B, V] tensor until it lets go: joining a
    decode group (which copies), a new turn, or a swap (which clones)."""
    # a later chunk or turn of a row that saw tokens before brings its mask
    masks = _step_table([row.seen for row in rows], vocab, torch.bool, device)
    marking = [i for i, t in enumerate(ids) if t is not None]
    if not marking:
        return masks
    flat = [ids[i].reshape(-1) for i in marking]
    where = torch.repeat_interleave(torch.tensor(marking), torch.tensor([t.numel() for t in flat]))
    if all(t.device.type == "cpu" for t in flat):
        cols = to_device(torch.cat(flat), device)   # one copy to the device, not one a row
    else:
        cols = torch.cat([to_device(t, device) for t in flat])
    # the value made on the device: a Python True would be copied from the host, which waits for it on CUDA
    masks.index_put_((to_device(where, device), cols.clamp(0, vocab - 1)), torch.ones((), dtype=torch.bool,
                                                                                       device=device))
    for i in marking:
        rows[i].saw_in(masks[i])
    return masks


def output_counts(rows: Sequence[KVRow], vocab: int, device: torch.device) -> torch.Tensor:
    """The output counts of a step's rows, [B, V] float32: each row's so far
    (none: nothing generated yet, or no presence or frequency penalty)."""
    return _step_table([row.outputs for row in rows], vocab, torch.float32, device)


def count_outputs(rows: Sequence[KVRow], penalised: Sequence[bool], counts: torch.Tensor,
                  tokens: torch.Tensor) -> None:
    """Count the tokens [B] a step drew into `counts` [B, V] (`output_counts`),
    on the device; a penalised row keeps its row of them as its counts (a
    copy: a view would hold the step's whole [B, V] while the row waits)."""
    counts.scatter_add_(1, tokens.reshape(-1, 1), torch.ones(len(rows), 1, dtype=counts.dtype, device=counts.device))
    for i, row in enumerate(rows):
        if penalised[i]:
            row.counted_in(counts[i].clone())


def _step_table(kept: Sequence[torch.Tensor | None], vocab: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """A step's [B, vocab] table of what its rows kept (zeros where a row keeps none)."""
    table = torch.zeros(len(kept), vocab, dtype=dtype, device=device)
    for i, row in enumerate(kept):
        if row is not None:
            table[i] = row
    return table
