"""The front-end link's shared-memory rings (gdn_server.link_ring) and the frames that use them:
payloads that stay intact until freed, frees in any order, a full ring falling back to frames,
memory shared between processes through a real socket, and a cancelled request still answered."""
from __future__ import annotations

import dataclasses
import os
import random
import socket
import struct
import subprocess
import sys

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_server import engine_link, link
from gdn_server.config import PRESETS, ModelShape
from gdn_server.engine_link import EngineLink, PyReplyBox
from gdn_server.errors import GdnError
from gdn_server.link import (
    FLAG_IN_RING, FrameBuffer, LENGTH, STATUS_IN_RING, decode_ack, decode_hello, decode_reply, decode_request, encode_ack,
    encode_hello, encode_reply, encode_request,
)
from gdn_server.link_ring import (
    REPLY_RING_BYTES, REQUEST_RING_BYTES, ReplyRing, RequestRing, _place, make_shared, map_shared,
)
from gdn_server.native import module as native_module
from gdn_server.placement import Placement, Shard
from gdn_server.sessions import SessionTable
from gdn_server.work import DecodeResult, DecodeWork

SHAPE = ModelShape(num_layers=5, num_q_heads=2, num_v_heads=4, head_dim_k=16, head_dim_v=16)
FLAGS_AT = 9  # link.REQUEST: kind u8 | tag u64 | flags u8


def _work(B: int, T: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> DecodeWork:
    g = torch.Generator().manual_seed(seed)
    H, HV, K, V = SHAPE.num_q_heads, SHAPE.num_v_heads, SHAPE.head_dim_k, SHAPE.head_dim_v
    shapes = {"q": (B, T, H, K), "k": (B, T, H, K), "v": (B, T, HV, V), "a": (B, T, HV), "b": (B, T, HV)}
    tensors = {n: torch.randn(*s, generator=g).to(dtype) for n, s in shapes.items()}
    raw = tuple(tensors[n].view(torch.int16).numpy().tobytes() for n in shapes) if dtype == torch.bfloat16 else None
    return DecodeWork(layer=2, session_ids=tuple(f"s{i}" for i in range(B)), positions=tuple(range(B)),
                      request_id=f"r{seed}", owner="alice", speculative=False, bf16_bytes=raw, **tensors)


def _frame(parts: list) -> bytes:
    data = b"".join(bytes(p) for p in parts)
    assert LENGTH.unpack_from(data)[0] == len(data) - LENGTH.size
    return data[LENGTH.size:]


def _same_inputs(got: DecodeWork, sent: DecodeWork) -> bool:
    return all(torch.equal(getattr(got, n), getattr(sent, n)) for n in ("q", "k", "v", "a", "b"))


def test_a_request_in_the_ring_decodes_as_one_in_its_frame():
    memory = memoryview(bytearray(1 << 16))
    ring = RequestRing(memory)
    work = _work(3, 2, seed=1)
    in_ring = _frame(encode_request(7, work, ring))
    inline = _frame(encode_request(7, work))
    assert in_ring[FLAGS_AT] & FLAG_IN_RING and not inline[FLAGS_AT] & FLAG_IN_RING
    assert len(in_ring) == len(inline) - sum(len(b) for b in work.bf16_bytes) + 8  # inputs out, an offset in
    for native in (link._native, None):  # the C decode and the Python reference
        saved, link._native = link._native, native
        try:
            tag, got = decode_request(in_ring, SHAPE, memory.toreadonly())
        finally:
            link._native = saved
        assert tag == 7 and _same_inputs(got, work) and got.session_ids == work.session_ids
        assert all(b.obj is memory.obj for b in got.bf16_bytes)  # views of the ring: no copy

    with pytest.raises(ValueError, match="ring"):
        decode_request(in_ring, SHAPE)  # a ring frame on a link without one
    f32 = _work(1, 1, seed=2, dtype=torch.float32)
    assert not _frame(encode_request(8, f32, ring))[FLAGS_AT] & FLAG_IN_RING  # float32 inputs stay in frames
    speculative = dataclasses.replace(_work(1, 2, seed=3), speculative=True)
    # an accept replays a speculative step's inputs after its reply has freed them: they stay in frames
    assert not _frame(encode_request(9, speculative, ring))[FLAGS_AT] & FLAG_IN_RING
    forged = bytearray(in_ring)
    forged[FLAGS_AT] |= link.FLAG_SPECULATIVE
    for native in (link._native, None):
        saved, link._native = link._native, native
        try:
            with pytest.raises(ValueError, match="speculative"):
                decode_request(bytes(forged), SHAPE, memory.toreadonly())
        finally:
            link._native = saved


def test_the_rings_take_a_b256_step_of_qwen3_next():
    """The issue's big request (B=256 sessions, T=1, qwen3-next's heads: 4.03 MiB of inputs, a
    2 MiB reply) goes through the rings, not the socket, with as much already taken as a steady
    stream of small steps leaves (the rings' room for one payload is half of each)."""
    shape = PRESETS["qwen3-next"]
    H, HV, K, V = shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v
    inputs = 2 * sum(link.input_sizes(shape, 256, 1))  # bf16 bytes
    assert inputs == 256 * 2 * (2 * H * K + HV * V + 2 * HV)
    assert inputs <= REQUEST_RING_BYTES // 2 and 256 * HV * V * 2 <= REPLY_RING_BYTES // 2
    requests = RequestRing(memoryview(bytearray(REQUEST_RING_BYTES)))
    small = 2 * sum(link.input_sizes(shape, 1, 1))
    for tag in range(100):  # the stream of one-row steps before: taken and freed, so the ring has wrapped
        assert requests.put(tag, [b"\x01" * small]) is not None
        requests.free(tag)
    assert requests.put(1000, [b"\x02" * inputs]) is not None
    replies = ReplyRing(memoryview(bytearray(REPLY_RING_BYTES)))
    assert replies.put(b"\x03" * (256 * HV * V * 2)) is not None


def test_the_request_ring_frees_in_any_order_and_keeps_what_is_taken():
    """Random puts and frees: every payload still taken reads back as written, space comes back
    only once everything older is free, and a put is refused only when it cannot fit."""
    capacity = 4096
    memory = memoryview(bytearray(capacity))
    ring = RequestRing(memory)
    rnd = random.Random(5)
    live: dict[int, tuple[int, bytes]] = {}
    refused = 0
    for tag in range(3000):
        if live and rnd.random() < 0.45:
            gone = rnd.choice(list(live))
            ring.free(gone)
            del live[gone]
        payload = bytes([tag % 256]) * rnd.randint(1, 900)
        offset = ring.put(tag, [payload[:10], payload[10:]])
        if offset is None:  # only when it cannot fit whole before the oldest taken byte
            refused += 1
            assert _place(ring._head, len(payload), capacity) + len(payload) - ring._tail > capacity
            continue
        pos = offset % capacity
        assert pos + len(payload) <= capacity  # never split across the end
        live[tag] = (pos, payload)
        for pos, data in live.values():
            assert bytes(memory[pos:pos + len(data)]) == data
        assert ring.taken <= capacity
    assert refused > 0  # the test did fill the ring
    for tag in list(live):
        ring.free(tag)
    assert ring.taken == 0
    assert ring.put(1, [b"x" * (capacity // 2)]) is not None  # all of it usable again
    assert ring.put(2, [b"x" * (capacity // 2 + 1)]) is None  # over half: always in the frame


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=60), ack_every=st.integers(1, 8))
def test_reply_ring_round_trip_with_acks_and_fallback(sizes, ack_every):
    """Replies through the reply ring in frame order: each reads back whole; without acks the
    ring fills and replies fall back to their frames; acks make room again."""
    capacity = 8192
    memory = memoryview(bytearray(capacity))
    ring = ReplyRing(memory)
    read_to = 0
    for i, n in enumerate(sizes):
        rows = max(1, n // (SHAPE.num_v_heads * SHAPE.head_dim_v * 2))
        out = bytes([i % 256]) * (rows * SHAPE.num_v_heads * SHAPE.head_dim_v * 2)
        result = DecodeResult(out, (rows, 1, SHAPE.num_v_heads, SHAPE.head_dim_v), tuple(range(rows)))
        frame = _frame(encode_reply(i, result, ring))
        tag, got, got_read_to = decode_reply(frame, SHAPE, memory)
        assert tag == i and got.out == out and got.positions == result.positions
        assert (frame[8] == STATUS_IN_RING) == (got_read_to is not None)
        if len(out) > capacity // 2:
            assert got_read_to is None
        if got_read_to is not None:
            read_to = got_read_to
        if i % ack_every == 0:
            ring.ack(decode_ack(_frame([encode_ack(read_to)])))
    errors = _frame(encode_reply(99, RuntimeError("boom"), ring))  # errors never use the ring
    assert decode_reply(errors, SHAPE, memory)[2] is None


@pytest.mark.skipif(native_module is None, reason="gdn_server._native is not built")
@settings(max_examples=60, deadline=None)
@given(at=st.integers(0, 200), sizes=st.lists(st.integers(0, 12000), min_size=1, max_size=4), seed=st.integers(0, 255),
       threads=st.sampled_from([1, 2, 3, 8]), even=st.booleans())
def test_the_native_ring_write_copies_as_slice_assignment(at, sizes, seed, threads, even):
    """ring_write (streaming stores from 1 KiB, at any alignment, split over threads where every
    part is of even length) writes what slice assignment writes, and nothing around it; parts past
    the ring's end are refused."""
    if even:  # bf16 inputs: the threaded split applies
        sizes = [n - n % 2 for n in sizes]
    parts = [bytes((seed + i + j) % 251 for j in range(n)) for i, n in enumerate(sizes)]
    total = sum(sizes)
    ring = bytearray(b"\xee" * (at + total + 70))
    expected = bytearray(ring)
    expected[at : at + total] = b"".join(parts)
    assert native_module.ring_write(ring, at, [memoryview(p) for p in parts], threads) == total
    assert ring == expected
    with pytest.raises(ValueError, match="past the ring"):
        native_module.ring_write(ring, len(ring) - 1, [b"ab"], threads)


_box_op = st.one_of(
    st.tuples(st.just("expect"), st.integers(0, 9)),
    st.tuples(st.just("cancel"), st.integers(0, 9)),
    st.tuples(st.just("dropped"), st.integers(0, 9)),
    # (tag, rows): a result of `rows` rows (0: an error; -1: a memoryview of bf16 items, 3 rows)
    st.tuples(st.just("answer"), st.tuples(st.integers(0, 9), st.sampled_from((0, 1, 1, 2, 5, 40, -1)))),
    st.tuples(st.just("ack"), st.just(0)),
    st.tuples(st.just("take"), st.just(0)),
    st.tuples(st.just("close"), st.just(0)),
)


@pytest.mark.skipif(native_module is None, reason="gdn_server._native is not built")
@settings(max_examples=80, deadline=None)
@given(ops=st.lists(_box_op, max_size=60), ring_bytes=st.sampled_from((0, 4096, 1 << 16)))
def test_the_native_reply_box_writes_the_bytes_of_the_python_one(ops, ring_bytes):
    """gdn_server._native.ReplyBox against its reference, engine_link.PyReplyBox, through the
    same calls: the same frames taken, the same ring contents, the same connections marked dirty,
    the same requests outstanding, with and without a ring (and with one that fills up)."""
    row_bytes = SHAPE.num_v_heads * SHAPE.head_dim_v * 2
    boxes, rings, dirties = [], [], []
    for make in (lambda r, d: PyReplyBox(r, d, "conn", engine_link._CANCELLED),
                 lambda r, d: native_module.ReplyBox(r, d, "conn", DecodeResult, encode_reply, engine_link._CANCELLED)):
        ring = memoryview(bytearray(ring_bytes)) if ring_bytes else None
        dirty: set = set()
        boxes.append(make(ring, dirty))
        rings.append(ring)
        dirties.append(dirty)
    taken = [[], []]
    read_to = 0  # the worker's ack: how far the frames taken so far have been read
    for k, (op, arg) in enumerate(ops):
        outcomes = []
        for box, frames in zip(boxes, taken):
            if op == "answer":
                tag, rows = arg
                if rows == 0:
                    result = GdnError(f"no {k}", grpc.StatusCode.NOT_FOUND)
                elif rows < 0:
                    result = DecodeResult(memoryview(bytes([k % 256]) * 3 * row_bytes).cast("H"),
                                          (3, 1, SHAPE.num_v_heads, SHAPE.head_dim_v), (k, k + 1, k + 2))
                else:
                    result = DecodeResult(bytes([k % 256]) * rows * row_bytes,
                                          (rows, 1, SHAPE.num_v_heads, SHAPE.head_dim_v), tuple(range(k, k + rows)))
                outcomes.append(box.answer(tag, result))
            elif op == "ack":
                outcomes.append(box.ack(read_to))
            elif op == "take":
                frames.extend(bytes(p) for p in box.take())
            elif op in ("expect", "cancel", "dropped"):
                outcomes.append(getattr(box, op)(arg))
            else:
                box.close()
        assert outcomes[0] == outcomes[1] if outcomes else True
        assert b"".join(taken[0]) == b"".join(taken[1])
        assert sorted(boxes[0].unanswered()) == sorted(boxes[1].unanswered())
        assert dirties[0] == dirties[1] and boxes[0].open == boxes[1].open
        if op == "take" and rings[0] is not None:  # the worker reads what was taken, then may ack it
            incoming = FrameBuffer()
            data = b"".join(taken[0])
            incoming._buf[: len(data)] = data
            incoming._end = len(data)
            for frame in incoming.frames():
                _, _, at = decode_reply(bytes(frame), SHAPE, rings[0])
                read_to = at if at is not None else read_to
    if rings[0] is not None:
        assert bytes(rings[0]) == bytes(rings[1])


def test_hello_frames():
    assert decode_hello(encode_hello(8 << 20, 4 << 20)) == (8 << 20, 4 << 20)
    with pytest.raises(ValueError, match="hello"):
        decode_hello(encode_ack(5))
    with pytest.raises(ValueError, match="hello"):
        decode_hello(b"")


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd on this platform")
@pytest.mark.timeout(60)
def test_the_rings_memory_is_shared_through_the_socket():
    """The worker's memfd, sent with its hello as SCM_RIGHTS and mapped by the engine: writes on
    either side are seen on the other, in another process too."""
    fd, memory = make_shared(1 << 16)
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        socket.send_fds(left, [encode_hello(1 << 15, 1 << 15)], [fd])
        os.close(fd)
        hello, fds, _, _ = socket.recv_fds(right, LENGTH.size + link.HELLO.size, 1)
        request_bytes, reply_bytes = decode_hello(hello)
        other = os.dup(fds[0])
        engine_view = memoryview(map_shared(fds[0], request_bytes + reply_bytes))
        memory[:5] = b"hello"
        assert bytes(engine_view[:5]) == b"hello"
        try:  # another process maps the received fd and writes through its own mapping
            subprocess.run([sys.executable, "-c", f"import mmap; m = mmap.mmap({other}, {1 << 16}); m[100:105] = b'child'"],
                           pass_fds=(other,), check=True, timeout=30)
        finally:
            os.close(other)
        assert memory[100:105] == b"child" and bytes(engine_view[100:105]) == b"child"
        del engine_view


class _Scheduler:
    """What EngineLink asks of a scheduler: requests queued, answered by the test."""

    def __init__(self) -> None:
        self.after_answers: list = []
        self.queued: list = []

    def submit_decodes(self, requests) -> None:
        self.queued.extend(requests)


def _Placement() -> Placement:
    """The link's placement: one real Shard (the engine's dataclass) whose scheduler is the test's."""
    return Placement([Shard(0, None, SessionTable(4, SHAPE.num_layers), _Scheduler())])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rings", [True, False], ids=["rings", "no-rings"])
def test_the_engine_reads_rings_answers_through_them_and_answers_a_cancelled_request(rings):
    """EngineLink end to end over a socket pair: the hello with the rings' memory, a request
    read from the request ring, its reply's output written to the reply ring, an ack, and a
    request cancelled before it ran answered CANCELLED (what frees its bytes in the ring). The
    same with a hello without rings (a platform without memfd): every payload in its frame."""
    placement = _Placement()
    engine = EngineLink("/nonexistent/never-bound.sock", SHAPE, placement)
    scheduler = placement.shards[0].scheduler
    worker_sock, engine_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = engine._adopt(engine_sock)
    request_ring = reply_view = None
    if rings:
        shared = make_shared(1 << 17)
        if shared is None:
            pytest.skip("no memfd on this platform")
        fd, memory = shared
        view = memoryview(memory)
        request_ring, reply_view = RequestRing(view[: 1 << 16]), view[1 << 16:]
    with worker_sock, engine_sock:
        if rings:
            socket.send_fds(worker_sock, [encode_hello(1 << 16, 1 << 16)], [fd])
            os.close(fd)
        else:
            worker_sock.sendall(encode_hello(0, 0))
        engine._on_readable(conn)  # the hello
        assert conn.greeted and (conn.request_ring is not None) == rings

        works = [_work(2, 1, seed=s) for s in range(2)]
        frames = []
        for tag, work in enumerate(works):
            frames += encode_request(tag, work, request_ring)
        frames.append(link.encode_cancel(1))
        worker_sock.sendall(b"".join(bytes(p) for p in frames))
        engine._on_readable(conn)
        assert len(scheduler.queued) == 2
        (work0, done0, cancelled0), (work1, done1, cancelled1) = scheduler.queued
        assert _same_inputs(work0, works[0])
        assert not cancelled0() and cancelled1()  # request 1 was cancelled before it ran

        out = bytes(range(256))  # [2, 1, 4, 16] bf16
        done0(DecodeResult(out, (2, 1, SHAPE.num_v_heads, SHAPE.head_dim_v), (1, 1)))
        engine.flush()
        worker_sock.settimeout(10)
        incoming, replies = FrameBuffer(), []
        while len(replies) < 2:  # the worker's own reading of the link's frames
            assert incoming.fill(worker_sock)
            replies += [bytes(f) for f in incoming.frames()]
        tag, result, read_to = decode_reply(replies[0], SHAPE, reply_view)  # the cancel's reply came first
        assert tag == 1 and result.code == grpc.StatusCode.CANCELLED and read_to is None
        tag, result, read_to = decode_reply(replies[1], SHAPE, reply_view)
        assert tag == 0 and result.out == out and read_to == (len(out) if rings else None)
        if rings:
            request_ring.free(0)
            request_ring.free(1)
            assert request_ring.taken == 0
            worker_sock.sendall(encode_ack(read_to))
            engine._on_readable(conn)
            assert conn.open
        del work0, work1  # their inputs are views of the ring's memory, which close() unmaps
        scheduler.queued.clear()
        engine.close()


@pytest.mark.timeout(30)
def test_a_request_frame_that_does_not_decode_is_answered_with_an_error_and_the_link_stays_open():
    """A frame whose inputs are said to be in a ring the link has not (a broken worker) fails
    that request alone: its reply says so, and the next request on the link is queued."""
    placement = _Placement()
    engine = EngineLink("/nonexistent/never-bound.sock", SHAPE, placement)
    scheduler = placement.shards[0].scheduler
    worker_sock, engine_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = engine._adopt(engine_sock)
    elsewhere = RequestRing(memoryview(bytearray(1 << 16)))  # a ring the engine never saw
    with worker_sock, engine_sock:
        worker_sock.sendall(encode_hello(0, 0))
        engine._on_readable(conn)
        frames = encode_request(7, _work(1, 1, seed=0), elsewhere) + encode_request(8, _work(1, 1, seed=1))
        worker_sock.sendall(b"".join(bytes(p) for p in frames))
        engine._on_readable(conn)
        assert conn.open and conn.replies.unanswered() == [8] and len(scheduler.queued) == 1
        worker_sock.settimeout(10)
        incoming = FrameBuffer()
        assert incoming.fill(worker_sock)
        (reply,) = [bytes(f) for f in incoming.frames()]
        tag, result, _ = decode_reply(reply, SHAPE)
        assert tag == 7 and result.code == grpc.StatusCode.INTERNAL and "malformed request" in str(result)
        scheduler.queued.clear()
    engine.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("first", ["request", "rings-without-fd", "nothing"])
def test_a_link_that_does_not_open_with_a_valid_hello_is_dropped(first):
    engine = EngineLink("/nonexistent/never-bound.sock", SHAPE, _Placement())
    worker_sock, engine_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = engine._adopt(engine_sock)
    with worker_sock:
        if first == "request":
            worker_sock.sendall(b"".join(bytes(p) for p in encode_request(0, _work(1, 1, seed=0))))
        elif first == "rings-without-fd":
            worker_sock.sendall(encode_hello(1 << 16, 1 << 16))
        else:
            worker_sock.shutdown(socket.SHUT_WR)  # the worker died before its hello
        engine._on_readable(conn)
    assert not conn.greeted and not conn.open and conn not in engine._connections
    engine.close()


@pytest.mark.skipif(link.native.module is None, reason="gdn_server._native is not built here")
@pytest.mark.timeout(60)
def test_the_link_sender_writes_each_connection_in_order_and_survives_a_gone_peer():
    """gdn_server._native.LinkSender, the engine's reply writer: every connection's bytes arrive
    whole and in the order queued; a peer gone makes its writes fail, never hang; a closed
    sender refuses more."""
    sender = link.native.module.LinkSender()
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
    expected = [bytearray() for _ in pairs]
    try:
        for turn in range(60):  # unread small writes fill a socket buffer quickly: few of them
            batch = []
            for i, (ours, _) in enumerate(pairs):
                parts = [struct.pack("<I", turn), bytes([i]) * (turn % 50), memoryview(b"end")]
                batch.append((ours.fileno(), parts))
                expected[i] += b"".join(bytes(p) for p in parts)
            sender.send(batch)
        sender.wait_idle()
        for (_, theirs), want in zip(pairs, expected):
            theirs.settimeout(10)
            got = bytearray()
            while len(got) < len(want):
                got += theirs.recv(1 << 16)
            assert got == want
        pairs[0][1].close()  # that worker is gone
        sender.send([(pairs[0][0].fileno(), [b"x" * 100000]), (pairs[1][0].fileno(), [b"still"])])
        sender.wait_idle()
        assert pairs[1][1].recv(16) == b"still"
        with pytest.raises(TypeError):
            sender.send([(pairs[1][0].fileno(), "not bytes")])
        sender.close()
        with pytest.raises(RuntimeError, match="closed"):
            sender.send([(pairs[1][0].fileno(), [b"late"])])
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


def test_rings_take_memoryviews_of_any_format_by_their_bytes():
    """A payload handed over as a memoryview of 2-byte items (as a tensor's buffer would be)
    goes in by its bytes, not its item count."""
    halves = memoryview(torch.arange(64, dtype=torch.int16).numpy().tobytes()).cast("h")
    assert len(halves) == 64 and halves.nbytes == 128
    reply_memory = memoryview(bytearray(1024))
    offset = ReplyRing(reply_memory).put(halves)
    assert bytes(reply_memory[offset:offset + 128]) == halves.tobytes()
    request_memory = memoryview(bytearray(1024))
    ring = RequestRing(request_memory)
    offset = ring.put(0, [halves, b"xy"])
    assert bytes(request_memory[offset:offset + 130]) == halves.tobytes() + b"xy" and ring.taken == 130
