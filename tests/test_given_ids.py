"""Token ids as a request gives them (`models/prompt.py: given_ids`): a list
of ints (the common case, checked without a Python loop), a tuple, a 1-D
integer tensor, or an int subclass other than bool; anything else refused."""

from __future__ import annotations

import enum

import pytest
import torch

from mstar.errors import RequestError
from mstar.models.prompt import given_ids


class _Id(enum.IntEnum):
    A = 7


def test_lists_tuples_tensors_and_int_subclasses_are_ids() -> None:
    ids = [1, 2, 3]
    got = given_ids(ids)
    assert got == [1, 2, 3] and got is not ids  # a copy: the request's list stays the caller's
    assert given_ids((4, 5)) == [4, 5]
    assert given_ids(torch.tensor([6, 7])) == [6, 7]
    assert given_ids([_Id.A, 8]) == [7, 8]
    assert given_ids(None) == [] and given_ids([]) == []


@pytest.mark.parametrize("bad", [[True, 2], [1, 2.0], [1, "2"], "12", torch.tensor([1.0]), torch.tensor([[1]])])
def test_anything_else_is_refused(bad: object) -> None:
    with pytest.raises(RequestError):
        given_ids(bad)
