"""A helper process shares memory with the caller: an arena block passes by
name and offset, and what the helper writes into it the caller sees, with no
copy; results come back; a failing call fails its future and the helper
keeps serving. On the GPU machine, CUDA tensors pass as IPC handles."""

from __future__ import annotations

import pytest
import torch

import helper_fns
from mstar.engine.movement.arena import HostArena
from mstar.engine.movement.helper_process import HelperProcess


@pytest.fixture(scope="module")
def helper():
    with HelperProcess(helper_fns.add_in_place) as h:
        yield h


def test_an_arena_block_is_shared_not_copied(helper: HelperProcess) -> None:
    with HostArena(1 << 20, pin=False) as arena:
        block = arena.alloc((4, 8), torch.float32)
        assert block is not None
        block.tensor.fill_(1.0)
        assert helper.submit(block, 2.0).result(timeout=60) == 3.0 * 32
        assert torch.equal(block.tensor, torch.full((4, 8), 3.0))  # written by the other process
        block.release()


def test_plain_tensors_and_failures() -> None:
    with HelperProcess(helper_fns.negated) as h:
        out = h.submit(torch.arange(5.0)).result(timeout=60)
        assert torch.equal(out, -torch.arange(5.0))
    with HelperProcess(helper_fns.fails) as h:
        with pytest.raises(RuntimeError, match="ValueError: bad media"):
            h.submit(torch.zeros(1)).result(timeout=60)
        h2 = h.submit(torch.zeros(1))  # still serving after a failed call
        with pytest.raises(RuntimeError):
            h2.result(timeout=60)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")
def test_cuda_tensors_pass_as_ipc_handles(helper: HelperProcess) -> None:
    x = torch.ones(1 << 20, device="cuda")
    assert helper.submit(x, 1.0).result(timeout=120) == 2.0 * (1 << 20)
    torch.cuda.synchronize()
    assert bool((x == 2.0).all())  # the helper wrote the caller's device memory through the IPC handle
