"""`--frontend-transport native`: the workers' gRPC in C (gdn_server/_native_h2.c, over libnghttp2).

Real servers on loopback and real grpc clients. tests/test_frontends.py checks that these workers
answer a whole client script exactly as one process does, and tokens and ownership through them;
here, what the transport itself must get right: tokens on every kind of call (health needs
none), unknown methods, compressed and oversized messages refused per call, a stream that sends
hundreds of requests before it reads one (flow control), big messages over many DATA frames,
deadlines, a client that goes away mid-stream, a graceful stop with a stream open, and garbage
frames, none of which may take the worker down. The whole suite also runs in this mode:
`GDN_TEST_SERVER_FLAGS="--frontends 2 --frontend-transport native" make test`.
"""
from __future__ import annotations

import signal
import socket
import struct
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_server.config import ModelShape, SchedulerConfig
from gdn_server.server import max_message_bytes
from servers import SMALL_MODEL, start_server
from util import NEEDS_NATIVE_TRANSPORT, cli_refusal, decode_request, random_inputs

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


pytestmark = NEEDS_NATIVE_TRANSPORT

H, HV = 2, 4
NATIVE = ("--frontends", "1", "--frontend-transport", "native")
# the largest request the server takes for SMALL_MODEL (~33 MB: 1024 rows of T=8 float32)
LIMIT = max_message_bytes(ModelShape(num_layers=3, num_q_heads=H, num_v_heads=HV, head_dim_k=128, head_dim_v=128),
                          SchedulerConfig().max_batch_rows)
TOKEN = (("authorization", "Bearer tok-native-0123456789"),)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("native") / "tokens"
    tokens.write_text("carol:tok-native-0123456789\n")
    with start_server(*SMALL_MODEL, "--max-sessions", "256", *NATIVE, "--auth-token-file", str(tokens)) as s:
        yield s


@pytest.fixture()
def stub(server):
    with grpc.insecure_channel(server.address) as ch:
        yield gdn_pb2_grpc.GdnDecodeStub(ch)


def _session(stub) -> str:
    return stub.CreateSession(gdn_pb2.CreateSessionRequest(), metadata=TOKEN, timeout=10).session_id


def test_tokens_on_every_kind_of_call_and_health_without_one(server, stub):
    x = random_inputs(1, 1, H, HV)
    for call in (
        lambda md: stub.CreateSession(gdn_pb2.CreateSessionRequest(), metadata=md, timeout=10),
        lambda md: stub.Decode(decode_request(0, ["s"], x), metadata=md, timeout=10),
        lambda md: list(stub.DecodeStream(iter([decode_request(0, ["s"], x)]), metadata=md, timeout=10)),
        lambda md: list(stub.ExportState(gdn_pb2.ExportStateRequest(session_id="s"), metadata=md, timeout=10)),
    ):
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as e:
                call(metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
    with grpc.insecure_channel(server.address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    sid = _session(stub)
    assert list(stub.Decode(decode_request(0, [sid], x), metadata=TOKEN, timeout=10).positions) == [1]


def test_unknown_method_compressed_and_oversized_messages_end_that_call_only(server, stub):
    with grpc.insecure_channel(server.address) as ch:
        unknown = ch.unary_unary("/gdn.v1.GdnDecode/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as e:
            unknown(b"", metadata=TOKEN, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        too_big = ch.unary_unary("/gdn.v1.GdnDecode/Decode")
        with pytest.raises(grpc.RpcError) as e:
            too_big(b"\x0a" + b"\x00" * LIMIT, metadata=TOKEN, timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit" in e.value.details()
    sid = _session(stub)
    x = random_inputs(1, 1, H, HV)
    with grpc.insecure_channel(server.address, compression=grpc.Compression.Gzip) as ch:
        with pytest.raises(grpc.RpcError) as e:
            gdn_pb2_grpc.GdnDecodeStub(ch).Decode(decode_request(0, [sid], x), metadata=TOKEN, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "compressed" in e.value.details()
    # the connection and the worker still serve, and the refused steps changed nothing
    assert list(stub.Decode(decode_request(0, [sid], x), metadata=TOKEN, timeout=10).positions) == [1]


def test_a_stream_that_sends_everything_before_reading(server, stub):
    """300 requests (past MAX_STREAM_IN_FLIGHT, 64) written before the first reply is read:
    flow control holds the client back, and every reply comes, in order."""
    sid = _session(stub)
    gen = torch.Generator().manual_seed(1)
    requests = [decode_request(i % 3, [sid], random_inputs(1, 1, H, HV, gen=gen), request_id=str(i)) for i in range(300)]
    call = stub.DecodeStream(iter(requests), metadata=TOKEN, timeout=60)
    time.sleep(0.5)  # the client writes ahead meanwhile, as far as its window lets it
    replies = list(call)
    assert [r.request_id for r in replies] == [str(i) for i in range(300)]
    assert all(r.error_code == 0 for r in replies)
    assert [r.positions[0] for r in replies] == [i // 3 + 1 for i in range(300)]


def test_a_backlog_of_refused_requests_is_answered_in_order():
    """The worker's side of a stream, with a stand-in transport and engine: 64 steps in flight,
    then 1,500 requests that validation refuses at once (they wait in the backlog, the stream
    paused), then one more step. As the 64 are answered, everything goes out in request order,
    the refused requests taking the freed room, and the stream is resumed."""
    from gdn_server.errors import InvalidArgument
    from gdn_server.frontend_native import _DecodeStream
    from gdn_server.work import DecodeResult

    class Transport:
        def __init__(self):
            self.sent, self.paused = [], []

        def send(self, handle, data):
            self.sent.append(gdn_pb2.DecodeResponse.FromString(data).request_id)
            return True

        def pause(self, handle, paused):
            self.paused.append(paused)

    class Rpcs:
        def __init__(self):
            self.waiting = []

        def _submit_decode(self, request, done, cancelled):
            if request.layer == 99:
                raise InvalidArgument("layer out of range")
            self.waiting.append((done, request.request_id))

        def _count(self, method, code):
            pass

    class Frontend:
        transport, rpcs = Transport(), Rpcs()

        def flush_soon(self):
            pass

        def ended(self, call, code):
            pass

    frontend = Frontend()
    stream = _DecodeStream(frontend, 1, None)
    ids = [f"s{i}" for i in range(64)] + [f"b{i}" for i in range(1500)] + ["last"]
    for rid in ids:
        layer = 99 if rid.startswith("b") else 0
        stream.message(gdn_pb2.DecodeRequest(layer=layer, session_ids=["x"], request_id=rid).SerializeToString())
    assert len(stream.backlog) == 1501 and frontend.transport.paused == [True]
    for done, rid in list(frontend.rpcs.waiting):  # the engine answers the 64
        done(DecodeResult(b"", (1, 1, HV, 128), (1,), rid))
    (done, rid), = frontend.rpcs.waiting[64:]  # "last" went out once there was room
    done(DecodeResult(b"", (1, 1, HV, 128), (1,), rid))
    assert frontend.transport.sent == ids
    assert frontend.transport.paused == [True, False] and not stream.backlog and not stream.slots


def test_big_messages_over_many_frames_and_bad_requests_in_band(stub):
    """A 64-session T=4 float32 request (~1.2 MB: ~75 DATA frames each way) on a stream beside a
    bad request, which is answered in-band while the stream goes on."""
    sids = [_session(stub) for _ in range(64)]
    x = random_inputs(64, 4, H, HV, gen=torch.Generator().manual_seed(2))
    bad = decode_request(0, ["no-such-session"], random_inputs(1, 1, H, HV), request_id="bad")
    replies = list(stub.DecodeStream(iter([decode_request(0, sids, x, request_id="big"), bad,
                                           decode_request(1, sids, x, request_id="big2")]), metadata=TOKEN, timeout=60))
    assert [r.request_id for r in replies] == ["big", "bad", "big2"]
    assert replies[0].error_code == 0 and list(replies[0].o.shape) == [64, 4, HV, 128]
    assert len(replies[0].o.data) == 64 * 4 * HV * 128 * 2
    assert replies[1].error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert replies[2].error_code == 0 and list(replies[2].positions) == [4] * 64


def test_deadlines_and_a_client_that_leaves(server, stub):
    sid = _session(stub)
    x = random_inputs(1, 1, H, HV)
    gate = threading.Event()

    def one_then_wait():
        yield decode_request(0, [sid], x)
        gate.wait(10)

    call = stub.DecodeStream(one_then_wait(), metadata=TOKEN, timeout=1.0)
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    gate.set()
    for _ in range(3):  # streams cancelled mid-way: the worker drops them and goes on
        gate.clear()
        call = stub.DecodeStream(one_then_wait(), metadata=TOKEN, timeout=30)
        next(call)
        call.cancel()
        gate.set()
    with grpc.insecure_channel(server.address) as ch:  # a connection dropped with a stream open
        call = gdn_pb2_grpc.GdnDecodeStub(ch).DecodeStream(one_then_wait(), metadata=TOKEN, timeout=30)
        next(call)
    gate.set()
    reply = stub.Decode(decode_request(1, [sid], x), metadata=TOKEN, timeout=10)
    assert list(reply.positions) == [1]
    with pytest.raises(grpc.RpcError) as e:  # a passed-on call keeps its deadline too
        stub.CreateSession(gdn_pb2.CreateSessionRequest(), metadata=TOKEN, timeout=1e-4)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


_FRAMES = st.lists(
    st.tuples(st.integers(0, 10), st.integers(0, 255), st.sampled_from([0, 1, 3, 2**31 - 1]), st.binary(max_size=64)),
    min_size=1, max_size=6,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=_FRAMES)
def test_garbage_frames_close_one_connection_not_the_worker(server, frames):
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        wire = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # preface, SETTINGS
        for kind, flags, stream, payload in frames:
            wire += struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload
        try:
            sock.sendall(wire)
            sock.settimeout(0.2)
            while sock.recv(65536):
                pass
        except OSError:  # reset or timed out: either way the worker chose
            pass
    with grpc.insecure_channel(server.address) as ch:
        info = gdn_pb2_grpc.GdnDecodeStub(ch).GetModelInfo(gdn_pb2.GetModelInfoRequest(), metadata=TOKEN, timeout=10)
    assert info.num_layers == 3


def test_a_stop_lets_an_open_stream_finish():
    with start_server(*SMALL_MODEL, *NATIVE) as s, grpc.insecure_channel(s.address) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        sid = stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10).session_id
        x = random_inputs(1, 1, H, HV)
        gate = threading.Event()

        def two_steps():
            yield decode_request(0, [sid], x, request_id="before")
            gate.wait(20)
            yield decode_request(1, [sid], x, request_id="after")

        call = stub.DecodeStream(two_steps(), timeout=30)
        assert next(call).request_id == "before"
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # the router is draining its workers now
        gate.set()
        assert [r.request_id for r in call] == ["after"]
        assert s.proc.wait(timeout=30) == 0


@pytest.mark.parametrize("flags, message", [
    ((*SMALL_MODEL, "--frontend-transport", "native"), "--frontends"),
    ((*SMALL_MODEL, *NATIVE, "--tls-cert", "c.pem", "--tls-key", "k.pem"), "TLS"),
], ids=["without-workers", "with-tls"])
def test_refused_where_it_cannot_serve(flags, message, tmp_path, monkeypatch):
    for name in ("c.pem", "k.pem"):
        (tmp_path / name).write_text("x")
    monkeypatch.chdir(tmp_path)
    assert message in cli_refusal(*flags)
