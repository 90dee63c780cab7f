"""The tensor codec shared by client and server: round trips, NaN/Inf detection, bad messages."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_client.proto import checks as wire_checks
from gdn_client.wire import WireFormatError, tensor_from_proto, tensor_to_proto


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_exact(dtype):
    x = torch.randn(2, 3, 4, 5).to(dtype)
    y = tensor_from_proto(tensor_to_proto(x))
    assert y.dtype == dtype and torch.equal(x, y)


def test_numpy_inputs_are_accepted():
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float16)
    assert torch.equal(tensor_from_proto(tensor_to_proto(x)), torch.from_numpy(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_found_anywhere(dtype, bad):
    for index in (0, 17, 59):  # first, middle, last element
        x = torch.randn(60).to(dtype)
        x[index] = bad
        with pytest.raises(WireFormatError, match="NaN or Inf"):
            tensor_from_proto(tensor_to_proto(x), finite=True)
    big = torch.full((60,), torch.finfo(dtype).max, dtype=dtype)  # the largest finite value passes
    tensor_from_proto(tensor_to_proto(big), finite=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_non_finite_values_are_found_in_every_chunk(dtype):
    # the check runs chunk by chunk over big tensors: the first and last word of every chunk count
    chunk = wire_checks._CHECK_CHUNK
    n = 2 * chunk + 5
    clean = tensor_to_proto(torch.randn(n).to(dtype))
    tensor_from_proto(clean, finite=True)
    for index in (0, chunk - 1, chunk, 2 * chunk - 1, 2 * chunk, n - 1):
        for bad in (float("nan"), float("-inf")):
            x = torch.randn(n).to(dtype)
            x[index] = bad
            with pytest.raises(WireFormatError, match="NaN or Inf"):
                tensor_from_proto(tensor_to_proto(x), finite=True)


def test_finite_check_leaves_the_tensor_as_sent():
    x = torch.randn(3, wire_checks._CHECK_CHUNK + 1).bfloat16()
    assert torch.equal(tensor_from_proto(tensor_to_proto(x), finite=True), x)


def test_inconsistent_messages_are_refused():
    msg = tensor_to_proto(torch.randn(2, 3))
    msg.data = msg.data[:-1]
    with pytest.raises(WireFormatError, match="needs 24 bytes"):
        tensor_from_proto(msg)
    with pytest.raises(WireFormatError, match="dtype"):
        tensor_from_proto(gdn_pb2.Tensor(dtype=gdn_pb2.DTYPE_UNSPECIFIED, shape=[1], data=b"\0\0"))
    with pytest.raises(WireFormatError, match="negative"):
        tensor_from_proto(gdn_pb2.Tensor(dtype=gdn_pb2.F32, shape=[-1], data=b""))
    huge = gdn_pb2.Tensor(dtype=gdn_pb2.F32, shape=[2**40, 2**40, 2**40], data=b"\0" * 8)
    with pytest.raises(WireFormatError):  # no overflow, no huge allocation
        tensor_from_proto(huge)
    with pytest.raises(TypeError):
        tensor_to_proto(torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("where", [0, 1_500_000, -1])  # first chunk, second chunk, last value
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_big_tensors_nonfinite_check_takes_the_parallel_path(dtype, where, bad):
    """From 1 MiB on the NaN/Inf check runs in torch (one min/max pass): same answers."""
    from gdn_client.proto.checks import _PARALLEL_CHECK_BYTES

    n = 2 * wire_checks._CHECK_CHUNK * 8 + 7  # an odd length: no even split over threads
    assert n * torch.tensor([], dtype=dtype).element_size() >= _PARALLEL_CHECK_BYTES
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[0], x[-2] = torch.finfo(dtype).max, -torch.finfo(dtype).max  # finite extremes are fine
    assert tensor_from_proto(tensor_to_proto(x), finite=True).shape == (n,)
    x[where] = bad
    with pytest.raises(WireFormatError, match="NaN or Inf"):
        tensor_from_proto(tensor_to_proto(x), finite=True)


@pytest.mark.parametrize("bits", [0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF, 0x7F80, 0xFF80])
@pytest.mark.parametrize("big", [False, True])
def test_every_bf16_nan_and_inf_pattern_is_caught(bits, big):
    """Quiet and signalling NaNs of either sign, with any payload, and both infinities: by the
    numpy check of small buffers and the torch one of big buffers alike."""
    from gdn_client.proto.checks import _PARALLEL_CHECK_BYTES, first_nonfinite

    n = _PARALLEL_CHECK_BYTES // 2 + 3 if big else 1001
    words = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).view(torch.int16)
    clean = words.numpy().tobytes()
    assert first_nonfinite([b"", clean], gdn_pb2.BF16) is None
    words[n // 2] = bits - (1 << 16) if bits >= 1 << 15 else bits  # the same 16 bits as a signed word
    assert first_nonfinite([clean, words.numpy().tobytes()], gdn_pb2.BF16) == 1
