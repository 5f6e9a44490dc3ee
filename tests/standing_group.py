"""A standing group as the scheduler sees it (`scheduler.StandingGroup`), for
scheduler tests: a number of rows, no pages to grow."""

from __future__ import annotations


class FakeGroup:
    def __init__(self, rows: int, mixes: bool = False, emits: bool = False) -> None:
        self.ticket = -1
        self.rows = rows
        self.mixes = mixes
        self.emits = emits

    def __len__(self) -> int:
        return self.rows

    def short_of_pages(self, page_size: int, ahead: int = 1) -> list[int]:
        return []

    def steps_room(self, most: int) -> int:
        return 1

    def pages(self, row: int) -> list[int]:
        return []

    def growing(self) -> list[int]:
        return list(range(self.rows))
