"""Host-to-device copies of a step's small index tensors (kernels/host_copy):
dense, shaped as given, and the same values on the device as on the host,
whatever the host tensor's strides."""

from __future__ import annotations

import pytest
import torch

from mstar.kernels.host_copy import index_on, to_device, together_on

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_strided_host_tensors_arrive_with_their_values(device: str) -> None:
    base = torch.arange(5, dtype=torch.long)
    cases = [base, base.expand(3, -1), base[::2], torch.arange(12).view(3, 4).T, base[None].expand(2, 5)[:, 1:]]
    for t in cases:
        out = to_device(t, device)
        assert out.device.type == device and out.shape == t.shape
        assert torch.equal(out.cpu(), t)


@pytest.mark.parametrize("device", DEVICES)
def test_tensors_copied_together_are_views_in_their_own_shapes(device: str) -> None:
    a, b, c = torch.arange(6).view(2, 3), torch.tensor([7, 8]), torch.arange(4).expand(2, -1)
    out = together_on([a, b, c], device)
    assert [o.shape for o in out] == [a.shape, b.shape, c.shape]
    assert all(torch.equal(o.cpu(), t) for o, t in zip(out, (a, b, c)))
    assert torch.equal(index_on([3, 1, 2], device).cpu(), torch.tensor([3, 1, 2]))
