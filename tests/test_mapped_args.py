"""gdn_server/kernels/_mapped.py refuses what it cannot alias, with or without a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.utils.dlpack

from gdn_server.kernels._mapped import _DLTensorHead, _capsule_pointer, device_alias


def test_only_pinned_host_tensors_onto_an_indexed_cuda_device():
    with pytest.raises(ValueError, match="pinned"):
        device_alias(torch.zeros(4), torch.device("cuda", 0))
    with pytest.raises(ValueError, match="pinned"):
        device_alias(torch.zeros(4, device="meta"), torch.device("cuda", 0))


def test_torchs_dlpack_export_starts_with_the_data_pointer_and_device():
    """The layout device_alias relabels: DLTensor's data, then its device (type, id)."""
    t = torch.arange(12, dtype=torch.int32)
    capsule = torch.utils.dlpack.to_dlpack(t)  # held: its deleter frees the header
    head = _DLTensorHead.from_address(_capsule_pointer(capsule, b"dltensor"))
    assert head.data == t.data_ptr()
    assert (head.device.device_type, head.device.device_id) == (1, 0)  # kDLCPU
