"""gdn_server._wire, the decode RPCs' per-message wire work in C, against protobuf and the Python
checks it stands in front of.

- parse_step takes a bf16 step, plain or speculative, from its wire bytes, checked: wherever it
  accepts bytes, protobuf parses them and gdn_server.validation's checks give the same DecodeWork
  (its speculative flag too); every such step as protobuf serializes it is accepted. A fixed
  corpus, then fuzzed bytes (mutations of it, derandomized: CI runs the same examples every time).
- Tensors by reference (Tensor.ref, o_ref) are taken by the C parse too: resolved (here against a
  stand-in region), they give the DecodeWork protobuf and validation give.
- checked_digests' digests equal the digest written out in Python below (its oracle), and its
  NaN/Inf rule is gdn_client.proto.checks' for bf16, in a row of any input, at any size.
- encode_reply gives what protobuf's SerializeToString gives, byte for byte; reply_o_data finds o's
  bytes in it.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError

from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_server import _wire, limits, validation
from gdn_server.config import ModelShape
from gdn_server.errors import GdnError, InvalidArgument, NotFound
from gdn_server.validation import decode_work, decode_work_from_request, parse_decode_request, step_limits
from util import decode_request, random_inputs

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SHAPE = ModelShape(num_layers=3, num_q_heads=2, num_v_heads=4, head_dim_k=8, head_dim_v=8, max_tokens_per_step=4,
                   max_speculative_tokens=8)
LIMITS = step_limits(SHAPE)
FUZZ = settings(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None,
                max_examples=400)
FIELDS = ("layer", "session_ids", "positions", "request_id", "speculative", "bf16_bytes", "input_dims", "digests",
          "output")
# a stand-in shared-memory region "r" of finite bf16 values, as the servicer's resolve would give it
REGION = torch.randn(1 << 14, generator=torch.Generator().manual_seed(9)).bfloat16().view(torch.uint8).numpy().tobytes()


def resolve(region: str, offset: int, nbytes: int, output: bool = False) -> memoryview:
    if region != "r":
        raise NotFound(f"no shared-memory region {region!r}")
    if offset > len(REGION) or nbytes > len(REGION) - offset:
        raise InvalidArgument("past the region's end")
    return memoryview(REGION)[offset:offset + nbytes]


resolve.recall, resolve.keep = (lambda key: None), (lambda key, names, layout: None)  # keeps no layouts


def plain(B=1, T=1, layer=1, positions=None, request_id="r-1", seed=0, ids=None, refs="",
          o_ref=None, speculative=False) -> gdn_pb2.DecodeRequest:
    """A plain step (a draft where `speculative`); the inputs named in `refs` by reference into
    region "r" (64 bytes apart), o to `o_ref` (region, offset) if given."""
    gen = torch.Generator().manual_seed(seed)
    inputs = random_inputs(B, T, SHAPE.num_q_heads, SHAPE.num_v_heads, SHAPE.head_dim_k, gen=gen, dtype=torch.bfloat16)
    req = decode_request(layer, ids or [f"s{i}" for i in range(B)], inputs, positions, request_id)
    for i, name in enumerate(refs):
        tensor = getattr(req, name)
        tensor.ClearField("data")
        tensor.ref.region, tensor.ref.offset = "r", 64 * i
    if o_ref is not None:
        req.o_ref.region, req.o_ref.offset = o_ref
    req.speculative = speculative
    return req


def python_work(data: bytes):
    """What protobuf and the Python checks make of `data`: a DecodeWork's fields, or None where
    protobuf or a check refuses it (or its inputs are not bf16)."""
    try:
        work = decode_work_from_request(gdn_pb2.DecodeRequest.FromString(data), SHAPE, resolve=resolve)
    except (DecodeError, GdnError):
        return None
    if work.bf16_bytes is None:
        return None
    return _fields(work)


def _fields(work) -> tuple:
    return tuple(
        tuple(bytes(b) for b in work.bf16_bytes) if f == "bf16_bytes"
        else (None if work.output is None else bytes(work.output)) if f == "output" else getattr(work, f)
        for f in FIELDS
    )


def c_work(data: bytes):
    """What the C parse (and, for references, validation's resolution of them) makes of `data`:
    a DecodeWork's fields, or None where the C declines it or a reference does not resolve."""
    step = _wire.parse_step(data, LIMITS)
    if step is None:
        return None
    try:
        return _fields(decode_work(step, SHAPE, resolve=resolve))
    except GdnError:
        return None


def corpus() -> list[bytes]:
    reqs = [
        plain(), plain(B=2, T=2, refs="qvb", o_ref=("r", 4096)), plain(B=3, T=2, layer=2, positions=[0, 5, 2**63 - 1]),
        plain(request_id=""), plain(T=4),
        plain(B=2, ids=["é-ü", "x" * 128], request_id="ü" * 256), plain(layer=0, positions=[7]),
        plain(speculative=True), plain(B=2, T=8, positions=[3, 2**63 - 9], speculative=True),
        plain(B=2, T=6, refs="kb", o_ref=("r", 4096), speculative=True),
        # what the C declines and Python refuses or takes the long way
        plain(layer=3), plain(T=5), plain(T=8), plain(T=9, speculative=True),
        plain(positions=[2**63 - 8], T=8, speculative=True), plain(B=2, ids=["a", "a"]), plain(ids=[""]), plain(ids=["x" * 129]),
        plain(request_id="r" * 257), plain(positions=[1, 2]), plain(positions=[2**63]),
        plain(refs="qkvab"), plain(o_ref=("r", 0)), plain(refs="k", o_ref=("r", 32)),  # o_ref overlaps k: refused
        plain(refs="a", o_ref=("elsewhere", 0)), plain(refs="v", o_ref=("r", 2**64 - 1)),
    ]
    both = plain(refs="q")
    both.q.data = b"\0" * 32  # data and ref: the C declines, validation refuses
    reqs.append(both)
    f32 = plain()
    f32.q.dtype = gdn_pb2.F32
    nan = plain()
    nan.v.data = b"\x80\x7f" + nan.v.data[2:]
    missing = plain()
    missing.ClearField("b")
    spec_f32 = plain(T=6, speculative=True)
    spec_f32.a.dtype = gdn_pb2.F32
    spec_nan = plain(T=6, speculative=True)
    spec_nan.q.data = spec_nan.q.data[:-2] + b"\x80\xff"
    reqs += [f32, nan, missing, spec_f32, spec_nan]
    return [r.SerializeToString() for r in reqs]


def _check_agrees(data: bytes) -> None:
    c = c_work(data)
    if c is not None:  # accepted: protobuf and the Python checks must make the same step of it
        assert c == python_work(data)


@pytest.mark.parametrize("index", range(len(corpus())))
def test_corpus_agrees_with_protobuf_and_validation(index):
    data = corpus()[index]
    want = python_work(data)
    # protobuf's own serialization of a valid plain step is the plain encoding: always accepted
    assert c_work(data) == want


def test_big_inputs_are_checked_by_the_parse():
    shape = ModelShape(num_layers=1, num_q_heads=16, num_v_heads=32, head_dim_k=128, head_dim_v=128)
    gen = torch.Generator().manual_seed(0)
    rows = 64  # 64 x 16.5 KB of inputs
    inputs = random_inputs(rows, 1, 16, 32, 128, gen=gen, dtype=torch.bfloat16)
    data = decode_request(0, [f"s{i}" for i in range(rows)], inputs).SerializeToString()
    assert type(_wire.parse_step(data, step_limits(shape))) is _wire.CheckedStep
    inputs["q"][5, 0, 3, 7] = float("nan")
    data = decode_request(0, [f"s{i}" for i in range(rows)], inputs).SerializeToString()
    assert _wire.parse_step(data, step_limits(shape)) is None  # validation names the input


def _id_hash(b: bytes) -> int:
    """id_hash of gdn_server/_wire.c, written out: to make ids that collide in it."""
    m, mask, n = 0x9E3779B97F4A7C15, 2**64 - 1, len(b)
    h, i = n * m & mask, 0
    while i + 8 <= n:
        h = (h ^ int.from_bytes(b[i:i + 8], "little")) * m & mask
        h ^= h >> 29
        i += 8
    if i < n:
        w = int.from_bytes(b[n - 8:], "little") if n >= 8 else int.from_bytes(b, "big")
        h = (h ^ w) * m & mask
    return h ^ h >> 32


def _ids_agree(ids: list[str], positions=None) -> None:
    """The C parse of a step of `ids` is what protobuf and validation make of it, twice over (the
    second time from the C's cached strs and ints), and the duplicate of any one id is refused."""
    data = plain(B=len(ids), ids=ids, positions=positions).SerializeToString()
    want = python_work(data)
    assert want is not None and want[1] == tuple(ids)
    assert c_work(data) == want and c_work(data) == want
    for i, j in ((0, len(ids) - 1), (len(ids) // 2, len(ids) // 2 + 1)):
        dup = plain(B=len(ids), ids=ids[:j] + [ids[i]] + ids[j + 1:]).SerializeToString()
        assert c_work(dup) is None and python_work(dup) is None


@pytest.mark.parametrize("case", ["lengths", "non-ascii", "many", "tails"])
def test_session_ids_are_checked_for_distinct_ids_as_protobuf_reads_them(case):
    """Ids of every length around the 8-byte words the C hashes, ASCII or not, more of them than
    the C keeps on its stack, ids that differ only in the bytes its last word reads twice."""
    if case == "lengths":
        ids = ["x" * n for n in range(1, 40)] + ["y" * n for n in range(1, 40)]
    elif case == "non-ascii":
        ids = ["é", "e", "é" * 64, "x" * 127 + "é", "ab", "ü-1", "ü-2"]
    elif case == "many":
        ids = [f"s{i}" for i in range(700)]
    else:
        ids = [f"{a}-{b}-tail" for a in "abcdefgh" for b in range(8)] + ["0123456789", "0123456788"]
    positions = list(range(len(ids)))
    _ids_agree(ids, positions)
    _ids_agree(ids, positions[::-1])


def test_ids_that_collide_in_the_c_hash_are_still_checked():
    """80 ids of one slot of the C's table of 256 (the ids' hashes alike below bit 8): past its
    probe limit the C checks them with a set instead, and answers the same."""
    ids = [s for s in (f"c{k}" for k in range(1 << 16)) if _id_hash(s.encode()) & 255 == 0][:80]
    assert len(ids) == 80
    _ids_agree(ids)


def test_other_encodings_go_to_protobuf():
    data = plain().SerializeToString()
    unknown = data + b"\xa8\x06\x01"  # field 101, varint: protobuf keeps it, the C declines
    twice = data + gdn_pb2.DecodeRequest(layer=2).SerializeToString()  # layer again: the last wins
    for variant in (unknown, twice):
        assert _wire.parse_step(variant, LIMITS) is None
        assert type(parse_decode_request(variant, LIMITS)) is gdn_pb2.DecodeRequest
    assert type(parse_decode_request(data, LIMITS)) is _wire.CheckedStep


@pytest.mark.parametrize("T", range(1, SHAPE.max_speculative_tokens + 2))
def test_a_speculative_step_is_taken_up_to_max_speculative_tokens(T):
    """A draft of T tokens: the C parse takes it while T <= max_speculative_tokens, flagged, as
    protobuf and validation take it. The same tokens as a plain step: taken up to max_tokens;
    beyond it the C declines and validation refuses them."""
    for speculative in (True, False):
        data = plain(B=2, T=T, positions=[0, 9], speculative=speculative).SerializeToString()
        step = _wire.parse_step(data, LIMITS)
        max_T = SHAPE.max_speculative_tokens if speculative else SHAPE.max_tokens_per_step
        if T <= max_T:
            assert type(step) is _wire.CheckedStep and step.speculative is speculative and step.dims[0][1] == T
            assert decode_work(step, SHAPE).speculative is speculative
            assert c_work(data) == python_work(data) is not None
        else:
            assert step is None
            with pytest.raises(InvalidArgument, match=f"T = {T} tokens is out of range"):
                decode_work_from_request(gdn_pb2.DecodeRequest.FromString(data), SHAPE)


def test_speculative_is_taken_only_as_protobuf_writes_a_bool():
    """speculative 0 and 1 (in any varint encoding of them) are taken; another value protobuf
    reads as true, so the C leaves it to protobuf, which the Python checks then take as a draft."""
    data = plain().SerializeToString()  # speculative False: proto3 leaves the field out
    key = bytes([10 << 3])  # field 10 (speculative), varint
    assert _wire.FIELDS["DecodeRequest"]["speculative"] == 10
    for value, taken in ((b"\x00", False), (b"\x01", True), (b"\x81\x00", True), (b"\x80\x80\x00", False)):
        step = _wire.parse_step(data + key + value, LIMITS)
        assert step is not None and step.speculative is taken
        assert c_work(data + key + value) == python_work(data + key + value)
    for value in (b"\x02", b"\x80\x01", b"\xff\x01"):
        assert _wire.parse_step(data + key + value, LIMITS) is None
        request = parse_decode_request(data + key + value, LIMITS)
        assert type(request) is gdn_pb2.DecodeRequest and request.speculative
        assert decode_work(request, SHAPE).speculative


def _mutations():
    seeds = corpus()[:10]  # the accepted steps, plain and speculative
    ops = st.sampled_from(["flip", "cut", "insert", "append", "repeat"])
    return st.tuples(st.sampled_from(seeds), ops, st.integers(0, 1 << 20), st.binary(min_size=1, max_size=12))


@FUZZ
@given(_mutations())
def test_fuzzed_bytes_agree_with_protobuf(case):
    data, op, at, blob = case
    i = at % len(data)
    if op == "flip":
        data = data[:i] + bytes([data[i] ^ blob[0]]) + data[i + 1 :]
    elif op == "cut":
        data = data[:i]
    elif op == "insert":
        data = data[:i] + blob + data[i:]
    elif op == "append":
        data = data + blob
    else:  # a stretch of the message again: fields twice, merged sub-messages
        data = data + data[i : i + len(blob) * 64]
    _check_agrees(data)


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_agree_with_protobuf(data):
    _check_agrees(data)


def digests_in_python(raw, rows: int) -> tuple[int, ...]:
    """The oracle of _wire.checked_digests' digests: each row's q, k, v, a, b bytes joined, every byte of it
    up to 1024 bytes, else one byte in 61, CRC-32."""
    out = []
    for r in range(rows):
        row = b"".join(bytes(x)[r * (len(x) // rows) : (r + 1) * (len(x) // rows)] for x in raw)
        out.append(zlib.crc32(row if len(row) <= 1024 else row[::61]))
    return tuple(out)


@pytest.mark.parametrize("rows,sizes", [(1, (8, 8, 16, 2, 2)), (3, (48, 48, 96, 6, 6)), (1, (4096, 4096, 8192, 64, 64)),
                                        (4, (4096 * 4, 4096 * 4, 8192 * 4, 256, 256)), (2, (0, 0, 0, 0, 0)),
                                        # rows digested eight at a time, and the rows left over
                                        (11, (48 * 11, 48 * 11, 96 * 11, 6 * 11, 6 * 11)),
                                        (19, (4096 * 19, 4096 * 19, 8192 * 19, 64 * 19, 64 * 19)),
                                        (16, (1030 * 16, 2 * 16, 514 * 16, 2 * 16, 2 * 16))])
def test_digests_match_the_python_oracle(rows, sizes):
    rng = np.random.default_rng(rows)
    raw = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    assert _wire.checked_digests(raw, rows, False) == (None, digests_in_python(raw, rows))
    assert _wire.checked_digests([memoryview(x) for x in raw], rows, False) == (None, digests_in_python(raw, rows))
    finite = [(np.frombuffer(x, dtype=np.uint16) & 0x3FFF).tobytes() for x in raw]  # exponents never all ones
    assert _wire.checked_digests(finite, rows) == (None, digests_in_python(finite, rows))


@pytest.mark.parametrize("rows,per_row", [(1, (8, 8, 16, 2, 2)), (3, (4096, 4096, 8192, 64, 64)),
                                          (5, (1030, 2, 514, 2, 2)), (11, (256, 256, 512, 4, 4))])
def test_checked_digests_finds_every_nonfinite_bf16_where_the_checks_do(rows, per_row):
    """A NaN or Inf at each end of each row of each input (blocks of the C loop end there too):
    the first input holding one is named, as gdn_client.proto.checks names it."""
    from gdn_client.proto.checks import first_nonfinite

    rng = np.random.default_rng(rows)
    clean = [(rng.integers(0, 1 << 16, rows * n // 2, dtype=np.uint16) & 0xBF7F) for n in per_row]
    assert _wire.checked_digests([x.tobytes() for x in clean], rows)[0] is None
    for index, n in enumerate(per_row):
        for row in range(rows):
            for word in (row * n // 2, (row + 1) * n // 2 - 1):
                for bits in (0x7F80, 0xFFC1):
                    poisoned = [x.copy() for x in clean]
                    poisoned[index][word] = bits
                    raw = [x.tobytes() for x in poisoned]
                    assert _wire.checked_digests(raw, rows) == (index, ()) == (first_nonfinite(raw, gdn_pb2.BF16), ())


def test_checked_digests_reads_whole_words_of_each_row():
    """Rows of an odd number of bytes (not a bf16 step's, but checked_digests takes them): each
    row's words are its own, its last byte in none, as when the rows were checked one by one,
    also where eight rows are checked as one run."""
    rows, per_row = 10, (9, 3, 5, 1, 1)
    clean = [bytearray(rows * n) for n in per_row]
    assert _wire.checked_digests([bytes(x) for x in clean], rows)[0] is None
    straddling = [x[:] for x in clean]
    straddling[0][8:10] = (0x80, 0x7F)  # row 0's last byte and row 1's first: no word of either
    assert _wire.checked_digests([bytes(x) for x in straddling], rows)[0] is None
    for row in (0, 7, 8, 9):  # in the first group of eight, at its end, and left over
        inside = [x[:] for x in clean]
        inside[2][row * 5 + 2 : row * 5 + 4] = (0x80, 0x7F)  # row's second word of v
        assert _wire.checked_digests([bytes(x) for x in inside], rows)[0] == 2


@FUZZ
@given(st.binary(max_size=3000), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5),
       st.lists(st.integers(0, 2**64 - 1), max_size=5), st.text(max_size=40))
def test_encode_reply_is_what_protobuf_serializes(out, shape, positions, request_id):
    reply = gdn_pb2.DecodeResponse(positions=positions, request_id=request_id)
    reply.o.dtype = gdn_pb2.BF16
    reply.o.shape.extend(shape)
    reply.o.data = out
    got = _wire.encode_reply(out, tuple(shape), tuple(positions), request_id)
    assert got == reply.SerializeToString()
    assert _wire.encode_reply(memoryview(out), tuple(shape), tuple(positions), request_id) == got
    data = _wire.reply_o_data(got)  # o's bytes inside the reply, not a copy of them
    assert data.readonly and data.obj is got and bytes(data) == out


def test_reply_o_data_takes_only_encode_replys_bytes():
    for other in (b"", b"\x12\x01\x05", gdn_pb2.DecodeResponse(request_id="r").SerializeToString(),
                  _wire.encode_reply(b"ab", (1,), (), "")[:-1]):
        with pytest.raises(ValueError):
            _wire.reply_o_data(other)
    with pytest.raises(TypeError):
        _wire.reply_o_data(bytearray(_wire.encode_reply(b"ab", (1,), (), "")))


def test_the_c_constants_are_the_protos_and_validations():
    """The field numbers, the BF16 code and the position bound written into _wire.c are those of
    gdn_pb2 and gdn_server.validation; StepLimits carries the model's and gdn_server.limits' bounds by name."""
    for message, fields in _wire.FIELDS.items():
        descriptor = getattr(gdn_pb2, message).DESCRIPTOR
        for name, number in fields.items():
            assert descriptor.fields_by_name[name].number == number, (message, name)
    assert _wire.BF16 == gdn_pb2.BF16
    assert _wire.MAX_POSITION == validation.MAX_POSITION == 2**63 - 1
    assert (LIMITS.num_layers, LIMITS.num_q_heads, LIMITS.num_v_heads, LIMITS.head_dim_k, LIMITS.head_dim_v,
            LIMITS.max_tokens, LIMITS.max_speculative_tokens) == (3, 2, 4, 8, 8, 4, 8)
    assert (LIMITS.max_session_id_len, LIMITS.max_request_id_len) == (limits.MAX_SESSION_ID_LEN,
                                                                      limits.MAX_REQUEST_ID_LEN)
    with pytest.raises(TypeError):
        _wire.parse_step(plain().SerializeToString(), tuple(range(1, 10)))  # no positional tuple
    with pytest.raises(ValueError, match="max_tokens"):
        _wire.StepLimits(num_layers=1, num_q_heads=1, num_v_heads=1, head_dim_k=1, head_dim_v=1, max_tokens=0,
                         max_speculative_tokens=1, max_session_id_len=1, max_request_id_len=1)
    with pytest.raises(ValueError, match="max_speculative_tokens"):
        _wire.StepLimits(num_layers=1, num_q_heads=1, num_v_heads=1, head_dim_k=1, head_dim_v=1, max_tokens=1,
                         max_speculative_tokens=0, max_session_id_len=1, max_request_id_len=1)
    with pytest.raises(TypeError):  # every limit named: none defaults
        _wire.StepLimits(num_layers=1, num_q_heads=1, num_v_heads=1, head_dim_k=1, head_dim_v=1, max_tokens=1,
                         max_session_id_len=1, max_request_id_len=1)


@pytest.mark.parametrize("T", [1, 4])
def test_a_count_that_would_reach_2_63_is_refused_where_it_enters(T):
    """position + T must stay below 2^63: the last position a step of T tokens may start at is
    2^63 - 1 - T. Beyond it, C and Python alike refuse it (INVALID_ARGUMENT), nothing queued."""
    for position, ok in ((2**63 - 1 - T, True), (2**63 - T, False), (2**63 - 1, False)):
        data = plain(T=T, positions=[position]).SerializeToString()
        assert (c_work(data) is not None) == ok
        if ok:
            assert python_work(data) == c_work(data)
        else:
            with pytest.raises(InvalidArgument, match="2\\^63"):
                decode_work_from_request(gdn_pb2.DecodeRequest.FromString(data), SHAPE)


def test_a_shape_of_thousands_of_dims_is_named_briefly():
    req = plain()
    req.k.shape[:] = [1] * 10_004
    with pytest.raises(InvalidArgument) as refused:
        decode_work_from_request(req, SHAPE)
    assert "10004 dimensions" in str(refused.value) and len(str(refused.value)) < 200
    req = plain()
    req.q.shape[:] = [1] * 10_004
    with pytest.raises(InvalidArgument) as refused:
        decode_work_from_request(req, SHAPE)
    assert len(str(refused.value)) < 200


def test_the_c_parse_takes_steps_by_reference():
    data = plain(B=2, T=2, refs="qvb", o_ref=("r", 4096)).SerializeToString()
    step = _wire.parse_step(data, LIMITS)
    assert step.by_reference and step.o_ref == ("r", 4096) and step.digests == ()
    assert [type(x) for x in step.inputs] == [tuple, memoryview, tuple, memoryview, tuple] and step.inputs[2] == ("r", 64)
    assert c_work(data) == python_work(data) is not None
    inline = _wire.parse_step(plain().SerializeToString(), LIMITS)
    assert not inline.by_reference and inline.o_ref is None


@pytest.mark.parametrize("bits", [0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF, 0x7F80, 0xFF80, 0x7F7F, 0xFF7F])
def test_the_c_nan_rule_is_the_checks_rule(bits):
    """Every bf16 NaN and Inf pattern (and the largest finite values, 0x7F7F and 0xFF7F), in each
    input: the C parse refuses a plain step exactly where gdn_client.proto.checks finds one."""
    from gdn_client.proto.checks import first_nonfinite

    for name in "qkvab":
        req = plain()
        data = bytearray(getattr(req, name).data)
        data[2:4] = bits.to_bytes(2, "little")
        getattr(req, name).data = bytes(data)
        raw = [bytes(getattr(req, n).data) for n in "qkvab"]
        found = first_nonfinite(raw, gdn_pb2.BF16)
        assert (found is not None) == ((bits & 0x7F80) == 0x7F80)
        assert (_wire.parse_step(req.SerializeToString(), LIMITS) is None) == (found is not None)


def test_a_reply_is_encoded_once_and_o_goes_to_its_region_where_asked():
    """A DecodeResult is its reply as encode_reply makes it, with o as a view into it (the one
    copy of the output); servicer.decode_response sends that reply as it is, and with an o_ref's
    region writes o there and sends a reply that carries o's dtype and shape only."""
    from gdn_server.servicer import decode_response
    from gdn_server.work import DecodeResult

    shape, positions = (1, 1, 1, 2), (3,)
    buffer = bytearray(b"abcd")  # a backend's output buffer, reused once the result is made
    result = DecodeResult(memoryview(buffer), shape, positions, "r")
    buffer[:] = b"wxyz"
    assert result.reply == _wire.encode_reply(b"abcd", shape, positions, "r")
    assert result.out.obj is result.reply and bytes(result.out) == b"abcd"
    assert decode_response(result) is result.reply
    region = bytearray(4)
    assert decode_response(result, memoryview(region)) == _wire.encode_reply(b"", shape, positions, "r")
    assert region == b"abcd"
