"""Encoder rows into a decoder's input: a step's token embeddings [T, H] and
its `TokenBatch.embeds` in; the embeddings with each named input's rows in
place of the placeholder tokens they stand for, out."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch


def spliced(embeds: torch.Tensor, given: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
            names: Iterable[str]) -> torch.Tensor:
    """`given[name]` = (rows [Te, H], packed token index [Te]); names the step
    was not given are skipped."""
    for name in names:
        if name in given:
            rows, index = given[name]
            embeds = embeds.index_copy(0, index, rows.to(embeds.dtype))
    return embeds
