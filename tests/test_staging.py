"""Host staging of a launch (gdn_server.backends.staging): what the CUDA backend copies to the
device, filled here into an ordinary buffer (no GPU needed), for every way a request's inputs
reach it: small bf16 inputs (memcpys in one _wire.stage_inputs call a batch), big ones (torch's
parallel copy), f32 requests (casting copies), in one batch; and the NaN/Inf check of the staged
copies of the requests validation left unchecked."""
from __future__ import annotations

import pytest
import torch

from gdn_server.backends.staging import PARALLEL_COPY_BYTES, carve, fill, make_layout
from gdn_server.config import ModelShape
from gdn_server.work import DecodeWork, StepBatch

SHAPE = ModelShape(num_layers=3, num_q_heads=2, num_v_heads=4)  # K = V = 128
INPUTS = ("q", "k", "v", "a", "b")


def _work(rows: int, dtype: torch.dtype, seed: int) -> DecodeWork:
    """A request of `rows` sessions."""
    g = torch.Generator().manual_seed(seed)
    H, HV, K, V = SHAPE.num_q_heads, SHAPE.num_v_heads, SHAPE.head_dim_k, SHAPE.head_dim_v
    shapes = {"q": (rows, 1, H, K), "k": (rows, 1, H, K), "v": (rows, 1, HV, V), "a": (rows, 1, HV), "b": (rows, 1, HV)}
    tensors = {n: torch.randn(*s, generator=g).to(dtype) for n, s in shapes.items()}
    ids = tuple(f"s{seed}-{i}" for i in range(rows))
    if dtype == torch.bfloat16:  # as validation makes them: raw bytes, tensors built on demand
        raw = tuple(tensors[n].view(torch.int16).numpy().tobytes() for n in INPUTS)
        return DecodeWork(1 + seed % 2, ids, bf16_bytes=raw, input_dims=tuple(shapes[n] for n in INPUTS))
    return DecodeWork(1 + seed % 2, ids, **tensors)


def _staged(works: list[DecodeWork], room: int | None = None, speculative: bool = False):
    """`works` as one batch (pool rows 10, 11, ...; a verify batch where speculative), filled into
    a buffer of 0xAB bytes laid out for `room` rows (the batch's rows by default)."""
    batch = StepBatch(1, verify=speculative)
    slot = 10
    for w in works:
        slots = list(range(slot, slot + w.rows))
        batch.add(w, slots, [(slot + i) % 17 for i in range(w.rows)])  # each row's ring entries P
        slot += w.rows
    plan = make_layout(SHAPE, room or batch.num_rows, 1)
    buf = torch.full((plan.total,), 0xAB, dtype=torch.uint8)
    host_bytes = buf.numpy()
    views = {name: carve(buf, e) for name, e in plan.entries.items()}
    fill(batch, plan, memoryview(host_bytes), host_bytes, views)
    return batch, plan, host_bytes, views


def test_fill_places_small_big_and_f32_requests_row_by_row():
    big_rows = PARALLEL_COPY_BYTES // (SHAPE.num_v_heads * SHAPE.head_dim_v * 2) + 1  # its v takes the big path
    works = [_work(3, torch.bfloat16, 1), _work(big_rows, torch.bfloat16, 2), _work(2, torch.float32, 3)]
    assert len(works[1].bf16_bytes[2]) >= PARALLEL_COPY_BYTES
    batch, plan, host_bytes, views = _staged(works)

    for name in INPUTS:  # bit for bit: the bf16 bytes as they came, the f32 ones rounded to bf16
        want = torch.cat([getattr(w, name).to(torch.bfloat16) for w in works])
        assert torch.equal(views[name].view(torch.int16), want.view(torch.int16)), name
    assert views["slots"].tolist() == list(range(10, 10 + batch.num_rows))
    assert views["layers"].tolist() == [2] * 3 + [1] * big_rows + [2] * 2
    assert views["hist"].tolist() == batch.hist


def test_fill_pads_a_launch_with_rows_that_touch_no_state():
    """A padded launch (its plan has room for more rows than the batch has): the batch's rows
    first, then slot -1, layer 0, P 0; the padding rows' inputs are not written."""
    works = [_work(2, torch.bfloat16, 1), _work(1, torch.float16, 2)]
    batch, plan, _, views = _staged(works, room=8, speculative=True)
    assert views["slots"].tolist() == [10, 11, 12] + [-1] * 5
    assert views["layers"].tolist() == [2, 2, 1] + [0] * 5
    assert views["hist"].tolist() == [10, 11, 12] + [0] * 5
    for name in INPUTS:
        want = torch.cat([getattr(w, name).to(torch.bfloat16) for w in works])
        assert torch.equal(views[name][:3].view(torch.int16), want.view(torch.int16)), name
        assert torch.all(views[name][3:].view(torch.uint8) == 0xAB), name
    with pytest.raises(ValueError, match="does not fit"):
        _staged(works, room=2)


def test_launches_pad_to_the_next_graph_bucket():
    """The CUDA backend's padded launches (gdn_server.backends.cuda.padded_rows): small ones as
    they are (each has its own graph), bigger ones up to the largest bucket to the next bucket,
    bigger still as they are. Mapped launches are among the graphed ones."""
    from gdn_server.backends.cuda import GRAPH_BUCKETS, GRAPH_MAX_ROWS, MAPPED_MAX_ROWS, padded_rows

    assert 0 <= MAPPED_MAX_ROWS <= GRAPH_MAX_ROWS
    assert [padded_rows(r) for r in range(1, GRAPH_MAX_ROWS + 1)] == list(range(1, GRAPH_MAX_ROWS + 1))
    last = 0
    for rows in range(GRAPH_MAX_ROWS + 1, GRAPH_BUCKETS[-1] + 1):
        padded = padded_rows(rows)
        assert padded in GRAPH_BUCKETS and padded >= rows and padded >= last
        assert padded == min(b for b in GRAPH_BUCKETS if b >= rows)
        last = padded
    assert padded_rows(GRAPH_BUCKETS[-1] + 1) == GRAPH_BUCKETS[-1] + 1


def test_stage_inputs_copies_a_batch_and_hands_back_its_big_inputs():
    """_wire.stage_inputs, the bf16 requests' copy of `fill`: each input at its place's offset plus
    the request's first row times its bytes per row; inputs of `limit` bytes or more handed back
    as (start, input) for the caller's parallel copy; nothing copied where an input would end past
    the buffer."""
    from gdn_server import _wire

    places = [(0, 10), (100, 20), (300, 30), (500, 2), (600, 2)]
    first = (b"q" * 10, b"k" * 20, b"v" * 30, b"aa", b"bb")
    second = tuple(memoryview(x) for x in (b"Q" * 20, b"K" * 40, b"V" * 60, b"AAAA", b"BBBB"))
    dst = bytearray(b"." * 700)
    big = _wire.stage_inputs(dst, places, [(0, first), (1, second)], 50)
    assert [(start, bytes(data)) for start, data in big] == [(330, b"V" * 60)]
    want = bytearray(b"." * 700)
    for (offset, per_row), a, b in zip(places, first, second):
        want[offset : offset + len(a)] = a
        if len(b) < 50:
            want[offset + per_row : offset + per_row + len(b)] = b
    assert dst == want

    before = bytes(dst)
    for row in (-1, 50, 2**62):  # the first request fits, the second ends past the buffer
        with pytest.raises(ValueError, match="past the buffer"):
            _wire.stage_inputs(dst, places, [(0, first), (row, first)], 1 << 20)
        assert dst == before
    with pytest.raises(ValueError, match="five"):
        _wire.stage_inputs(dst, places[:4], [(0, first)], 1 << 20)
    with pytest.raises(ValueError, match="five"):
        _wire.stage_inputs(dst, places, [(0, first[:4])], 1 << 20)
    with pytest.raises(TypeError):
        _wire.stage_inputs(bytes(dst), places, [(0, first)], 1 << 20)  # not writable
