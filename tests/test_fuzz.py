"""Hostile input against one real server: property-based fuzzing of DecodeRequest and the session
RPCs, garbage bytes on the wire, and slow or stuck clients.

The fuzzed server runs with bearer tokens: the fuzzer ("mallory") knows the id of a session of
another identity ("control") and names it freely. After every test the control session takes its
next step and its output is checked against the fp32 reference: nothing the fuzzer sent may have
moved it. Every fuzzed call must end in an expected status code, and the server must stay up.

Budgets are fixed (`max_examples`, no deadline); the module takes about a minute on 2 cores.
"""
from __future__ import annotations

import re

import hashlib
import threading
import time

import grpc
import pytest
import torch

from servers import SMALL_MODEL, start_server
from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_client.wire import WireFormatError, tensor_from_proto
from reference import ReferenceModel, rel_err
from util import decode_request, random_inputs, write_gates

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

L, H, HV, K = 3, 2, 4, 128
MALLORY, CONTROL = "tok-mallory-31337", "tok-control-42"
FUZZ = settings(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)
C = grpc.StatusCode
# what a well-behaved server may answer a hostile request with (never UNKNOWN/INTERNAL: a crash)
DOMAIN_CODES = {C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.FAILED_PRECONDITION, C.PERMISSION_DENIED,
                C.RESOURCE_EXHAUSTED}
CODE_OF = {c.value[0]: c for c in grpc.StatusCode}


def _md(token: str):
    return (("authorization", f"Bearer {token}"),)


class Env:
    """The fuzzed server, the fuzzer's stub and sessions, and the control session with its reference."""

    def __init__(self, server, A_log, dt_bias) -> None:
        self.server = server
        self.channel = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 << 20)])
        self.stub = gdn_pb2_grpc.GdnDecodeStub(self.channel)
        self.ref = ReferenceModel(A_log, dt_bias)
        self.gen = torch.Generator().manual_seed(1234)
        self.control = self.stub.CreateSession(gdn_pb2.CreateSessionRequest(), metadata=_md(CONTROL)).session_id
        self.control_pos = [0] * L
        self.own = [self.stub.CreateSession(gdn_pb2.CreateSessionRequest(), metadata=_md(MALLORY)).session_id
                    for _ in range(3)]
        self.control_steps = 0
        self.check_control()

    def check_control(self) -> None:
        """The control session's next step matches the reference: its state is untouched."""
        assert self.server.proc.poll() is None, "the server died"
        layer = self.control_steps % L
        x = random_inputs(1, 1 + self.control_steps % 4, H, HV, gen=self.gen)
        req = decode_request(layer, [self.control], x, positions=[self.control_pos[layer]])
        reply = self.stub.Decode(req, metadata=_md(CONTROL), timeout=30)
        expected = self.ref.step(layer, [self.control], **x)
        assert rel_err(tensor_from_proto(reply.o), expected) < 5e-3
        self.control_pos[layer] += x["q"].shape[1]
        assert list(reply.positions) == [self.control_pos[layer]]
        self.control_steps += 1


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    A_log, dt_bias = write_gates(d / "gates.safetensors", L, HV, seed=11)
    (d / "tokens").write_text(f"mallory:{MALLORY}\ncontrol:{CONTROL}\n")
    flags = (*SMALL_MODEL, "--weights", str(d / "gates.safetensors"), "--auth-token-file", str(d / "tokens"),
             "--max-sessions", "24")
    with start_server(*flags) as server:
        e = Env(server, A_log, dt_bias)
        yield e
        e.check_control()
        e.channel.close()
        assert server.proc.poll() is None
        # grpc.aio itself logs ExecuteBatchError (with a traceback) when a reply is sent just
        # after the client's deadline ended the call: test_expired_deadlines provokes exactly
        # that race on purpose. Any other traceback is a server bug.
        log = "".join(server.log)
        records = re.split(r"\n(?=\d{4}-\d\d-\d\d )", log)  # a log record starts with its date
        errors = [r for r in records if "Traceback" in r and "ExecuteBatchError" not in r]
        assert not errors, log[-4000:]


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return C.OK


# -- DecodeRequest -----------------------------------------------------------------------------
DTYPES = {gdn_pb2.BF16: torch.bfloat16, gdn_pb2.F16: torch.float16, gdn_pb2.F32: torch.float32}
int64s = st.one_of(st.integers(-3, 8), st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, 2**31, 2**40, 2**62]))
uint64s = st.one_of(st.integers(0, 8), st.integers(0, 2**64 - 1), st.integers(2**63 - 9, 2**63 + 1))
weird_ids = st.one_of(st.text(max_size=8), st.just(""), st.just("x" * 300), st.binary(max_size=24).map(
    lambda b: b.decode("latin-1")))


@st.composite
def hostile_decode(draw, env: Env) -> tuple[gdn_pb2.DecodeRequest, bool]:
    """A valid request of the fuzzer's own sessions, then 0..4 mutations. Returns (request,
    names_foreign_session)."""
    B = draw(st.integers(1, len(env.own)))
    T = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    sessions = draw(st.permutations(env.own))[:B]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    inputs = random_inputs(B, T, H, HV, gen=g, dtype=DTYPES[dtype])
    req = decode_request(draw(st.integers(0, L - 1)), sessions, inputs)
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["layer", "id", "foreign", "dup", "add_id", "drop_id", "dtype", "shape",
                                     "bytes", "nonfinite", "missing", "positions", "request_id", "ref"]))
        name = draw(st.sampled_from("qkvab"))
        t = getattr(req, name)
        if kind == "layer":
            req.layer = draw(st.one_of(st.integers(0, 5), st.integers(0, 2**32 - 1)))
        elif kind == "id" and req.session_ids:
            req.session_ids[draw(st.integers(0, len(req.session_ids) - 1))] = draw(weird_ids)
        elif kind == "foreign":
            if req.session_ids:
                req.session_ids[draw(st.integers(0, len(req.session_ids) - 1))] = env.control
            else:
                req.session_ids.append(env.control)
        elif kind == "dup" and req.session_ids:
            req.session_ids.append(req.session_ids[0])
        elif kind == "add_id":
            req.session_ids.append(draw(st.sampled_from([*env.own, "never-created-session-id"])))
        elif kind == "drop_id" and req.session_ids:
            del req.session_ids[-1]
        elif kind == "dtype":
            t.dtype = draw(st.integers(0, 9))
        elif kind == "shape":
            t.shape[:] = draw(st.one_of(st.lists(int64s, max_size=6), st.just([1] * 10_004)))
        elif kind == "bytes":
            how = draw(st.sampled_from(["cut", "grow", "random", "empty"]))
            if how == "cut":
                t.data = t.data[: draw(st.integers(0, max(0, len(t.data) - 1)))]
            elif how == "grow":
                t.data = t.data + draw(st.binary(min_size=1, max_size=64))
            elif how == "random":
                t.data = draw(st.binary(max_size=512))
            else:
                t.data = b""
        elif kind == "nonfinite":
            try:  # an earlier mutation may have left the tensor undecodable: then nothing to poison
                x = tensor_from_proto(t).clone() if t.dtype in DTYPES else None
            except WireFormatError:
                x = None
            if x is not None and x.numel():
                x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from(
                    [float("nan"), float("inf"), float("-inf")]))
                t.data = x.contiguous().view(torch.uint8).numpy().tobytes()
        elif kind == "missing":
            req.ClearField(name)
        elif kind == "positions":
            req.positions[:] = draw(st.lists(uint64s, max_size=5))
        elif kind == "request_id":
            req.request_id = draw(st.text(max_size=40))
        elif kind == "ref":  # shared memory, which this server does not take
            ref = req.o_ref if draw(st.booleans()) else t.ref
            ref.region, ref.offset = draw(st.text(max_size=8)), draw(uint64s)
    return req, env.control in req.session_ids


def _check_reply(req: gdn_pb2.DecodeRequest, code: grpc.StatusCode, foreign: bool, reply=None) -> None:
    assert code in DOMAIN_CODES, code
    if foreign:
        assert code != C.OK, "a foreign session was decoded"
    if code == C.OK and reply is not None:
        o = tensor_from_proto(reply.o)
        assert list(o.shape) == [len(req.session_ids), req.q.shape[1], HV, K]
        assert reply.request_id == req.request_id


def test_fuzz_decode(env):
    @settings(FUZZ, max_examples=250)
    @given(case=hostile_decode(env), via_stream=st.booleans())
    def run(case, via_stream):
        req, foreign = case
        if not via_stream:
            try:
                reply = env.stub.Decode(req, metadata=_md(MALLORY), timeout=30)
                code = C.OK
            except grpc.RpcError as e:
                code, reply = e.code(), None
            _check_reply(req, code, foreign, reply)
            return
        # in a stream: the bad request gets an error reply and the stream goes on
        good = decode_request(0, [env.own[0]], random_inputs(1, 1, H, HV))
        replies = list(env.stub.DecodeStream(iter([req, good]), metadata=_md(MALLORY), timeout=30))
        assert len(replies) == 2
        _check_reply(req, CODE_OF[replies[0].error_code], foreign, replies[0])
        assert replies[1].error_code == 0, replies[1].error_message

    run()
    env.check_control()


# -- session RPCs ------------------------------------------------------------------------------
@st.composite
def state_chunks(draw, env: Env) -> list[gdn_pb2.StateChunk]:
    n = HV * K * K * L * 2
    data = draw(st.sampled_from([b"\0" * n, b"", b"\1" * 7])) if draw(st.booleans()) else draw(st.binary(max_size=64))
    header = gdn_pb2.StateHeader(
        num_layers=draw(st.sampled_from([L, 0, -1, 2**31 - 1])),
        num_v_heads=draw(st.sampled_from([HV, 0, 1000])),
        head_dim_k=draw(st.sampled_from([K, 1])),
        head_dim_v=draw(st.sampled_from([K, -5])),
        dtype=draw(st.sampled_from(["bfloat16", "float32", ""])),
        positions=draw(st.lists(uint64s, max_size=4)),
        total_bytes=draw(st.sampled_from([len(data), n, 0, 2**63])),
        checksum=draw(st.sampled_from([hashlib.sha256(data).hexdigest(), "", "zz"])),
    )
    chunks = [gdn_pb2.StateChunk(header=header, data=data[: len(data) // 2]), gdn_pb2.StateChunk(data=data[len(data) // 2:])]
    how = draw(st.sampled_from(["ok", "no_header", "two_headers", "empty"]))
    if how == "no_header":
        chunks[0].ClearField("header")
    elif how == "two_headers":
        chunks[1].header.CopyFrom(header)
    elif how == "empty":
        chunks = []
    return chunks


def test_fuzz_session_rpcs(env):
    created: list[str] = []

    @settings(FUZZ, max_examples=120)
    @given(ops=st.lists(st.tuples(st.sampled_from(["create", "close", "fork", "export", "import"]),
                                  st.one_of(st.sampled_from(["own", "control", "created"]), weird_ids),
                                  state_chunks(env)), min_size=1, max_size=4))
    def run(ops):
        for op, which, chunks in ops:
            sid = {"own": env.own[0], "control": env.control}.get(which, which)
            if which == "created":
                sid = created[-1] if created else "gone"
            md = _md(MALLORY)
            if op == "create":
                call = lambda: created.append(env.stub.CreateSession(  # noqa: E731
                    gdn_pb2.CreateSessionRequest(), metadata=md, timeout=30).session_id)
            elif op == "close":
                def call():
                    env.stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), metadata=md, timeout=30)
                    if sid in created:
                        created.remove(sid)
            elif op == "fork":
                call = lambda: created.append(env.stub.ForkSession(  # noqa: E731
                    gdn_pb2.ForkSessionRequest(session_id=sid), metadata=md, timeout=30).session_id)
            elif op == "export":
                call = lambda: list(env.stub.ExportState(  # noqa: E731
                    gdn_pb2.ExportStateRequest(session_id=sid), metadata=md, timeout=30))
            else:
                call = lambda: created.append(env.stub.ImportState(  # noqa: E731
                    iter(chunks), metadata=md, timeout=30).session_id)
            code = _code(call)
            assert code in DOMAIN_CODES, (op, which, code)
            if which == "control" and op in ("close", "fork", "export"):
                assert code == C.PERMISSION_DENIED
            if op == "close" and sid == env.own[0]:  # keep the fuzzer's base sessions
                env.own[0] = env.stub.CreateSession(gdn_pb2.CreateSessionRequest(), metadata=md).session_id
        while len(created) > 8:  # stay under capacity most of the time
            env.stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=created.pop()), metadata=_md(MALLORY))

    run()
    for sid in created:
        _code(lambda: env.stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), metadata=_md(MALLORY)))
    env.check_control()


# -- garbage on the wire -------------------------------------------------------------------------
METHODS = {
    "GetModelInfo": "unary_unary", "CreateSession": "unary_unary", "CloseSession": "unary_unary",
    "Decode": "unary_unary", "ForkSession": "unary_unary", "GetStats": "unary_unary",
    "DecodeStream": "stream_stream", "ExportState": "unary_stream", "ImportState": "stream_unary",
}

# the methods whose success holds a new session (each replies a CreateSessionResponse)
CREATES = ("CreateSession", "ForkSession", "ImportState")


def test_fuzz_raw_bytes(env):
    """Bytes that are not (or only by chance) a valid message: the call ends in a status code."""

    @settings(FUZZ, max_examples=150)
    @given(method=st.sampled_from(sorted(METHODS)), payloads=st.lists(st.binary(max_size=2048), min_size=1,
                                                                     max_size=3))
    def run(method, payloads):
        kind = METHODS[method]
        # no serializers: the bytes go out as they are, the reply comes back as bytes
        callable_ = getattr(env.channel, kind)(f"/gdn.v1.GdnDecode/{method}")
        md = _md(MALLORY)
        if kind == "unary_unary":
            fn = lambda: callable_(payloads[0], metadata=md, timeout=30)  # noqa: E731
        elif kind == "unary_stream":
            fn = lambda: list(callable_(payloads[0], metadata=md, timeout=30))  # noqa: E731
        elif kind == "stream_unary":
            fn = lambda: callable_(iter(payloads), metadata=md, timeout=30)  # noqa: E731
        else:
            fn = lambda: list(callable_(iter(payloads), metadata=md, timeout=30))  # noqa: E731
        replies = []
        code = _code(lambda: replies.append(fn()))
        # bytes that do not parse: INVALID_ARGUMENT (not grpc's default UNKNOWN and a logged traceback)
        assert code in DOMAIN_CODES, (method, code)
        if code == C.OK and method in CREATES:  # bytes that happened to ask for a session: give it back
            sid = gdn_pb2.CreateSessionResponse.FromString(replies[0]).session_id
            env.stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), metadata=md, timeout=30)

    run()
    env.check_control()


# -- slow and stuck clients ------------------------------------------------------------------------
def test_stuck_stream_reader_does_not_stall_others(env):
    """A client that sends a long DecodeStream and never reads a reply holds up nobody else."""
    reqs = [decode_request(l % L, [env.own[1]], random_inputs(1, 1, H, HV)) for l in range(300)]
    call = env.stub.DecodeStream(iter(reqs), metadata=_md(MALLORY), timeout=60)  # never iterated
    try:
        time.sleep(0.3)
        for _ in range(3):
            t0 = time.monotonic()
            env.check_control()
            assert time.monotonic() - t0 < 5
    finally:
        call.cancel()


def test_expired_deadlines(env):
    """Requests whose deadline passes are answered DEADLINE_EXCEEDED (or OK when fast enough); a
    positioned retry then either replays the applied step or applies it: never twice."""
    sid = env.own[2]
    pos = {}
    for i in range(20):
        layer = i % L
        x = random_inputs(1, 1, H, HV, gen=torch.Generator().manual_seed(i))
        if layer not in pos:  # learn the server's count: the fuzzing moved it
            pos[layer] = _probe_position(env, sid, layer)
        req = decode_request(layer, [sid], x, positions=[pos[layer]])
        code = _code(lambda: env.stub.Decode(req, metadata=_md(MALLORY), timeout=1e-4))
        assert code in (C.OK, C.DEADLINE_EXCEEDED)
        reply = env.stub.Decode(req, metadata=_md(MALLORY), timeout=30)  # the retry
        pos[layer] += 1
        assert list(reply.positions) == [pos[layer]]
    env.check_control()


def _probe_position(env: Env, sid: str, layer: int) -> int:
    """The server's count for (sid, layer), found from its FAILED_PRECONDITION message."""
    x = random_inputs(1, 1, H, HV)
    try:
        env.stub.Decode(decode_request(layer, [sid], x, positions=[2**62]), metadata=_md(MALLORY), timeout=30)
    except grpc.RpcError as e:
        assert e.code() == C.FAILED_PRECONDITION
        import re

        return int(re.search(r"count (\d+)", e.details()).group(1))
    raise AssertionError("position 2**62 was accepted")


def test_queue_bound_and_cancelled_requests():
    """With the scheduler holding work for 0.6 s (--max-queue-delay-us), the queue fills
    deterministically: rows beyond --max-queue-rows get UNAVAILABLE at once, and a request whose
    deadline passes while it waits never reaches the device."""
    with start_server(*SMALL_MODEL, "--max-queue-rows", "2", "--max-queue-delay-us", "600000") as s, \
            grpc.insecure_channel(s.address) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        sids = [stub.CreateSession(gdn_pb2.CreateSessionRequest()).session_id for _ in range(5)]
        results: dict[int, grpc.StatusCode] = {}

        def call(i: int, delay: float) -> None:
            time.sleep(delay)
            req = decode_request(0, [sids[i]], random_inputs(1, 1, H, HV), positions=[0])
            results[i] = _code(lambda: stub.Decode(req, timeout=30))

        threads = [threading.Thread(target=call, args=(i, 0.05 * i)) for i in range(5)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert [results[i] for i in range(5)] == [C.OK, C.OK, C.UNAVAILABLE, C.UNAVAILABLE, C.UNAVAILABLE]
        assert time.monotonic() - t0 < 5
        # refused requests changed nothing: their first step is still position 0
        for i in (2, 3, 4):
            req = decode_request(0, [sids[i]], random_inputs(1, 1, H, HV), positions=[0])
            assert list(stub.Decode(req, timeout=30).positions) == [1]

        # a request that times out while queued is dropped before the device: the session's
        # count is unchanged, so a step with another T at position 0 applies (a replay would not)
        x1 = random_inputs(1, 1, H, HV)
        req = decode_request(1, [sids[0]], x1, positions=[0])
        assert _code(lambda: stub.Decode(req, timeout=0.2)) == C.DEADLINE_EXCEEDED
        time.sleep(0.8)  # past the scheduler's wait: the cancelled request has been looked at
        x2 = random_inputs(1, 2, H, HV)
        reply = stub.Decode(decode_request(1, [sids[0]], x2, positions=[0]), timeout=30)
        assert list(reply.positions) == [2]
        assert s.proc.poll() is None


def test_a_stream_pipelines_past_its_read_ahead_and_answers_in_order():
    """More requests in flight on one DecodeStream than it reads ahead (MAX_STREAM_IN_FLIGHT):
    the reader waits for room, and every reply comes back, in request order, with its position;
    a bad request in the middle is answered in its place without ending the stream."""
    from gdn_server.limits import MAX_STREAM_IN_FLIGHT

    n = 2 * MAX_STREAM_IN_FLIGHT + 20
    with start_server(*SMALL_MODEL) as s, grpc.insecure_channel(s.address) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        sid = stub.CreateSession(gdn_pb2.CreateSessionRequest()).session_id
        reqs = []
        for i in range(n):
            req = decode_request(i % L, [sid], random_inputs(1, 1, H, HV), positions=[i // L])
            req.request_id = f"r{i}"
            reqs.append(req)
        bad = n // 2  # one more request, in the middle: a session that does not exist
        reqs.insert(bad, decode_request(0, ["no-such-session"], random_inputs(1, 1, H, HV)))
        reqs[bad].request_id = "bad"
        replies = list(stub.DecodeStream(iter(reqs), timeout=60))
    assert [r.request_id for r in replies] == [f"r{i}" for i in range(bad)] + ["bad"] + [f"r{i}" for i in range(bad, n)]
    assert replies[bad].error_code == C.NOT_FOUND.value[0]
    ok = replies[:bad] + replies[bad + 1 :]
    assert all(r.error_code == 0 for r in ok)
    assert [list(r.positions) for r in ok] == [[i // L + 1] for i in range(n)]


def test_a_cancelled_stream_drops_its_queued_requests_before_the_device():
    """A DecodeStream cancelled while its requests wait in the scheduler's queue: none of them
    is applied (the session's count is unchanged), and the server goes on serving."""
    with start_server(*SMALL_MODEL, "--max-queue-delay-us", "600000") as s, grpc.insecure_channel(s.address) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        sid = stub.CreateSession(gdn_pb2.CreateSessionRequest()).session_id
        reqs = [decode_request(layer, [sid], random_inputs(1, 1, H, HV), positions=[0]) for layer in range(L)]
        call = stub.DecodeStream(iter(reqs), timeout=60)
        time.sleep(0.2)  # read and queued, still waiting for the batch
        call.cancel()
        time.sleep(0.8)  # past the scheduler's wait: the queued requests have been looked at
        for layer in range(L):  # position 0 still: nothing of the cancelled stream was applied
            reply = stub.Decode(decode_request(layer, [sid], random_inputs(1, 1, H, HV), positions=[0]), timeout=30)
            assert list(reply.positions) == [1]
        assert s.proc.poll() is None


def test_hostile_positions_and_shapes_of_issue_45(env):
    """A session whose count is near 2^63 cannot step past it (INVALID_ARGUMENT, nothing applied,
    and export still works); a shape of 10,004 dimensions is INVALID_ARGUMENT with a short message,
    not a status too long for the client's metadata."""
    md = _md(MALLORY)
    sid = env.own[0]
    state = list(env.stub.ExportState(gdn_pb2.ExportStateRequest(session_id=sid), metadata=md, timeout=30))
    near = 2**63 - 2
    state[0].header.positions[:] = [near] * L
    state[0].header.checksum = hashlib.sha256(b"".join(c.data for c in state)).hexdigest()
    imported = env.stub.ImportState(iter(state), metadata=md, timeout=30).session_id
    try:
        x = random_inputs(1, 1, H, HV, gen=torch.Generator().manual_seed(3))
        assert env.stub.Decode(decode_request(0, [imported], x, [near]), metadata=md, timeout=30).positions == [near + 1]
        for position in (near + 1, near):  # 2^63 - 1 + 1, or a step of 2 tokens from 2^63 - 2
            x = random_inputs(1, 1 if position > near else 2, H, HV, gen=torch.Generator().manual_seed(4))
            with pytest.raises(grpc.RpcError) as refused:
                env.stub.Decode(decode_request(0, [imported], x, [position]), metadata=md, timeout=30)
            assert refused.value.code() == C.INVALID_ARGUMENT and "2^63" in refused.value.details()
        chunks = list(env.stub.ExportState(gdn_pb2.ExportStateRequest(session_id=imported), metadata=md, timeout=30))
        assert list(chunks[0].header.positions) == [near + 1] + [near] * (L - 1)
    finally:
        env.stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=imported), metadata=md, timeout=30)
    req = decode_request(0, [sid], random_inputs(1, 1, H, HV, gen=torch.Generator().manual_seed(5)))
    req.v.shape[:] = [1] * 10_004
    with pytest.raises(grpc.RpcError) as refused:
        env.stub.Decode(req, metadata=md, timeout=30)
    assert refused.value.code() == C.INVALID_ARGUMENT and len(refused.value.details()) < 300
