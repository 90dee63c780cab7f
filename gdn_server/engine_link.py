"""The engine's end of the front-end link (`--frontends N`): decode requests in, replies out.

Each front-end worker connects once to a Unix socket. The engine's Python threads share one GIL,
so the link is built to take as little of it as possible and to add no Python thread:

- the engine's event loop reads every connection (`loop.add_reader`): whatever frames are there
  with one system call, decoded (in C) and queued to the scheduler of their sessions' device;
  on an engine of one device, runs of plain requests are decoded in place in the read buffer,
  with no Python step per frame (gdn_server._native.take_link_requests), and plain one-row
  steps become C records that go through the scheduler, staging and the reply ring with no
  Python object per request but their session records (gdn_server/_native_lane.c, the lane);
  bf16 inputs stay bytes all the way into the backend's staging buffer (no tensors). With the
  CUDA backend the scheduler's rounds run on that same loop, so a request goes from the socket
  to its launch on one thread. A reader thread of its own (the design before) made every call of
  the loop thread that lets the GIL go (a graph launch, an event, a send) a chance for the reader
  to take it, and getting it back could cost up to the switch interval: on the H200, with eight
  workers at 64 clients, the engine's main thread spent ~11% of its samples in
  `CUDAGraph.replay`, ~120 us a launch; reading on the loop took that to ~4% and the engine
  from 13.8k to 15.2k steps/s on average (bench/NOTES.md, twelfth session);
- replies are buffered per connection and written once per scheduler round, all of a round's
  replies to a worker in one `sendmsg`, and those calls made by the native module's sender
  thread without the GIL (each wakes a worker on another core, dear on a VM): the loop's thread
  hands the round's frames over once;
- the payloads (a request's inputs, a reply's output) go through shared-memory rings the worker
  sets up with its first frame (gdn_server.link_ring), so the socket carries only headers: the
  requests' inputs are read from the ring straight into the staging buffer, and the outputs are
  copied into the ring once.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from functools import partial
from typing import Callable

import grpc

from gdn_server import native
from gdn_server.config import ModelShape
from gdn_server.errors import GdnError
from gdn_server.link import (
    HELLO, KIND_ACK, KIND_CANCEL, LENGTH, FrameBuffer, decode_ack, decode_cancel, decode_hello, decode_request,
    encode_reply, native_heads, request_tag, send_frames,
)
from gdn_server.link_ring import ReplyRing, map_shared
from gdn_server.placement import Placement
from gdn_server.work import DecodeResult, DecodeWork

log = logging.getLogger(__name__)

SOCKET_BUFFER_BYTES = 4 << 20  # a burst of replies fits without blocking the scheduler thread
_CANCELLED = GdnError("the caller gave up before the request reached the device", grpc.StatusCode.CANCELLED)


class PyReplyBox:
    """One connection's replies not yet written, and its requests not yet answered: the
    reference for gdn_server._native.ReplyBox, which the link uses where the native module is
    built (same methods, same bytes; tests/test_link_ring.py runs both side by side).

    Answers come from every device's scheduler thread: `answer` encodes a reply (its output into
    the reply ring, in the order the frames are taken) and adds `key` to `dirty`, the set of
    connections with frames waiting; `take` hands those frames to whoever writes them."""

    def __init__(self, ring: memoryview | None, dirty: set, key: object, cancelled_error: GdnError) -> None:
        self._ring = ReplyRing(ring) if ring is not None else None
        self._dirty = dirty
        self._key = key
        self._cancelled_error = cancelled_error
        # tag -> cancelled, for every request queued and not yet answered; plain dict operations
        # (atomic under the GIL) from the loop's reader and the scheduler threads
        self._outstanding: dict[int, bool] = {}
        self._outbox: list = []
        self._lock = threading.Lock()  # the reply ring is filled in the order the frames are taken
        self.open = True

    def expect(self, tag: int) -> None:
        self._outstanding[tag] = False

    def cancel(self, tag: int) -> None:
        if tag in self._outstanding:
            self._outstanding[tag] = True

    def dropped(self, tag: int) -> bool:
        """The scheduler's `cancelled` check: True (once) when the caller gave up. A dropped
        request is still answered (CANCELLED): its reply is what frees its inputs' bytes in the
        worker's request ring."""
        if self._outstanding.get(tag):
            self.answer(tag, self._cancelled_error)
            return True
        return False

    def answer(self, tag: int, result: DecodeResult | BaseException) -> None:
        self._outstanding.pop(tag, None)
        if not self.open:
            return
        with self._lock:
            self._outbox.extend(encode_reply(tag, result, self._ring))
        self._dirty.add(self._key)

    def ack(self, read_to: int) -> None:
        if self._ring is not None:
            self._ring.ack(read_to)

    def take(self) -> list:
        """The frames waiting (none once closed)."""
        with self._lock:
            parts, self._outbox = self._outbox, []
        return parts if self.open else []

    def close(self) -> None:
        with self._lock:
            self.open = False

    def unanswered(self) -> list[int]:
        return list(self._outstanding)


def make_reply_box(ring: memoryview | None, dirty: set, key: object) -> "PyReplyBox":
    """The native ReplyBox where gdn_server._native is built, else the Python one."""
    if native.module is not None:
        return native.module.ReplyBox(ring, dirty, key, DecodeResult, encode_reply, _CANCELLED)
    return PyReplyBox(ring, dirty, key, _CANCELLED)


class _Connection:
    def __init__(self, sock: socket.socket, dirty: set) -> None:
        self.sock = sock
        self.frames = FrameBuffer()
        self.open = True
        self.greeted = False  # the worker's hello (and its rings) read
        self.request_ring: memoryview | None = None
        self.replies = make_reply_box(None, dirty, self)  # until the hello brings a reply ring

    def close(self) -> None:
        self.open = False
        self.replies.close()

    def flush(self) -> None:
        """Writes the buffered replies on this thread (where gdn_server._native is not built)."""
        parts = self.replies.take()
        if not parts or not self.open:
            return
        try:
            send_frames(self.sock, parts)
        except OSError as e:  # the worker went away; reading its connection drops it
            self.open = False
            log.debug("replies to a closed front-end link dropped: %s", e)


class EngineLink:
    """Serves the decode requests of front-end workers from this process's schedulers."""

    def __init__(self, path: str, shape: ModelShape, placement: Placement) -> None:
        self.path = path
        self.shape = shape
        self.placement = placement
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connections: set[_Connection] = set()
        self._dirty: set[_Connection] = set()  # connections with replies waiting in their outbox
        self._only_shard = placement.shards[0] if len(placement.shards) == 1 else None
        self._take_native = getattr(native.module, "take_link_requests", None)
        # plain one-row steps as C records (gdn_server/_native_lane.c) where the one device's
        # scheduler takes them; GDN_LINK_LANE=0 queues them as DecodeWorks (A/Bs, and a way back)
        self._lane = (self._only_shard is not None and getattr(self._only_shard.scheduler, "lane_type", None) is not None
                      and os.environ.get("GDN_LINK_LANE", "1") != "0")
        self._heads = native_heads(shape)
        # the replies' sendmsg calls on a thread of their own, without the GIL (one hand-off a
        # round instead of a system call per worker), where gdn_server._native is built
        self._sender = native.module.LinkSender() if native.module is not None else None
        self._send_lock = threading.Lock()  # no socket is closed while its frames are being queued
        for shard in placement:
            shard.scheduler.after_answers.append(self.flush)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Listens, and reads the workers' connections on `loop` (call it on the loop's thread)."""
        self._listener.bind(self.path)
        os.chmod(self.path, 0o600)  # the workers run as this user; nobody else may hand us work
        self._listener.listen(64)
        self._loop = loop
        # sockets stay blocking: a readable one gives one recv without waiting, and replies are
        # written whole (a worker slow to read holds its sender, as a full pipe would)
        loop.add_reader(self._listener.fileno(), self._accept)

    def close(self) -> None:
        """Stops reading and closes every connection (workers see the engine gone). On the
        loop's thread."""
        if self._sender is not None:
            self._sender.wait_idle()  # the last replies reach their workers before the sockets close
        for conn in list(self._connections):
            self._drop(conn)
        if self._sender is not None:
            self._sender.close()
        if self._loop is not None:
            self._loop.remove_reader(self._listener.fileno())
        _shutdown(self._listener)
        self._listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def flush(self) -> None:
        """Writes every buffered reply (a scheduler thread calls this after each round): hands
        them to the sender thread, or writes them here without one."""
        if self._sender is None:
            for conn in self._take_dirty():
                conn.flush()
            return
        with self._send_lock:
            batch = [(conn.sock.fileno(), parts)
                     for conn in self._take_dirty() if conn.open and (parts := conn.replies.take())]
            if batch:
                self._sender.send(batch)

    def _take_dirty(self):
        """The connections with replies waiting, each taken off the set as it is yielded."""
        while self._dirty:
            try:
                yield self._dirty.pop()  # atomic: a reply added meanwhile re-marks its connection
            except KeyError:
                return

    # -- reading, on the event loop ------------------------------------------------------------
    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        self._adopt(sock)

    def _adopt(self, sock: socket.socket) -> _Connection:
        """A worker's connected socket joins the link: read on the loop once `start` has run
        (bench/engine_path.py and the tests drive the reads themselves)."""
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        conn = _Connection(sock, self._dirty)
        self._connections.add(conn)
        if self._loop is not None:
            self._loop.add_reader(sock.fileno(), self._on_readable, conn)
        return conn

    def _on_readable(self, conn: _Connection) -> None:
        if not conn.greeted:
            self._greet(conn)
            return
        self._read_from(conn)
        self.flush()  # requests answered right away (unknown session, queue full)

    def _greet(self, conn: _Connection) -> None:
        """Reads the worker's hello frame (always its first, sent with one system call) and maps
        its rings. A worker that sends anything else is dropped."""
        try:
            hello, fds, _, _ = socket.recv_fds(conn.sock, LENGTH.size + HELLO.size, 1)
        except OSError as e:
            log.warning("front-end link closed before its hello: %s", e)
            self._drop(conn)
            return
        try:
            request_bytes, reply_bytes = decode_hello(hello)
            if request_bytes or reply_bytes:
                if len(fds) != 1:
                    raise ValueError(f"a hello with rings needs their memory's fd; got {len(fds)} fds")
                memory = memoryview(map_shared(fds.pop(), request_bytes + reply_bytes))
                self._use_rings(conn, memory[:request_bytes] if request_bytes else None,
                                memory[request_bytes:] if reply_bytes else None)
        except (ValueError, OSError) as e:
            log.warning("front-end link without a valid hello (%s); closing it", e)
            self._drop(conn)
            return
        finally:
            for fd in fds:
                os.close(fd)
        conn.greeted = True

    def _use_rings(self, conn: _Connection, request_ring: memoryview | None, reply_ring: memoryview | None) -> None:
        """The connection's payloads go through these rings from now on (the hello's memory)."""
        if request_ring is not None:  # the engine only reads it (and the backend's fill from it)
            conn.request_ring = request_ring.toreadonly()
        if reply_ring is not None:
            conn.replies = make_reply_box(reply_ring, self._dirty, conn)

    def _read_from(self, conn: _Connection) -> None:
        queued: dict = {}  # scheduler -> the (work, done, cancelled) of this read's requests, in order
        try:
            alive = conn.frames.fill(conn.sock)  # readable: does not block
            # runs of plain requests in C where it applies, straight from the read buffer; every
            # other frame (acks, cancels, and what the C leaves to the Python) through _take, in order
            take = self._native_take(conn, queued)
            frames = conn.frames
            while True:
                if take is not None:
                    frames.take_leading(take)
                frame = frames.next_frame()
                if frame is None:
                    break
                self._take(conn, frame, queued)
        except OSError as e:
            alive = False
            if conn.open:
                log.warning("front-end link closed: %s", e)
        except Exception:  # a frame we cannot read: the worker is broken; drop its connection
            log.exception("bad frame from a front-end worker; closing its link")
            alive = False
        for scheduler, requests in queued.items():  # those decoded before a bad frame still run
            if requests:
                scheduler.submit_decodes(requests)
        if not alive:
            self._drop(conn)

    def _native_take(self, conn: _Connection, queued: dict) -> Callable[[bytearray, int, int], int] | None:
        """The C reading of a connection's plain requests (gdn_server._native.take_link_requests),
        appending to this read's requests for the one device, or None where it does not apply:
        no native module, several devices (each request is placed by its sessions here), or a
        worker without rings (its inputs ride in the frames)."""
        take = self._take_native
        if take is None or self._only_shard is None or conn.request_ring is None:
            return None
        requests = queued.setdefault(self._only_shard.scheduler, [])
        heads, ring, replies, lane = self._heads, conn.request_ring, conn.replies, self._lane
        return lambda buf, start, end: take(buf, start, end, DecodeWork, heads, ring, replies, partial, requests, lane)

    def _drop(self, conn: _Connection) -> None:
        conn.close()
        if conn not in self._connections:
            return
        self._connections.discard(conn)
        if self._loop is not None:
            self._loop.remove_reader(conn.sock.fileno())
        _shutdown(conn.sock)  # a write the sender thread is blocked in fails now
        with self._send_lock:  # a scheduler thread may be handing over its replies
            if self._sender is not None:
                self._sender.wait_idle()  # no queued frame outlives its fd (whose number is reused)
            conn.sock.close()

    def _take(self, conn: _Connection, frame: bytes | bytearray, queued: dict) -> None:
        """One frame of a read: an ack or a cancel is applied, a request decoded and added to
        `queued` (scheduler -> requests) for its device's scheduler, or answered at once when it
        cannot run."""
        kind = frame[0]
        replies = conn.replies
        if kind == KIND_ACK:
            replies.ack(decode_ack(frame))
            return
        if kind == KIND_CANCEL:
            replies.cancel(decode_cancel(frame))
            return
        # the whole frame is decoded here, on the loop's thread that read it (in C where
        # gdn_server._native is built), so the scheduler's admission takes every request in one
        # C pass; deferring the decode to the round (the design when the link had a reader
        # thread of its own) cost a trip back to Python per request there
        try:
            tag, work = decode_request(frame, self.shape, conn.request_ring)
        except Exception as e:  # a frame that does not decode: fail this request only
            tag = request_tag(frame)  # a frame too short for its header: the worker is broken (dropped)
            log.exception("could not decode a request from a front-end worker")
            replies.answer(tag, GdnError(f"malformed request: {e}"))
            return
        if self._only_shard is not None:
            # an engine process of one device: no look-up here; the scheduler's admission answers
            # an unknown session with the same NOT_FOUND the look-up would have
            shard = self._only_shard
        else:
            try:
                shard = self.placement.shard_for(work.session_ids)
            except GdnError as e:
                replies.answer(tag, e)
                return
        replies.expect(tag)
        requests = queued.get(shard.scheduler)
        if requests is None:
            requests = queued[shard.scheduler] = []
        requests.append((work, partial(replies.answer, tag), partial(replies.dropped, tag)))


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
