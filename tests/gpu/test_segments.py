"""The segment kernels (gdn_server/kernels/_segments.py) against plain torch on the same bytes: the
scan's NaN/Inf flags and row digests (the digest's definition written out here in int64), the
copy's bytes at 2-byte-aligned addresses and over rows past the grid's bound."""
from __future__ import annotations

import pytest
import torch

from gdn_server.kernels import SEGMENT_FIELDS, TensorScan, segments_copy
from gdn_server.kernels._segments import BATCH_SEGMENTS
from gdn_server.work import DeviceSpan

DEV = "cuda"


def reference_digests(tensors: list[torch.Tensor], rows: int) -> list[int]:
    words = torch.cat([t.reshape(rows, -1).view(torch.int16).to(torch.int64) & 0xFFFF for t in tensors], dim=1)
    weights = torch.arange(words.shape[1], device=words.device, dtype=torch.int64) * 2 + 1
    return ((words * weights).sum(dim=1) & 0xFFFFFFFF).tolist()


def spans(tensors: list[torch.Tensor]) -> list[DeviceSpan]:
    """The tensors' spans, once their writes are done: the scan runs on a stream of its own and
    reads them as they are (a client finishes its writes before it sends a request)."""
    torch.cuda.synchronize()
    return [DeviceSpan.of(t) for t in tensors]


def step_tensors(B: int, T: int = 1, H: int = 16, HV: int = 32, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    shapes = [(B, T, H, 128), (B, T, H, 128), (B, T, HV, 128), (B, T, HV), (B, T, HV)]
    return [torch.randn(s, generator=gen, device=DEV).to(torch.bfloat16) for s in shapes]


@pytest.mark.parametrize("B,T", [(1, 1), (3, 2), (256, 1), (5, 8)])
def test_scan_digests_equal_the_reference_and_find_no_nonfinite(B, T):
    tensors = step_tensors(B, T, seed=B + T)
    bad, digests = TensorScan(DEV)(spans(tensors), B).result()
    assert bad is None and list(digests) == reference_digests(tensors, B)
    assert len(set(digests)) == B


def test_scan_names_the_first_tensor_with_a_nan_or_inf_and_rows_digest_alone():
    tensors = step_tensors(4, 2, seed=7)
    scan = TensorScan(DEV)
    _, whole = scan(spans(tensors), 4).result()
    _, alone = scan(spans([t[2:3] for t in tensors]), 1).result()
    assert alone == whole[2:3]
    tensors[4][3, 1, 5] = float("nan")
    assert scan(spans(tensors), 4).result()[0] == 4
    tensors[2][0, 0, 1, 7] = float("-inf")
    assert scan(spans(tensors), 4).result()[0] == 2
    tensors[2][0, 0, 1, 7] = 1.0
    tensors[4][3, 1, 5] = 0.0
    bad, now = scan(spans(tensors), 4).result()
    assert bad is None and now == tuple(reference_digests(tensors, 4))
    started = [scan(spans([t[i:i + 1] for t in tensors]), 1) for i in range(4)]  # one launch for all four
    assert [p.result()[1] for p in reversed(started)] == [(d,) for d in reversed(now)]


def test_checks_of_one_batch_and_of_several_answer_each_request_alone():
    """Checks added before any is polled share launches (as many as the batch's room needs); each
    reads its own flags and digests, whichever is read first, and a NaN marks only its request."""
    scan = TensorScan(DEV)
    requests = [step_tensors(1 + i % 3, 1, seed=100 + i) for i in range(BATCH_SEGMENTS // 5 + 7)]
    requests[5][1][0, 0, 3, 9] = float("nan")
    started = [scan(spans(ts), ts[0].shape[0]) for ts in requests]
    started[-1].ready()  # a poll launches the open batch (the one before it was launched when it filled)
    answers = [p.result() for p in reversed(started)][::-1]
    for i, ((bad, digests), ts) in enumerate(zip(answers, requests)):
        assert bad == (1 if i == 5 else None)
        if i != 5:
            assert list(digests) == reference_digests(ts, ts[0].shape[0])


def test_copy_moves_segments_at_odd_word_addresses_and_many_rows():
    rows, words = 70_000, 3  # more rows than a grid's y extent holds
    src = torch.randint(-30000, 30000, (rows * words + 1,), dtype=torch.int16, device=DEV)
    dst = torch.zeros(rows * words + 9, dtype=torch.int16, device=DEV)
    small_src = torch.randint(-30000, 30000, (2 * 1000 + 1,), dtype=torch.int16, device=DEV)
    table = torch.tensor([
        (src.data_ptr() + 2, dst.data_ptr() + 6, words, rows, 0, 0),  # 2-byte aligned, not 16
        (small_src.data_ptr(), dst.data_ptr() + 2 * (rows * words + 3), 1, 5, 0, 0),
    ], dtype=torch.int64, device=DEV).view(2, SEGMENT_FIELDS)
    segments_copy(table, torch.zeros(1, dtype=torch.int32, device=DEV), rows)
    torch.cuda.synchronize()
    assert torch.equal(dst[3:3 + rows * words], src[1:1 + rows * words])
    assert torch.equal(dst[rows * words + 3:rows * words + 8], small_src[:5])
    assert dst[:3].eq(0).all() and dst[-1] == 0
