"""A KV row has one writer: its own methods (`engine/worker/kv_rows.py`).
Every other module of the package is read for statements that assign, add
to or mutate in place a row's fields on anything but `self` (a decode
group's own columns of the same names are its own), and each such statement
fails the test. Also: the methods move a row the way steps, groups and
preemption need."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import torch

import mstar
from mstar.engine.memory.kv_cache import SwappedKV
from mstar.engine.worker.kv_rows import KVRow, seen_masks
from mstar.scheduler import PagePool

FIELDS = {f.name for f in fields(KVRow)} - {"component"}
MUTATORS = {"append", "extend", "clear", "pop", "insert", "remove", "__setitem__", "copy_", "zero_", "fill_"}
OWNER = "kv_rows.py"


def _writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, field) of each write of a row field on an object other than `self`."""
    out = []

    def target(node: ast.AST) -> None:
        while isinstance(node, ast.Subscript):  # row.seen[ids] = True writes row.seen too
            node = node.value
        if isinstance(node, ast.Attribute) and node.attr in FIELDS and not (
                isinstance(node.value, ast.Name) and node.value.id == "self"):
            out.append((node.lineno, node.attr))
        elif isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                target(elt)

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                target(t)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            target(node.target)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in MUTATORS):
            target(node.func.value)
    return out


def test_only_its_methods_write_a_kv_row() -> None:
    root = Path(mstar.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == OWNER:
            continue
        for line, name in _writes(ast.parse(path.read_text())):
            found.append(f"{path.relative_to(root.parent)}:{line} writes .{name}")
    assert not found, "a KV row is written outside kv_rows.py:\n" + "\n".join(found)


def test_the_scan_sees_a_write() -> None:
    # what the test above would report, so that it cannot pass by seeing nothing
    code = "part.row('x').pages.append(3)\nrow.kv_len += 1\nself.seen = None\nrow.seen[ids] = True\n"
    assert sorted(_writes(ast.parse(code))) == [(1, "pages"), (2, "kv_len"), (4, "seen")]


def test_a_row_moves_through_its_methods() -> None:
    pool = PagePool(8, 4)
    row = KVRow("llm")
    row.admit(pool.allocate(2))
    row.advance(6, rope_delta=-2, sampled=True)
    assert (row.kv_len, row.start, row.generated) == (6, 4, 1)
    row.advance(1, None, sampled=True)
    assert (row.kv_len, row.start, row.generated) == (7, 5, 2)
    row.advance(3, None, sampled=False, reset=True)  # a restarted cache: its pages stay
    assert (row.kv_len, row.rope_delta, len(row.pages)) == (3, 0, 2)
    masks = seen_masks([row], [torch.tensor([1, 5, 99])], vocab=10, device=torch.device("cpu"))
    mask = row.seen
    assert mask.nonzero().flatten().tolist() == masks[0].nonzero().flatten().tolist() == [1, 5, 9]
    row.into_group()
    assert row.seen is None
    row.back_from_group(kv_len=9, generated=4)
    row.keep_seen(mask)
    assert (row.kv_len, row.generated, row.seen is mask) == (9, 4, True)
    row.swap_out(SwappedKV([], 2))
    assert row.pages == [] and row.swapped is not None
    row.admit(pool.allocate(2))
    swapped, state = row.swapped_in()
    assert swapped.num_pages == 2 and state is None and row.swapped is None
    row.take_slot(3)  # a row with per-row state: its slot goes with its KV
    saved = {"rec": torch.ones(2)}
    pool.free(row.pages)  # as the plan that preempts it does
    row.swap_out(SwappedKV([], 2), saved)
    assert (row.slot, row.swapped_state is saved, row.pages) == (None, True, [])
    row.admit(pool.allocate(2))
    row.take_slot(1)
    assert row.swapped_in()[1] is saved and (row.swapped, row.swapped_state, row.slot) == (None, None, 1)
    assert row.release(pool) and pool.num_free == 6 and not row.release(pool)


def test_a_steps_seen_masks_mark_each_rows_new_tokens_over_what_it_saw_before() -> None:
    """Rows with a penalty mark their tokens (over a mask they had, or none);
    a row without one keeps its mask as it was, unmarked, or none at all."""
    cpu = torch.device("cpu")
    before = KVRow("llm")
    seen_masks([before], [torch.tensor([2])], vocab=8, device=cpu)
    fresh, plain, plain_before = KVRow("llm"), KVRow("llm"), KVRow("llm")
    seen_masks([plain_before], [torch.tensor([7])], vocab=8, device=cpu)
    masks = seen_masks([before, fresh, plain, plain_before],
                       [torch.tensor([[3, 4]]), torch.tensor([0, 0, 9]), None, None], vocab=8, device=cpu)
    assert [m.nonzero().flatten().tolist() for m in masks] == [[2, 3, 4], [0, 7], [], [7]]
    assert before.seen is not None and before.seen.nonzero().flatten().tolist() == [2, 3, 4]
    assert fresh.seen.nonzero().flatten().tolist() == [0, 7]   # an id past the vocabulary lands on its last
    assert plain.seen is None and plain_before.seen.nonzero().flatten().tolist() == [7]
