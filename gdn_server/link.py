"""The frame format between front-end worker processes and engine processes (`--frontends N`).

A front-end worker serves gRPC, parses and validates each DecodeRequest, and hands it to the
engine of its sessions (the process that owns that device's state pool) as one request frame on
a Unix socket; the engine answers with one reply frame. Both sides are processes of one server,
started by it, on a socket in a directory only its user can open: the link is trusted, so frames carry already validated
requests and the caller's authenticated identity.

Every frame is a little-endian u32 byte count, then the frame:

hello    KIND_HELLO u8 | request ring bytes u64 | reply ring bytes u64: the worker's first frame,
         with the fd of their shared memory (gdn_server.link_ring) as SCM_RIGHTS when either is
         not 0; both 0: no rings, every payload goes in its frame
request  KIND_DECODE u8 | tag u64 | flags u8 | layer u32 | B u32 | T u8 | len(request_id) u16
         | len(identity) u16 | B x len(session_id) u16 | B x position u64 (when FLAG_POSITIONS)
         | session ids utf-8 | request_id utf-8 | identity utf-8
         | q | k | v | a | b (row-major, bf16, or f32 with FLAG_F32)
           or, with FLAG_IN_RING, ring offset u64: q | k | v | a | b (bf16) sit at that monotonic
           offset of the request ring instead (never for a speculative step: its inputs are kept
           past the reply); FLAG_UNCHECKED: bf16 inputs the worker did not check for NaN/Inf
           (big ones: the engine's staging copy checks them as it copies)
cancel   KIND_CANCEL u8 | tag u64: the caller of request `tag` gave up (deadline, disconnect); if
         it has not reached the device yet it never will, and its reply says CANCELLED
ack      KIND_ACK u8 | offset u64: the worker has copied out every reply payload before this
         monotonic offset of the reply ring
reply    tag u64 | status u8 (0 OK, STATUS_IN_RING OK with o in the reply ring, else a grpc status
         code) | B u32 | T u8 | len(message) u32 | B x position u64 | message utf-8
         | o (bf16 [B, T, HV, V]; when 0) or its reply ring offset u64 (when STATUS_IN_RING)

The tag is the worker's: the engine echoes it, and replies may come in any order. Every request
frame gets exactly one reply frame (what frees its bytes in the request ring).
"""
from __future__ import annotations

import socket
import struct
from typing import Callable, Iterator

import grpc

from gdn_server import native
from gdn_server.config import ModelShape
from gdn_server.errors import STATUS_CODES, GdnError
from gdn_server.link_ring import ReplyRing, RequestRing, as_bytes, payload_at, payload_view, read_payload
from gdn_server.work import DecodeResult, DecodeWork

LENGTH = struct.Struct("<I")
REQUEST = struct.Struct("<BQBIIBHH")
CANCEL = struct.Struct("<BQ")
REPLY = struct.Struct("<QBIBI")
HELLO = struct.Struct("<BQQ")
ACK = struct.Struct("<BQ")
RING_OFFSET = struct.Struct("<Q")
KIND_DECODE = 1
KIND_CANCEL = 2
KIND_HELLO = 3
KIND_ACK = 4
STATUS_IN_RING = 255  # a reply status: OK, and the output sits in the reply ring

FLAG_SPECULATIVE = 1
FLAG_POSITIONS = 2
FLAG_F32 = 4  # inputs as float32 (requests that did not come all-bf16); else bfloat16
FLAG_IN_RING = 8  # bf16 inputs in the request ring, at the offset that ends the frame
FLAG_UNCHECKED = 16  # bf16 inputs not yet checked for NaN/Inf (DecodeWork.finite_checked False)

_native = native.module  # decode_link_request, where gdn_server._native is built (tests set it to None)
_INPUTS = ("q", "k", "v", "a", "b")


def input_sizes(shape: ModelShape, rows: int, tokens: int) -> tuple[int, int, int, int, int]:
    """Elements of q, k, v, a, b in a request of `rows` sessions and `tokens` tokens."""
    H, HV, K, V = shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v
    n = rows * tokens
    return n * H * K, n * H * K, n * HV * V, n * HV, n * HV


def input_shapes(shape: ModelShape, rows: int, tokens: int) -> tuple[tuple[int, ...], ...]:
    H, HV, K, V = shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v
    return (rows, tokens, H, K), (rows, tokens, H, K), (rows, tokens, HV, V), (rows, tokens, HV), (rows, tokens, HV)


def encode_request(tag: int, work: DecodeWork, ring: RequestRing | None = None) -> list[bytes]:
    """The request frame of a validated DecodeWork, as buffers to write back to back (no join).

    `work.owner` is the caller's identity. Inputs go as the request's own bf16 bytes when it
    sent all five as bf16, else as float32 (exact for bf16/f16/f32 inputs). bf16 inputs go into
    `ring` instead of the frame where it has room (they are then the ring's until the reply),
    except a speculative step's: the engine keeps those inputs past the reply (an accept replays
    them), so they stay in the frame."""
    B, T = work.rows, work.tokens
    ids = [sid.encode() for sid in work.session_ids]
    request_id = work.request_id.encode()
    identity = (work.owner or "").encode()
    flags = FLAG_SPECULATIVE if work.speculative else 0
    if work.positions is not None:
        flags |= FLAG_POSITIONS
    if work.bf16_bytes is not None:
        if not work.finite_checked:
            flags |= FLAG_UNCHECKED
        tensors: list = list(work.bf16_bytes)
        offset = ring.put(tag, tensors) if ring is not None and not work.speculative else None
        if offset is not None:
            flags |= FLAG_IN_RING
            tensors = [RING_OFFSET.pack(offset)]
    else:
        flags |= FLAG_F32
        if work.f32_bytes is not None:  # a worker's validation widened them (no torch there)
            tensors = list(work.f32_bytes)
        else:
            import torch  # the tensors' own: torch is loaded where they were made

            tensors = [t.to(torch.float32).contiguous().numpy().tobytes() for t in (work.q, work.k, work.v, work.a, work.b)]
    head = [REQUEST.pack(KIND_DECODE, tag, flags, work.layer, B, T, len(request_id), len(identity)),
            struct.pack(f"<{B}H", *(len(i) for i in ids))]
    if work.positions is not None:
        head.append(struct.pack(f"<{B}Q", *work.positions))
    head.extend(ids)
    head.append(request_id)
    head.append(identity)
    head_bytes = b"".join(head)
    size = len(head_bytes) + sum(len(t) for t in tensors)
    return [LENGTH.pack(size) + head_bytes, *tensors]


def encode_hello(request_ring_bytes: int, reply_ring_bytes: int) -> bytes:
    return LENGTH.pack(HELLO.size) + HELLO.pack(KIND_HELLO, request_ring_bytes, reply_ring_bytes)


def decode_hello(frame: bytes) -> tuple[int, int]:
    """A hello frame (with its length prefix, as the engine reads it first) -> ring sizes."""
    if len(frame) != LENGTH.size + HELLO.size or LENGTH.unpack_from(frame)[0] != HELLO.size:
        raise ValueError(f"a front-end link must open with a hello frame; got {len(frame)} bytes")
    kind, request_bytes, reply_bytes = HELLO.unpack_from(frame, LENGTH.size)
    if kind != KIND_HELLO:
        raise ValueError(f"a front-end link must open with a hello frame; got kind {kind}")
    return request_bytes, reply_bytes


def encode_ack(read_to: int) -> bytes:
    return LENGTH.pack(ACK.size) + ACK.pack(KIND_ACK, read_to)


def decode_ack(frame: bytes | bytearray) -> int:
    """An ack frame -> the reply ring offset the worker has read to."""
    return ACK.unpack_from(frame, 0)[1]


def encode_cancel(tag: int) -> bytes:
    return LENGTH.pack(CANCEL.size) + CANCEL.pack(KIND_CANCEL, tag)


def decode_cancel(frame: bytes | bytearray) -> int:
    """A cancel frame -> the tag of the request it cancels."""
    return CANCEL.unpack_from(frame, 0)[1]


def request_tag(frame: bytes | bytearray) -> int:
    """The tag of a request frame, from its fixed header alone (struct.error when it is shorter)."""
    return REQUEST.unpack_from(frame, 0)[1]


def _counts(kind: str, n: int) -> struct.Struct:
    """The Struct of n little-endian `kind` values (cached: building formats per frame costs)."""
    key = (kind, n)
    st = _COUNTS.get(key)
    if st is None:
        st = _COUNTS[key] = struct.Struct(f"<{n}{kind}")
    return st


_COUNTS: dict[tuple[str, int], struct.Struct] = {}


def _layout(shape: ModelShape, rows: int, tokens: int, itemsize: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(bytes of q, k, v, a, b; their shapes) in a request frame of `rows` x `tokens` (cached)."""
    # keyed by id: hashing the dataclass costs more than the lookup; the entry keeps `shape` alive,
    # so its id cannot be reused by another object while cached
    key = (id(shape), rows, tokens, itemsize)
    entry = _LAYOUTS.get(key)
    if entry is None:
        if len(_LAYOUTS) > 4096:  # (B, T) are bounded in practice; keep it so if they are not
            _LAYOUTS.clear()
        sizes = tuple(n * itemsize for n in input_sizes(shape, rows, tokens))
        entry = _LAYOUTS[key] = (shape, sizes, input_shapes(shape, rows, tokens))
    return entry[1], entry[2]


_LAYOUTS: dict[tuple[int, int, int, int], tuple[ModelShape, tuple[int, ...], tuple[tuple[int, ...], ...]]] = {}


def decode_request(frame: bytes | bytearray, shape: ModelShape, ring: memoryview | None = None) -> tuple[int, DecodeWork]:
    """A request frame (without its length prefix) -> (tag, the DecodeWork it carries).

    bf16 inputs stay bytes: `bf16_bytes` are read-only slices of `frame` (or, with FLAG_IN_RING,
    of `ring`, the connection's request ring: valid until the reply), and the tensors are built
    from them only if something reads `work.q` etc. (a GPU backend copies the bytes and never
    does). float32 inputs become tensors (views of `frame`) at once. Nothing is validated again
    (the worker did). The common frame is decoded in C where gdn_server._native is built; this
    Python is the reference, and decodes the rest."""
    if _native is not None:
        decoded = _native.decode_link_request(frame, DecodeWork, native_heads(shape), ring)
        if decoded is not None:
            return decoded
    _, tag, flags, layer, B, T, rid_len, ident_len = REQUEST.unpack_from(frame, 0)
    offset = REQUEST.size
    id_lens = _counts("H", B).unpack_from(frame, offset)
    offset += 2 * B
    positions = None
    if flags & FLAG_POSITIONS:
        positions = _counts("Q", B).unpack_from(frame, offset)
        offset += 8 * B
    view = memoryview(frame)
    session_ids = []
    for n in id_lens:
        session_ids.append(str(view[offset : offset + n], "utf-8"))
        offset += n
    request_id = str(view[offset : offset + rid_len], "utf-8")
    offset += rid_len
    identity = str(view[offset : offset + ident_len], "utf-8") if ident_len else None
    offset += ident_len
    f32 = flags & FLAG_F32
    if f32 and flags & FLAG_UNCHECKED:
        raise ValueError("link frame has float32 inputs marked unchecked (only bf16 ones may be)")
    sizes, dims = _layout(shape, B, T, 4 if f32 else 2)
    if flags & FLAG_IN_RING:
        if f32 or ring is None or flags & FLAG_SPECULATIVE:
            why = "as float32" if f32 else "this link has not" if ring is None else "for a speculative step"
            raise ValueError(f"link frame has its inputs in a ring {why}")
        if len(frame) - offset != RING_OFFSET.size:
            raise ValueError(f"link frame has {len(frame) - offset} bytes where its ring offset's 8 go")
        (at,) = RING_OFFSET.unpack_from(frame, offset)
        view, offset = ring, payload_at(len(ring), at, sum(sizes))
    raw = []
    for nbytes in sizes:
        raw.append(view[offset : offset + nbytes])
        offset += nbytes
    if view is not ring and offset != len(frame):
        _check_length(frame, offset - sum(sizes), sizes)
    speculative = bool(flags & FLAG_SPECULATIVE)
    if not f32:  # the common case: the fast constructor (a frozen dataclass's __init__ is ~5 us more)
        return tag, DecodeWork.of_bf16(layer, tuple(session_ids), positions, request_id, speculative, tuple(raw),
                                       dims, not flags & FLAG_UNCHECKED, owner=identity)
    import torch  # the engine's side: its backends have loaded it

    tensors = {name: torch.frombuffer(data, dtype=torch.float32).view(d) for name, data, d in zip(_INPUTS, raw, dims)}
    return tag, DecodeWork(layer=layer, session_ids=tuple(session_ids), positions=positions, request_id=request_id,
                           owner=identity, speculative=speculative, **tensors)


def native_heads(shape: ModelShape) -> tuple[int, int, int, int]:
    """(H, HV, K, V) of `shape`, as the native decode takes them (cached, as _layout)."""
    heads = _HEADS.get(id(shape))
    if heads is None or heads[0] is not shape:
        heads = _HEADS[id(shape)] = (shape, (shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v))
    return heads[1]


_HEADS: dict[int, tuple[ModelShape, tuple[int, int, int, int]]] = {}


def _check_length(frame: bytes | bytearray, offset: int, sizes: tuple[int, ...]) -> None:
    """Raises ValueError saying what is wrong with a frame whose inputs do not end at its end."""
    for name, nbytes in zip(_INPUTS, sizes):
        have = max(0, min(nbytes, len(frame) - offset))
        if have != nbytes:
            raise ValueError(f"link frame too short for {name}: {have} of {nbytes} bytes")
        offset += nbytes
    raise ValueError(f"link frame has {len(frame) - offset} bytes past its tensors")


def encode_reply(tag: int, result: DecodeResult | BaseException, ring: ReplyRing | None = None) -> list[bytes]:
    """The reply frame to request `tag`: a DecodeResult, or the error that ended it. The output
    goes into `ring` instead of the frame where it has room (the caller writes the frames in the
    order it encoded them: the worker reads the ring in that order)."""
    if isinstance(result, DecodeResult):
        B, T = result.shape[0], result.shape[1]
        out = as_bytes(result.out)  # its length in bytes, whatever a memoryview's format
        offset = ring.put(out) if ring is not None else None
        if offset is not None:
            head = _reply_head(B).pack(REPLY.size + 8 * B + RING_OFFSET.size, tag, STATUS_IN_RING, B, T, 0,
                                       *result.positions)
            return [head, RING_OFFSET.pack(offset)]
        # length prefix, REPLY and the positions in one pack
        head = _reply_head(B).pack(REPLY.size + 8 * B + len(out), tag, 0, B, T, 0, *result.positions)
        return [head, out]
    code = result.code if isinstance(result, GdnError) else grpc.StatusCode.INTERNAL
    message = (str(result) or type(result).__name__).encode()
    head = REPLY.pack(tag, code.value[0], 0, 0, len(message))
    return [LENGTH.pack(len(head) + len(message)) + head + message]


def _reply_head(rows: int) -> struct.Struct:
    st = _REPLY_HEADS.get(rows)
    if st is None:
        st = _REPLY_HEADS[rows] = struct.Struct(f"<I{REPLY.format[1:]}{rows}Q")
    return st


_REPLY_HEADS: dict[int, struct.Struct] = {}


def decode_reply(
    frame: bytes, shape: ModelShape, ring: memoryview | None = None, copy: bool = True
) -> tuple[int, DecodeResult | GdnError, int | None]:
    """A reply frame (without its length prefix) -> (tag, result or error, and where the reply
    ring has been read to when its output came from `ring`, else None).

    With `copy` False the output is a view, of the frame or of the ring: one in the ring must be
    copied before the ring is acked past it (the worker encodes its reply from it at once)."""
    tag, status, B, T, msg_len = REPLY.unpack_from(frame, 0)
    offset = REPLY.size
    positions = struct.unpack_from(f"<{B}Q", frame, offset)
    offset += 8 * B
    out_shape = (B, T, shape.num_v_heads, shape.head_dim_v)
    if status == STATUS_IN_RING:
        if ring is None:
            raise ValueError("link reply has its output in a ring this link has not")
        (at,) = RING_OFFSET.unpack_from(frame, offset)
        nbytes = B * T * shape.num_v_heads * shape.head_dim_v * 2
        out = read_payload(ring, at, nbytes) if copy else payload_view(ring, at, nbytes)
        return tag, DecodeResult(out, out_shape, positions), at + nbytes
    if status:
        message = frame[offset : offset + msg_len].decode("utf-8", "replace")
        return tag, GdnError(message, STATUS_CODES.get(status, grpc.StatusCode.INTERNAL)), None
    return tag, DecodeResult(frame[offset:] if copy else memoryview(frame)[offset:], out_shape, positions), None


def send_frames(sock: socket.socket, parts: list[bytes]) -> None:
    """Writes frames' buffers back to back on a blocking socket: scatter-gather, no join (at most
    512 buffers a system call, under the usual IOV_MAX of 1024)."""
    while parts:
        batch, parts = parts[:512], parts[512:]
        total = sum(len(p) for p in batch)
        sent = sock.sendmsg(batch)
        if sent < total:  # rare: a signal or a full buffer mid-write; finish this batch plainly
            sock.sendall(b"".join(batch)[sent:])


class FrameBuffer:
    """Frames (without length prefixes) from a socket read in pieces: `fill()` reads once,
    `frames()` yields the frames completed so far (each the caller's to keep). A burst of small frames costs one read;
    a frame larger than the buffer is read into its own bytearray."""

    def __init__(self, buffer_bytes: int = 1 << 20) -> None:
        self._buf = bytearray(buffer_bytes)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # unread bytes are _buf[_start:_end]
        self._big: bytearray | None = None  # a large frame being filled, and how much of it is there
        self._big_have = 0

    def fill(self, sock: socket.socket) -> bool:
        """One read from `sock` (blocking if nothing is there); False once it has closed."""
        if self._big is not None:
            n = sock.recv_into(memoryview(self._big)[self._big_have :])
            self._big_have += n
            return n > 0
        need = LENGTH.size
        if self._end - self._start >= LENGTH.size:
            need += LENGTH.unpack_from(self._buf, self._start)[0]
        if self._start + need > len(self._buf):  # the frame would run past the end: unread bytes to the front
            self._view[: self._end - self._start] = self._view[self._start : self._end]
            self._end -= self._start
            self._start = 0
        n = sock.recv_into(self._view[self._end :])
        self._end += n
        return n > 0

    def frames(self) -> Iterator[bytes | bytearray]:
        while (frame := self.next_frame()) is not None:
            yield frame

    def next_frame(self) -> bytes | bytearray | None:
        """The next complete frame (the caller's to keep), or None."""
        while True:
            if self._big is not None:
                if self._big_have < len(self._big):
                    return None
                big, self._big = self._big, None
                return big
            if self._end - self._start < LENGTH.size:
                return None
            (size,) = LENGTH.unpack_from(self._buf, self._start)
            total = LENGTH.size + size
            if self._end - self._start >= total:
                frame = bytes(self._view[self._start + LENGTH.size : self._start + total])
                self._start += total
                if self._start == self._end:
                    self._start = self._end = 0
                return frame
            if total > len(self._buf):  # move what we have of it into its own buffer
                self._big = bytearray(size)
                have = self._end - self._start - LENGTH.size
                self._big[:have] = self._view[self._start + LENGTH.size : self._end]
                self._big_have = have
                self._start = self._end = 0
                continue
            return None

    def take_leading(self, take: Callable[[bytearray, int, int], int]) -> None:
        """Lets `take(buf, start, end)` consume complete frames at the front of the buffer, in
        place (no copy per frame); it returns where it stopped, at a frame boundary. The frames
        after it still come from `next_frame`."""
        if self._big is not None:
            return
        self._start = take(self._buf, self._start, self._end)
        if self._start == self._end:
            self._start = self._end = 0
