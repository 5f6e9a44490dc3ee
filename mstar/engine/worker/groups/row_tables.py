"""A decode group's per-row tables grown by joining rows: a table of ids
(page tables, stop ids) padded to its widest row, and a table that exists
once any row has a row of it (the penalties' seen ids and output counts);
a step's advance of its counts, and the rows of a window.
"""

from __future__ import annotations

import torch


def with_rows(table: torch.Tensor | None, rows: list[torch.Tensor | None], count: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor | None:
    """`table` [count, W] with `rows` below it (zeros for a None, or for a
    None table); None while neither has any."""
    width = next((r.numel() for r in rows if r is not None), None)
    if table is None and width is None:
        return None
    width = width or table.shape[1]
    base = table if table is not None else torch.zeros(count, width, dtype=dtype, device=device)
    return torch.cat([base, torch.stack([r if r is not None else torch.zeros(width, dtype=dtype, device=device)
                                         for r in rows])])


def cat_padded(table: torch.Tensor, rows: list, fill: int) -> torch.Tensor:
    """`table` [n, W] (host, int64) with `rows` (lists of ids) below it, every row padded with `fill` to the
    widest."""
    width = max([table.shape[1]] + [len(r) for r in rows]) or 1
    new = torch.full((len(rows), width), fill, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            new[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
    if table.shape[1] < width:
        table = torch.cat([table, torch.full((table.shape[0], width - table.shape[1]), fill, dtype=torch.long)], 1)
    return torch.cat([table, new])


def stepped(table: torch.Tensor, rows: slice, by: int, every: bool) -> torch.Tensor:
    """A new `table` [n] whose `rows` (`every`: all n) count `by` more; `table` itself is left as it was."""
    if every:
        return table + by
    table = table.clone()
    table[rows] += by
    return table


def rows_of(tables: tuple[torch.Tensor, ...], rows: slice, every: bool) -> tuple[torch.Tensor, ...]:
    """Rows `rows` of each table: the tables themselves where `rows` is `every` row."""
    return tables if every else tuple(t[rows] for t in tables)
