"""The front-end link's frames (gdn_server.link): round trips and framing over a real socket pair."""
from __future__ import annotations

import functools
import socket
import threading

import grpc
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gdn_server import link
from gdn_server.config import ModelShape
from gdn_server.errors import FailedPrecondition, GdnError
from gdn_server.link import (
    KIND_CANCEL, KIND_DECODE, LENGTH, decode_cancel, decode_reply, decode_request, encode_ack, encode_cancel,
    encode_reply, FrameBuffer, encode_request, send_frames,
)
from gdn_server.link_ring import ReplyRing, RequestRing
from gdn_server.native import module as native_module
from gdn_server.work import DecodeResult, DecodeWork

native_only = pytest.mark.skipif(native_module is None, reason="gdn_server._native is not built here")
SHAPE = ModelShape(num_layers=5, num_q_heads=2, num_v_heads=4, head_dim_k=16, head_dim_v=16)


def _work(B: int, T: int, dtype: torch.dtype, positions, speculative: bool, owner, seed: int = 0,
          checked: bool = True) -> DecodeWork:
    """`checked` False: bf16 inputs left unchecked for NaN/Inf, as a worker leaves big ones."""
    g = torch.Generator().manual_seed(seed)
    H, HV, K, V = SHAPE.num_q_heads, SHAPE.num_v_heads, SHAPE.head_dim_k, SHAPE.head_dim_v
    shapes = {"q": (B, T, H, K), "k": (B, T, H, K), "v": (B, T, HV, V), "a": (B, T, HV), "b": (B, T, HV)}
    tensors = {n: torch.randn(*s, generator=g).to(dtype) for n, s in shapes.items()}
    raw = None
    if dtype == torch.bfloat16:
        raw = tuple(tensors[n].view(torch.int16).numpy().tobytes() for n in shapes)
    return DecodeWork(layer=3, session_ids=tuple(f"s{i}-é" for i in range(B)), positions=positions,
                      request_id="req-1", owner=owner, speculative=speculative, bf16_bytes=raw,
                      finite_checked=checked or raw is None, **tensors)


def _frame(parts: list[bytes]) -> bytes:
    data = b"".join(bytes(p) for p in parts)
    (size,) = LENGTH.unpack_from(data, 0)
    assert size == len(data) - LENGTH.size
    return data[LENGTH.size:]


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 5), T=st.integers(1, 8), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       with_positions=st.booleans(), speculative=st.booleans(), owner=st.sampled_from([None, "alice", "ünï"]),
       tag=st.integers(0, 2**64 - 1), checked=st.booleans())
def test_request_round_trip(B, T, dtype, with_positions, speculative, owner, tag, checked):
    positions = tuple(range(2**64 - B, 2**64)) if with_positions else None  # the largest uint64 positions
    work = _work(B, T, dtype, positions, speculative, owner, checked=checked)
    frame = _frame(encode_request(tag, work))
    assert frame[0] == KIND_DECODE
    assert bool(frame[9] & link.FLAG_UNCHECKED) == (not work.finite_checked)
    got_tag, got = decode_request(frame, SHAPE)
    assert got_tag == tag
    assert (got.layer, got.session_ids, got.positions, got.request_id, got.owner, got.speculative,
            got.finite_checked) == (work.layer, work.session_ids, work.positions, work.request_id, work.owner,
                                    work.speculative, checked or dtype != torch.bfloat16)
    for name in ("q", "k", "v", "a", "b"):
        sent, received = getattr(work, name), getattr(got, name)
        assert received.shape == sent.shape
        # bf16 goes as is; f16/f32 as float32, which holds them exactly
        assert torch.equal(received.float(), sent.float())
    assert (got.bf16_bytes is not None) == (dtype == torch.bfloat16)
    assert got.tokens == T and got.rows == B


def test_bf16_requests_stay_bytes_until_read():
    """The engine builds no tensor for a bf16 request unless something reads one; what it builds
    then is the tensor that was sent, and a StepBatch hands backends the same."""
    from gdn_server.work import StepBatch

    work = _work(3, 2, torch.bfloat16, (1, 2, 3), True, None)
    _, got = decode_request(_frame(encode_request(5, work)), SHAPE)
    assert not any(name in got.__dict__ for name in ("q", "k", "v", "a", "b"))
    assert [bytes(r) for r in got.bf16_bytes] == list(work.bf16_bytes)
    batch = StepBatch(2)
    batch.add(got, [0, 1, 2])
    assert "q" not in got.__dict__ and batch.works[0].bf16_bytes is got.bf16_bytes
    assert torch.equal(batch.inputs("v")[0], work.v) and got.v is batch.inputs("v")[0]  # built once, then cached
    for name in ("q", "k", "a", "b"):
        assert torch.equal(getattr(got, name), getattr(work, name))


def test_reply_round_trip_ok_and_error():
    out = torch.randn(2, 3, SHAPE.num_v_heads, SHAPE.head_dim_v).to(torch.bfloat16)
    result = DecodeResult(out.view(torch.int16).numpy().tobytes(), tuple(out.shape), (7, 2**64 - 1))
    tag, got, read_to = decode_reply(_frame(encode_reply(42, result)), SHAPE)
    assert tag == 42 and got.out == result.out and got.shape == result.shape and got.positions == result.positions
    assert read_to is None  # not from a ring

    tag, err, _ = decode_reply(_frame(encode_reply(9, FailedPrecondition("position 3 ≠ 4"))), SHAPE)
    assert tag == 9 and isinstance(err, GdnError)
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and err.message == "position 3 ≠ 4"
    _, err, _ = decode_reply(_frame(encode_reply(1, RuntimeError("boom"))), SHAPE)  # not a GdnError: INTERNAL
    assert err.code == grpc.StatusCode.INTERNAL and "boom" in err.message


def test_cancel_frame():
    frame = _frame([encode_cancel(2**63 + 5)])
    assert frame[0] == KIND_CANCEL and decode_cancel(frame) == 2**63 + 5


def test_bad_frames_are_refused():
    frame = _frame(encode_request(1, _work(2, 1, torch.bfloat16, None, False, None)))
    with pytest.raises(ValueError, match="too short"):
        decode_request(frame[:-1], SHAPE)
    f32 = bytearray(_frame(encode_request(1, _work(2, 1, torch.float32, None, False, None))))
    f32[9] |= link.FLAG_UNCHECKED  # only bf16 inputs are ever left unchecked
    with pytest.raises(ValueError, match="float32 inputs marked unchecked"):
        decode_request(bytes(f32), SHAPE)
    with pytest.raises(ValueError, match="past its tensors"):
        decode_request(frame + b"\0", SHAPE)


@pytest.mark.timeout(60)
def test_frames_over_a_socket_pair():
    """Bursts of small frames, frames split across reads, and frames larger than the read buffer
    all come out whole and in order."""
    left, right = socket.socketpair()
    sizes = [1, 7, 100, 5000, 70000, 3, 300000, 64, 65536 + 4, 1]
    frames = [bytes([i % 251]) * n for i, n in enumerate(sizes)] * 3

    def writer():
        for f in frames:
            send_frames(left, [LENGTH.pack(len(f)), f])
        left.close()

    t = threading.Thread(target=writer)
    t.start()
    buffer = FrameBuffer(buffer_bytes=1 << 17)  # smaller than the largest frame
    got = []
    while buffer.fill(right):
        got += [bytes(f) for f in buffer.frames()]
    t.join(30)
    right.close()
    assert got == frames


def _python_decode(frame: bytes, ring: memoryview | None = None) -> tuple:
    """link.decode_request's Python (the reference), as (tag, the work's fields) or the error's type."""
    native, link._native = link._native, None
    try:
        tag, work = decode_request(frame, SHAPE, ring)
    except Exception as e:  # noqa: BLE001 - the kind of refusal is what is compared
        return ("refused", type(e))
    finally:
        link._native = native
    return tag, _fields(work)


def _fields(work: DecodeWork) -> dict:
    fields = dict(work.__dict__)
    if work.bf16_bytes is not None:
        fields["bf16_bytes"] = tuple(bytes(b) for b in work.bf16_bytes)
    for name in ("q", "k", "v", "a", "b"):  # float32 frames: tensors, compared by value
        if name in fields:
            fields[name] = fields[name].numpy().tobytes()
    return fields


@native_only
@settings(max_examples=300, deadline=None)
@given(B=st.integers(1, 4), T=st.integers(1, 3), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       with_positions=st.booleans(), speculative=st.booleans(), owner=st.sampled_from([None, "alice", "ünï"]),
       tag=st.integers(0, 2**64 - 1), damage=st.sampled_from(["none", "truncate", "extend", "flip", "offset"]),
       where=st.integers(0, 10**6), byte=st.integers(0, 255), in_ring=st.booleans(), lead=st.integers(0, 40000),
       checked=st.booleans())
@example(B=2, T=1, dtype=torch.bfloat16, with_positions=True, speculative=False, owner=None, tag=0, damage="flip",
         where=678, byte=2, in_ring=True, lead=0, checked=True)  # the flip makes T 3: another valid frame (2026-12-01)
def test_native_decode_agrees_with_python(B, T, dtype, with_positions, speculative, owner, tag, damage, where, byte,
                                          in_ring, lead, checked):
    """The engine's C decode of a request frame (gdn_server/_native_link.c) gives the DecodeWork
    the Python decode gives, field for field, or leaves the frame to the Python (None): always for
    float32 inputs, and for frames cut short, run long or with a byte changed anywhere (ids that
    are no longer UTF-8, lengths that no longer add up, a ring offset outside the ring). It never
    accepts a frame the Python refuses. Frames with their inputs in a request ring too, placed
    after `lead` bytes of others (so some wrap to the ring's start)."""
    positions = tuple(range(2**64 - B, 2**64)) if with_positions else None
    ring = view = None
    if in_ring:
        view = memoryview(bytearray(1 << 16))
        ring = RequestRing(view)
        if lead:
            ring.put(-1, [b"\xee" * min(lead, len(view) // 2)])
            ring.free(-1)
    frame = _frame(encode_request(tag, _work(B, T, dtype, positions, speculative, owner, checked=checked), ring))
    assert bool(frame[9] & link.FLAG_IN_RING) == (in_ring and dtype == torch.bfloat16 and not speculative)
    if damage == "truncate":
        frame = frame[: where % len(frame)]
    elif damage == "extend":
        frame = frame + bytes([byte])
    elif damage == "flip":
        i = where % min(len(frame), 80)  # the header, ids and strings: where the lengths are
        frame = frame[:i] + bytes([frame[i] ^ (byte or 1)]) + frame[i + 1:]
    elif damage == "offset":  # the frame's last 8 bytes: a ring offset, or the tail of b
        frame = frame[:-8] + link.RING_OFFSET.pack(where * 7919)
    ring_view = view.toreadonly() if view is not None else None
    native = native_module.decode_link_request(frame, DecodeWork, link.native_heads(SHAPE), ring_view)
    expected = _python_decode(frame, ring_view)
    if native is None:
        assert damage != "none" or dtype != torch.bfloat16, "a valid bf16 frame must take the native path"
        return
    assert expected[0] != "refused", f"native accepted a frame the Python refuses ({expected[1]})"
    got_tag, work = native
    assert (got_tag, _fields(work)) == expected
    assert type(work) is DecodeWork
    # FLAG_UNCHECKED carried, or a flip of that bit read as the Python reads it (compared above)
    assert work.finite_checked == (checked or dtype != torch.bfloat16) or damage != "none"
    # a changed byte may make another valid frame (T 1 -> 3 with the inputs in the ring, whose
    # bytes the frame's length does not bound): then both decodes agree on it, as checked above
    assert work.tokens == T or damage != "none"
    assert all(isinstance(b, memoryview) and b.readonly for b in work.bf16_bytes)  # views of the frame or ring


@native_only
def test_native_decode_builds_tensors_on_read():
    """The C-built DecodeWork behaves as DecodeWork.of_bf16's: its tensors come from the bytes."""
    work = _work(2, 3, torch.bfloat16, (4, 5), False, "bob")
    tag, got = native_module.decode_link_request(_frame(encode_request(11, work)), DecodeWork, link.native_heads(SHAPE))
    assert tag == 11 and got.rows == 2 and got.owner == "bob" and got.positions == (4, 5)
    for name in ("q", "k", "v", "a", "b"):
        assert torch.equal(getattr(got, name), getattr(work, name))


class _RecordingReplies:
    """What EngineLink's reading calls on a connection's ReplyBox, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def expect(self, tag: int) -> None:
        self.calls.append(("expect", tag))

    def answer(self, tag: int, result: object) -> None:
        self.calls.append(("answer", tag, result))

    def dropped(self, tag: int) -> bool:
        self.calls.append(("dropped", tag))
        return False


@native_only
@settings(max_examples=60, deadline=None)
@given(kinds=st.lists(st.sampled_from(["ring", "ring", "ring", "frame", "f32", "speculative", "ack", "cancel", "flip"]),
                      min_size=1, max_size=12),
       cut=st.integers(0, 200), seed=st.integers(0, 1000))
def test_native_take_reads_plain_requests_as_the_python_would(kinds, cut, seed):
    """gdn_server._native.take_link_requests, as EngineLink reads a connection: the C takes the
    runs of in-ring requests at the front of the read buffer in place, and leaves every other
    frame (acks, cancels, inputs in the frame, float32, speculative steps, a damaged frame, one not
    all there yet) to next_frame and the Python, in order. Each request it takes is the Python's
    decode, with replies.expect(tag) called and (work, answer, dropped) bound to its tag."""
    view = memoryview(bytearray(1 << 16))
    ring = RequestRing(view)
    ring_view = view.toreadonly()
    wire = b""
    for i, kind in enumerate(kinds):
        tag = 1000 + i
        if kind == "ack":
            wire += encode_ack(i * 64)
        elif kind == "cancel":
            wire += encode_cancel(tag - 1)
        else:
            dtype = torch.float32 if kind == "f32" else torch.bfloat16
            B = 1 + (seed + i) % 3
            positions = tuple(range(seed, seed + B)) if i % 2 else None
            work = _work(B, 1, dtype, positions, kind == "speculative", "alice" if i % 3 else None, seed=seed + i)
            frame = _frame(encode_request(tag, work, ring if kind in ("ring", "flip") else None))
            if kind == "flip":  # the session id's length: no longer adds up
                frame = frame[:23] + bytes([frame[23] ^ 0x40]) + frame[24:]
            wire += LENGTH.pack(len(frame)) + frame
    wire = wire[: len(wire) - cut] if cut < len(wire) else wire  # the last frame may be cut short

    def read(native: bool) -> tuple[list, list, list]:
        """Frames in order, as ("taken", tag, fields) or ("left", frame); and the replies' calls."""
        left, right = socket.socketpair()
        try:
            left.sendall(wire)
            buffer = FrameBuffer(buffer_bytes=1 << 20)
            assert buffer.fill(right)
        finally:
            left.close()
            right.close()
        replies, out, seen = _RecordingReplies(), [], []
        heads = link.native_heads(SHAPE)

        def take(buf: bytearray, start: int, end: int) -> int:
            before = len(out)
            stop = native_module.take_link_requests(buf, start, end, DecodeWork, heads, ring_view, replies,
                                                    functools.partial, out)
            for work, done, dropped in out[before:]:
                assert done.func == replies.answer and dropped.func == replies.dropped
                seen.append(("taken", done.args[0], _fields(work)))
            return stop

        while True:
            if native:
                buffer.take_leading(take)
            frame = buffer.next_frame()
            if frame is None:
                break
            seen.append(("left", bytes(frame)))
        return seen, replies.calls, out

    python_frames, python_calls, _ = read(native=False)
    native_frames, native_calls, requests = read(native=True)
    # the same frames in the same order; each the C took is a plain in-ring request, decoded as the Python does
    flattened = []
    for entry in native_frames:
        if entry[0] == "taken":
            tag, fields = entry[1], entry[2]
            assert fields["bf16_bytes"] is not None and not fields["speculative"]
            frame = next(f for (_, f) in python_frames if f[:9] == bytes([KIND_DECODE]) + tag.to_bytes(8, "little"))
            assert frame[9] & link.FLAG_IN_RING and _python_decode(frame, ring_view) == (tag, fields)
            flattened.append(("left", frame))
        else:
            flattened.append(entry)
    assert flattened == python_frames
    taken = [e[1] for e in native_frames if e[0] == "taken"]
    assert native_calls == [("expect", t) for t in taken] and python_calls == []
    assert len(requests) == len(taken)
    if kinds[0] == "ring" and cut == 0:  # a whole, valid in-ring request at the front is always the C's
        assert native_frames[0][0] == "taken"
