"""The serving path's DecodeRequest parsers (gdn_server.protowire: the Python one, and the native
one where it is built) against protobuf's: the same fields from every message, errors for the
same bytes, and tensor data left uncopied."""
from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_server.native import module as native_module
from gdn_server.protowire import DecodeRequestView, ParsedDecodeRequest, parse_decode_request, parse_decode_request_python

NAMES = ("q", "k", "v", "a", "b")
PARSERS = [pytest.param(parse_decode_request_python, id="python")]
if native_module is not None:
    PARSERS.append(pytest.param(parse_decode_request, id="native"))


def _fields(req) -> dict:
    """Everything validation and the servicer read of a request."""
    out = {
        "layer": req.layer, "session_ids": list(req.session_ids), "positions": list(req.positions),
        "request_id": req.request_id, "speculative": req.speculative,
    }
    for name in NAMES:
        present = req.HasField(name)
        t = getattr(req, name)
        out[name] = (present, t.dtype, list(t.shape), bytes(t.data)) if present else (False,)
    return out


tensors = st.builds(
    lambda dtype, shape, data: gdn_pb2.Tensor(dtype=dtype, shape=shape, data=data),
    st.integers(0, 3), st.lists(st.integers(-3, 1 << 40), max_size=4), st.binary(max_size=300),
)
requests = st.builds(
    gdn_pb2.DecodeRequest,
    layer=st.integers(0, 2**32 - 1),
    session_ids=st.lists(st.text(max_size=12), max_size=6),
    q=st.none() | tensors, k=st.none() | tensors, v=st.none() | tensors, a=st.none() | tensors, b=st.none() | tensors,
    positions=st.lists(st.integers(0, 2**64 - 1), max_size=6),
    request_id=st.text(max_size=10),
    speculative=st.booleans(),
)


@pytest.mark.parametrize("parse", PARSERS)
@settings(max_examples=300, deadline=None)
@given(request=requests, more=st.lists(requests, max_size=2), rnd=st.randoms(use_true_random=False))
def test_same_fields_as_protobuf(parse, request, more, rnd):
    """Any message, including concatenations (protobuf merges them: a tensor field twice) and
    fields in any order."""
    pieces = [request.SerializeToString(), *(m.SerializeToString() for m in more)]
    rnd.shuffle(pieces)
    data = b"".join(pieces)
    want = gdn_pb2.DecodeRequest.FromString(data)
    got = parse(data, big=0)
    assert _fields(got) == _fields(want)


@pytest.mark.parametrize("parse", PARSERS)
@settings(max_examples=500, deadline=None)
@given(request=requests, at=st.integers(0, 10**6), junk=st.binary(min_size=1, max_size=8),
       how=st.sampled_from(["cut", "insert", "flip"]))
def test_damaged_bytes_fail_or_parse_as_protobuf_does(parse, request, at, junk, how):
    data = request.SerializeToString()
    i = at % (len(data) + 1)
    if how == "cut":
        data = data[:i]
    elif how == "insert":
        data = data[:i] + junk + data[i:]
    elif data:
        j = i % len(data)
        data = data[:j] + bytes([data[j] ^ junk[0]]) + data[j + 1:]
    try:
        want = _fields(gdn_pb2.DecodeRequest.FromString(data))
    except DecodeError:
        want = None
    try:
        got = _fields(parse(data, big=0))
    except DecodeError:
        got = None
    assert got == want


@pytest.mark.parametrize("parse", PARSERS)
def test_big_tensors_are_views_of_the_message(parse):
    q = gdn_pb2.Tensor(dtype=gdn_pb2.BF16, shape=[256, 1, 16, 128], data=bytes(range(256)) * 4096)
    req = gdn_pb2.DecodeRequest(layer=3, session_ids=[f"s{i}" for i in range(256)], q=q, request_id="r")
    data = req.SerializeToString()
    got = parse(data)  # over BIG_MESSAGE_BYTES
    assert isinstance(got, (DecodeRequestView, ParsedDecodeRequest))
    assert isinstance(got.q.data, memoryview) and got.q.data.readonly and got.q.data.obj is data
    assert _fields(got) == _fields(req)
    small = gdn_pb2.DecodeRequest(layer=1, session_ids=["a"], q=q).SerializeToString()[:1000]
    small_q = parse(gdn_pb2.DecodeRequest(layer=1, session_ids=["a"], q=gdn_pb2.Tensor(data=b"xy")).SerializeToString()).q
    assert type(small_q.data) is bytes  # small ones: copied out, as protobuf does
    with pytest.raises(DecodeError):
        parse(small)  # cut inside q


@pytest.mark.parametrize("parse", PARSERS)
def test_truncated_big_message_is_a_decode_error(parse):
    q = gdn_pb2.Tensor(dtype=gdn_pb2.BF16, shape=[1], data=bytes(300_000))
    data = gdn_pb2.DecodeRequest(q=q).SerializeToString()
    with pytest.raises(DecodeError):
        parse(data[:-10])


# -- through a real server: a big step answers exactly as the same rows in small steps ----------

@pytest.mark.parametrize("mode", [pytest.param((), id="one-process"), pytest.param(("--frontends", "1"), id="worker")])
def test_big_request_answers_as_small_ones_do(mode):
    """A big request (over BIG_MESSAGE_BYTES, and over validation.DEFERRED_CHECK_BYTES: its NaN/Inf
    check is left to the backend, behind a worker to its engine through the link) answers as its
    rows do in small requests, step after step; one with an Inf is refused naming the input, and
    moves nothing: the next steps still match the small requests' sessions."""
    import grpc
    import torch

    from gdn_client.proto.gdn.v1 import gdn_pb2_grpc
    from gdn_server.validation import DEFERRED_CHECK_BYTES
    from servers import start_server
    from util import decode_request, random_inputs

    rows, T, H, HV = 128, 4, 2, 4  # bf16: ~1.01 MiB of inputs in one request
    inputs = random_inputs(rows, T, H, HV, gen=torch.Generator().manual_seed(5), dtype=torch.bfloat16)
    assert sum(x.numel() * 2 for x in inputs.values()) >= DEFERRED_CHECK_BYTES
    bad = {n: x.clone() for n, x in inputs.items()}
    bad["v"][rows - 1, T - 1, HV - 1, 127] = float("inf")  # the last value of the request
    with start_server("--layers", "1", "--q-heads", str(H), "--v-heads", str(HV), "--max-sessions", str(2 * rows),
                      *mode) as srv, grpc.insecure_channel(srv.address) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        make = lambda: [stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=30).session_id for _ in range(rows)]
        big_ids, small_ids = make(), make()
        outs = []
        for step in range(3):  # each reads the states the last wrote
            if step == 1:
                with pytest.raises(grpc.RpcError) as err:
                    stub.Decode(decode_request(0, big_ids, bad, positions=[step * T] * rows), timeout=60)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details() == "v has NaN or Inf values"
            big = stub.Decode(decode_request(0, big_ids, inputs, positions=[step * T] * rows), timeout=60)
            small = [
                stub.Decode(decode_request(0, small_ids[i:i + 8], {n: x[i:i + 8] for n, x in inputs.items()},
                                           positions=[step * T] * 8), timeout=60)
                for i in range(0, rows, 8)
            ]
            assert big.o.data == b"".join(s.o.data for s in small)
            outs.append(big.o.data)
        assert outs[0] != outs[1] != outs[2]
