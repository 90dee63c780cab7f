"""Pinned host memory as a CUDA tensor (gdn_server/kernels/_mapped.py): the device reads and
writes it in place."""
from __future__ import annotations

import torch

from gdn_server.kernels._mapped import device_alias


def test_a_device_alias_is_the_pinned_memory_read_and_written_by_the_device():
    device = torch.device("cuda", torch.cuda.current_device())
    pinned = torch.randn(3, 1000, pin_memory=True)
    alias = device_alias(pinned, device)
    assert alias.device == device and alias.data_ptr() == pinned.data_ptr() and alias.shape == pinned.shape
    # a kernel reads the host's values over PCIe and writes its result back into host memory
    doubled = alias * 2
    alias.mul_(-1)
    torch.cuda.synchronize(device)
    assert doubled.device == device
    assert torch.equal(doubled.cpu(), -2 * pinned)
    del alias  # the pinned tensor outlives it, and the other way round
    assert pinned.abs().sum() > 0
