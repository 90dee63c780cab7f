"""Protobuf's wire format by hand, where the serving path moves megabytes: the DecodeRequest
parser (protobuf's own, except for big messages, whose tensor bytes stay where gRPC put them),
and the varint the hand-written DecodeResponse needs (gdn_server.decode_rpcs.decode_response_wire).

protobuf (upb) copies every bytes field twice on the way to Python: into its arena when it
parses, and into a new bytes object on each `.data` read. For a B=256 step that is 8 MiB of
memory traffic, ~0.8 ms on the H200 host (bench/results/trace_big_v1). For a message of
BIG_MESSAGE_BYTES or more this walks the top level of the wire format instead, cuts the five
tensors' `data` fields out, lets protobuf parse the small rest (ids, positions, shapes...) and
hands the data out as read-only memoryviews of the received bytes. Whatever it does not expect
(a tensor field twice, which protobuf merges; group wire types) goes to protobuf whole, so both
parsers agree on every input (tests/test_protowire.py checks that with hypothesis).

Where the native module is built (gdn_server/_native.c; GDN_NATIVE=0 turns it off), every
DecodeRequest is parsed by it instead, in one C call, into a ParsedDecodeRequest: at the ~10k
requests a second of a busy server, upb's per-field attribute reads were a large share of the
event loop's time (bench/NOTES.md). It too leaves what it does not expect to protobuf.
"""
from __future__ import annotations

from operator import itemgetter
from typing import Any

from google.protobuf.message import DecodeError

from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_server.native import module as native  # gdn_server._native, or None

BIG_MESSAGE_BYTES = 256 << 10
# the serving methods whose requests this parses (RejectMalformed's `parsers`)
DECODE_METHODS = ("/gdn.v1.GdnDecode/Decode", "/gdn.v1.GdnDecode/DecodeStream")
_TENSOR_FIELDS = {3: "q", 4: "k", 5: "v", 6: "a", 7: "b"}  # DecodeRequest's Tensor fields
_TENSOR_DATA = 3  # Tensor.data
_LENGTH_DELIMITED = 2


class _Unexpected(Exception):
    """Something this parser leaves to protobuf."""


def _varint(buf: Any, pos: int) -> tuple[int, int]:
    byte = buf[pos]  # an IndexError past the end: a truncated message
    if byte < 0x80:
        return byte, pos + 1
    result, shift = byte & 0x7F, 7
    while True:
        pos += 1
        byte = buf[pos]
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos + 1
        shift += 7
        if shift >= 70:
            raise DecodeError("varint too long")


def encode_varint(n: int) -> bytes:
    """A non-negative integer as a protobuf varint."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _skip(buf: Any, pos: int, wire: int, end: int) -> tuple[int, int, int]:
    """Steps over one field's value; returns (value start, value end, next position)."""
    if wire == 0:
        _, nxt = _varint(buf, pos)
        return pos, nxt, nxt
    if wire == _LENGTH_DELIMITED:
        n, start = _varint(buf, pos)
        stop = start + n
        if stop > end:
            raise DecodeError("truncated length-delimited field")
        return start, stop, stop
    if wire == 1:
        return pos, pos + 8, pos + 8
    if wire == 5:
        return pos, pos + 4, pos + 4
    raise _Unexpected  # groups (3, 4) and invalid wire types: protobuf's call


class TensorView:
    """A `gdn.v1.Tensor` whose `data` is a read-only memoryview of the received message."""

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype: int, shape: Any, data: memoryview | bytes) -> None:
        self.dtype = dtype
        self.shape = shape
        self.data = data


class DecodeRequestView:
    """A DecodeRequest (what validation and the servicer read of one) with its tensors' bytes
    left in the received message: q, k, v, a, b are TensorViews; everything else is protobuf's."""

    __slots__ = ("_message", "_tensors")

    def __init__(self, message: gdn_pb2.DecodeRequest, tensors: dict[str, TensorView]) -> None:
        self._message = message
        self._tensors = tensors

    def __getattr__(self, name: str) -> Any:
        tensor = self._tensors.get(name)
        return tensor if tensor is not None else getattr(self._message, name)

    def HasField(self, name: str) -> bool:  # noqa: N802 (protobuf's name)
        return self._message.HasField(name)


_ABSENT = TensorView(0, (), b"")  # what protobuf reads for a tensor field the message lacks


class ParsedDecodeRequest(tuple):
    """A DecodeRequest as the native parser returns it: (layer, session_ids, positions,
    request_id, speculative, tensors), each tensor (dtype, shape, data) or None. It reads like
    the protobuf message wherever the server reads one (validation, the servicer), and
    gdn_server.validation checks it in C (`check_bf16_step`)."""

    __slots__ = ()
    layer = property(itemgetter(0))
    session_ids = property(itemgetter(1))
    positions = property(itemgetter(2))
    request_id = property(itemgetter(3))
    speculative = property(itemgetter(4))

    def HasField(self, name: str) -> bool:  # noqa: N802 (protobuf's name)
        index = _TENSOR_INDEX.get(name)
        if index is None:
            raise ValueError(f"DecodeRequest has no message field {name!r}")
        return self[5][index] is not None

    def __getattr__(self, name: str) -> Any:  # q, k, v, a, b
        index = _TENSOR_INDEX.get(name)
        if index is None:
            raise AttributeError(name)
        tensor = self[5][index]
        return _ABSENT if tensor is None else TensorView(*tensor)


_TENSOR_INDEX = {name: field - 3 for field, name in _TENSOR_FIELDS.items()}


def parse_decode_request(
    data: bytes, big: int = BIG_MESSAGE_BYTES
) -> gdn_pb2.DecodeRequest | DecodeRequestView | ParsedDecodeRequest:
    """`DecodeRequest.FromString(data)`, with the tensors' bytes not copied when `data` has at
    least `big` bytes. Raises what protobuf raises for bytes that are not a DecodeRequest."""
    if native is not None and type(data) is bytes:
        fields = native.parse_decode_request(data, big)
        if fields is not None:
            return ParsedDecodeRequest(fields)
    return parse_decode_request_python(data, big)


def parse_decode_request_python(data: bytes, big: int = BIG_MESSAGE_BYTES) -> gdn_pb2.DecodeRequest | DecodeRequestView:
    """`parse_decode_request` without the native module (and where it leaves a message to protobuf)."""
    if len(data) < big:
        return gdn_pb2.DecodeRequest.FromString(data)
    try:
        return _parse_big(data)
    except _Unexpected:
        return gdn_pb2.DecodeRequest.FromString(data)
    except IndexError:
        raise DecodeError("truncated message") from None


def _parse_big(data: bytes) -> DecodeRequestView:
    view = memoryview(data).toreadonly()
    end = len(data)
    kept: list[Any] = []  # the message without the tensors' data, in pieces
    run = 0  # start of the bytes not yet put in `kept`
    found: dict[int, memoryview | bytes] = {}
    pos = 0
    while pos < end:
        field_start = pos
        key = data[pos]
        if key < 0x80 and key & 7 == _LENGTH_DELIMITED and data[pos + 1] < 0x80:
            # one-byte key and length: most fields of a big request (its hundreds of session ids);
            # inline, as two calls per field were most of the parse
            stop = pos + 2 + data[pos + 1]
            if stop > end:
                raise DecodeError("truncated length-delimited field")
            start, pos = pos + 2, stop
            field, wire = key >> 3, _LENGTH_DELIMITED
        else:
            key, pos = _varint(data, pos)
            field, wire = key >> 3, key & 7
            start, stop, pos = _skip(data, pos, wire, end)
        if field in _TENSOR_FIELDS and wire == _LENGTH_DELIMITED:
            if field in found:
                raise _Unexpected  # protobuf merges repeated message fields
            head, found[field] = _strip_tensor_data(data, view, start, stop)
            kept.append(view[run:field_start])
            kept.append(encode_varint(field << 3 | _LENGTH_DELIMITED) + encode_varint(len(head)) + head)
            run = stop
    if pos != end:
        raise DecodeError("truncated message")
    kept.append(view[run:end])
    message = gdn_pb2.DecodeRequest.FromString(b"".join(kept))
    tensors = {}
    for field, payload in found.items():
        name = _TENSOR_FIELDS[field]
        tensor = getattr(message, name)
        tensors[name] = TensorView(tensor.dtype, tensor.shape, payload)
    return DecodeRequestView(message, tensors)


def decode_request_parsers() -> dict[str, Any]:
    """RejectMalformed's `parsers` for the serving methods."""
    return dict.fromkeys(DECODE_METHODS, parse_decode_request)


def _strip_tensor_data(data: bytes, view: memoryview, start: int, stop: int) -> tuple[bytes, memoryview | bytes]:
    """A Tensor's bytes without its data field(s), and the data (the last one wins, as in protobuf)."""
    kept: list[Any] = []
    run = start
    payload: memoryview | bytes = b""
    pos = start
    while pos < stop:
        field_start = pos
        key, pos = _varint(data, pos)
        field, wire = key >> 3, key & 7
        value_start, value_stop, pos = _skip(data, pos, wire, stop)
        if field == _TENSOR_DATA and wire == _LENGTH_DELIMITED:
            payload = view[value_start:value_stop]
            kept.append(view[run:field_start])
            run = value_stop
    if pos != stop:
        raise DecodeError("truncated Tensor")
    kept.append(view[run:stop])
    return b"".join(kept), payload
