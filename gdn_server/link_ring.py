"""Shared-memory payload rings of one front-end link connection (`--frontends N`).

Without them, a request's inputs (~16 KiB a step for qwen3-next) and a reply's output (~8 KiB)
travel in the link's Unix socket frames: the sender's kernel copies them in, the receiver's
copies them out, and the receiver copies them once more out of its read buffer. On the H200 host,
at 64 clients behind eight workers, the engine's `sendmsg` of the replies and `recv` of the
requests took ~30% of its one thread, the bound there (bench/NOTES.md, fifteenth session). With
the rings each payload is written once into memory that both processes map, and the frames carry
only their headers and where the payload sits.

The worker makes the memory (a memfd, `make_shared`) and sends it with the connection's first
frame (link.HELLO); it is laid out as [request ring | reply ring]:

- `RequestRing` (the worker writes, the engine reads): the worker frees a request's bytes when
  its reply comes. Every request frame gets exactly one reply frame, a cancelled request too
  (engine_link), so nothing stays taken. Replies come in any order, so frees do; space is reused
  from the oldest end once everything before it is free.
- `ReplyRing` (the engine writes, the worker reads): the worker reads replies in the order they
  were written and copies each payload out at once, then says how far it has read with an ACK
  frame ahead of its next request. The ACK travels through the socket, whose system calls order
  the memory accesses on both sides: plain stores need no fences on any CPU. The native module
  writes payloads with streaming stores (which are not ordered so), and ends each copy with an
  sfence before the frame that points at it is written.

A side that finds its ring full, or a payload bigger than half of it, puts the payload in the
frame as without rings: a full ring slows the link and never stops it.
"""
from __future__ import annotations

import collections
import mmap
import os

from gdn_server.native import COPY_THREADS, THREADED_COPY_BYTES
from gdn_server.native import module as _native  # ring_write, where gdn_server._native is built

# A payload goes in a ring when it is at most half of it. qwen3-next's B=256 step has 4.03 MiB of
# inputs: over half of 8 MiB, so with an 8 MiB request ring it went through the socket in ~20
# reads, ~1.5 ms on the CPU box against one streaming copy (bench/NOTES.md, twenty-ninth session).
REQUEST_RING_BYTES = 12 << 20  # 768 steps of qwen3-next's 16 KiB inputs; a request of up to B=380
REPLY_RING_BYTES = 6 << 20  # 768 replies of 8 KiB; a reply of up to B=384 (2 MiB at B=256)


def make_shared(nbytes: int) -> tuple[int, mmap.mmap] | None:
    """(fd, mapping) of `nbytes` of memory another process can map through the fd, or None where
    the platform has no memfd (the link then runs without rings)."""
    if nbytes <= 0 or not hasattr(os, "memfd_create"):
        return None
    fd = os.memfd_create("gdn-link", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return fd, mmap.mmap(fd, nbytes)
    except OSError:
        os.close(fd)
        return None


def map_shared(fd: int, nbytes: int) -> mmap.mmap:
    """The engine's mapping of the worker's memory (the fd it received; closed here)."""
    try:
        if os.fstat(fd).st_size < nbytes:
            raise ValueError(f"link memory has {os.fstat(fd).st_size} bytes, the hello says {nbytes}")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def as_bytes(data):
    """`data` as a flat run of bytes: a memoryview of another format (len counts its items) cast."""
    return data.cast("B") if isinstance(data, memoryview) and (data.format != "B" or data.ndim != 1) else data


def _place(head: int, nbytes: int, capacity: int) -> int:
    """Where a payload of `nbytes` written at monotonic offset `head` starts: at `head`, or at
    the ring's next lap when it would run past the end (payloads are never split)."""
    pos = head % capacity
    return head if pos + nbytes <= capacity else head + capacity - pos


class RequestRing:
    """The worker's request ring: payloads written by tag, freed by tag in any order."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.capacity = len(view)
        self._head = 0  # monotonic: bytes ever taken, padding included
        self._tail = 0  # monotonic: everything before it is free
        self._spans: collections.deque[list] = collections.deque()  # [end, freed] oldest first
        self._span_of: dict[int, list] = {}  # tag -> its span

    def put(self, tag: int, parts: list) -> int | None:
        """Writes `parts` back to back for request `tag`; their monotonic offset, or None when
        they do not fit now (the caller sends them in the frame)."""
        parts = [as_bytes(p) for p in parts]
        nbytes = sum(len(p) for p in parts)
        if nbytes == 0 or nbytes > self.capacity // 2 or tag in self._span_of:
            return None
        start = _place(self._head, nbytes, self.capacity)
        if start + nbytes - self._tail > self.capacity:
            return None
        if start != self._head:  # the lap's unused end: free as soon as what is before it is
            self._spans.append([start, True])
        pos = start % self.capacity
        if _native is not None:  # streaming stores: the engine, on another core, reads them next
            # a big request's megabytes on several threads: one thread's copy was ~450 us of a
            # B=256 step's ~6.3 ms on the H200 host (bench/NOTES.md, twenty-ninth session)
            _native.ring_write(self.view, pos, parts, COPY_THREADS if nbytes >= THREADED_COPY_BYTES else 1)
        else:
            view = self.view
            for p in parts:
                end = pos + len(p)
                view[pos:end] = p
                pos = end
        self._head = start + nbytes
        span = [self._head, False]
        self._spans.append(span)
        self._span_of[tag] = span
        return start

    def free(self, tag: int) -> None:
        """Request `tag` is answered: the engine reads its bytes no more."""
        span = self._span_of.pop(tag, None)
        if span is None:
            return
        span[1] = True
        spans = self._spans
        while spans and spans[0][1]:
            self._tail = spans.popleft()[0]

    @property
    def taken(self) -> int:
        """Bytes not yet reusable (tests, metrics)."""
        return self._head - self._tail


class ReplyRing:
    """The engine's reply ring: payloads written in frame order, freed as the worker acks."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.capacity = len(view)
        self._head = 0  # monotonic: bytes ever written, padding included
        self._acked = 0  # monotonic: the worker has copied out everything before it

    def put(self, payload) -> int | None:
        """Copies `payload` in; its monotonic offset, or None when it does not fit now."""
        payload = as_bytes(payload)
        nbytes = len(payload)
        if nbytes == 0 or nbytes > self.capacity // 2:
            return None
        start = _place(self._head, nbytes, self.capacity)
        if start + nbytes - self._acked > self.capacity:
            return None
        pos = start % self.capacity
        self.view[pos : pos + nbytes] = payload
        self._head = start + nbytes
        return start

    def ack(self, read_to: int) -> None:
        """The worker has copied out every payload before monotonic offset `read_to`."""
        if self._acked < read_to <= self._head:
            self._acked = read_to


def payload_at(capacity: int, offset: int, nbytes: int) -> int:
    """Where in a ring of `capacity` bytes the payload at monotonic `offset` starts; ValueError
    if it does not lie inside the ring (payloads are never split)."""
    pos = offset % capacity
    if offset < 0 or pos + nbytes > capacity:
        raise ValueError(f"link ring payload of {nbytes} bytes at {offset} runs past the ring's {capacity}")
    return pos


def read_payload(view: memoryview, offset: int, nbytes: int) -> bytes:
    """A copy of the payload at monotonic `offset` of a ring."""
    return bytes(payload_view(view, offset, nbytes))


def payload_view(view: memoryview, offset: int, nbytes: int) -> memoryview:
    """The payload at monotonic `offset` of a ring, in place: valid until the ring reuses it."""
    pos = payload_at(len(view), offset, nbytes)
    return view[pos : pos + nbytes]
