"""A decode group's KV pages: which rows' pages cannot hold their next
steps' tokens (what the scheduler grows or preempts for), and the pages a
plan hands them, written into the group's block table at once.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from mstar.engine.worker.groups.group_tables import GroupTables


class GroupPages(GroupTables):
    """The page side of a `LoopGroup`: its rows' lengths, pages and block table."""

    def short_of_pages(self, page_size: int, ahead: int = 1) -> list[int]:
        """Rows whose pages cannot hold the tokens the next `ahead` steps
        write (from position kv_lens, which counts the steps launched
        already), each once per page it lacks."""
        assert not self._joins, "rows that joined are merged before the group is planned"
        # numpy: a few hundred ints, where each torch op costs more than its work (and lets go of the GIL)
        kv, held = self.kv_lens.numpy(), self.page_counts.numpy() * page_size
        if ahead == 1:
            return np.flatnonzero(kv >= held).tolist()
        lacking = np.maximum(-((held - kv - ahead) // page_size), 0)  # pages short of kv + ahead tokens
        return np.repeat(np.arange(len(kv)), lacking).tolist()

    def pages(self, row: int) -> list[int]:
        return self.kv_rows[row].pages

    def growing(self) -> list[int]:
        """Rows that take their pages as they go (`KVRow.grows`): the ones preemption takes first."""
        return [i for i, kv in enumerate(self.kv_rows) if kv.grows]

    def add_pages(self, grow: Sequence[tuple[int, int]]) -> None:
        """Each (row, page) of `grow`: the row owns one more page, at the end
        of its block table. Written into the tables at once (rows cross a
        page boundary together when their lengths agree)."""
        if len(set(i for i, _ in grow)) < len(grow):  # a row named twice takes its pages in turn
            for one in grow:
                self.add_pages([one])
            return
        if not grow:
            return
        for i, page in grow:
            self.kv_rows[i].add_page(page)
        idx = np.array([i for i, _ in grow])
        counts = self.page_counts.numpy()
        cols = counts[idx]
        width = int(cols.max()) + 1
        if width > self.block_table.shape[1]:
            pad = torch.zeros(self.block_table.shape[0], width - self.block_table.shape[1], dtype=torch.long)
            self.block_table = torch.cat([self.block_table, pad], 1)
        # numpy over the host tables' memory: a torch setitem a row costs more than the page it writes
        self.block_table.numpy()[idx, cols] = [page for _, page in grow]
        counts[idx] = cols + 1
