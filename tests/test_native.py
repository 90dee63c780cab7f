"""The native decode path (gdn_server/_native.c) against the Python code it stands in for: the same
DecodeWork, or the same InvalidArgument, for valid requests and for requests a little wrong in
every way validation knows (tests/test_protowire.py does the same for the parser's fields)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_server.config import ModelShape
from gdn_server.errors import InvalidArgument
from gdn_server.native import module as native_module
from gdn_server.protowire import (
    ParsedDecodeRequest,
    parse_decode_request,
    parse_decode_request_python,
)
from gdn_server.validation import DEFERRED_CHECK_BYTES, decode_work_from_request
from servers import NATIVE_TRANSPORT_MODE

SHAPE = ModelShape(num_layers=3, num_q_heads=2, num_v_heads=4, head_dim_k=128, head_dim_v=128)
H, HV, K, V = SHAPE.num_q_heads, SHAPE.num_v_heads, SHAPE.head_dim_k, SHAPE.head_dim_v
native_only = pytest.mark.skipif(native_module is None, reason="gdn_server._native is not built here")


def test_native_module_is_built():
    """A checkout installed with `make test` has it (setuptools builds it); GDN_NATIVE=0 turns it off."""
    if os.environ.get("GDN_NATIVE", "1") == "0":
        assert native_module is None
    else:
        assert native_module is not None, "gdn_server._native did not build: is a C compiler installed?"


def _outcome(req, defer: bool):
    try:
        work = decode_work_from_request(req, SHAPE, defer)
    except InvalidArgument as e:
        return ("invalid", str(e))
    raw = None if work.bf16_bytes is None else tuple(bytes(b) for b in work.bf16_bytes)
    tensors = None
    if work.bf16_bytes is None:
        tensors = tuple((t.dtype, tuple(t.shape), t.float().numpy().tobytes()) for t in (work.q, work.k, work.v, work.a, work.b))
    return ("ok", work.layer, work.session_ids, work.positions, work.request_id, work.speculative, raw,
            work.input_dims, work.finite_checked, tensors)


_DTYPES = {gdn_pb2.BF16: torch.bfloat16, gdn_pb2.F16: torch.float16, gdn_pb2.F32: torch.float32}


@st.composite
def near_valid_requests(draw) -> bytes:
    """A valid request of SHAPE, then, drawn at random, one or more things wrong with it."""
    B = draw(st.integers(1, 4))
    speculative = draw(st.booleans())
    T = draw(st.integers(1, SHAPE.max_speculative_tokens if speculative else SHAPE.max_tokens_per_step))
    ids = [f"s{i}" for i in range(B)]
    positions = list(range(B)) if draw(st.booleans()) else []
    req = gdn_pb2.DecodeRequest(layer=draw(st.integers(0, SHAPE.num_layers - 1)), request_id=draw(st.text(max_size=6)),
                                speculative=speculative)
    gen = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dims = {"q": [B, T, H, K], "k": [B, T, H, K], "v": [B, T, HV, V], "a": [B, T, HV], "b": [B, T, HV]}
    for name in ("q", "k", "v", "a", "b"):
        dtype = draw(st.sampled_from([gdn_pb2.BF16] * 6 + [gdn_pb2.F16, gdn_pb2.F32]))
        data = torch.from_numpy(gen.standard_normal(int(np.prod(dims[name])), dtype=np.float32)).to(_DTYPES[dtype])
        getattr(req, name).CopyFrom(gdn_pb2.Tensor(dtype=dtype, shape=dims[name], data=data.numpy().tobytes()
                                                    if dtype != gdn_pb2.BF16 else data.view(torch.int16).numpy().tobytes()))
    for fault in draw(st.lists(st.sampled_from(FAULTS), max_size=2)):
        fault(req, draw, B, T)
    req.session_ids.extend(ids if not req.session_ids else [])
    req.positions.extend(positions if not req.positions else [])
    return req.SerializeToString()


def _wrong_layer(req, draw, B, T):
    req.layer = draw(st.sampled_from([SHAPE.num_layers, SHAPE.num_layers + 1, 2**32 - 1]))


def _bad_ids(req, draw, B, T):
    ids = [f"s{i}" for i in range(B)]
    ids[draw(st.integers(0, B - 1))] = draw(st.sampled_from(["", "x" * 129, "é" * 128, "s0"]))
    req.session_ids.extend(ids if draw(st.booleans()) else [])
    if not req.session_ids:
        req.session_ids.append("")  # an empty id alone


def _bad_dims(req, draw, B, T):
    t = getattr(req, draw(st.sampled_from("qkvab")))
    dims = list(t.shape)
    how = draw(st.sampled_from(["grow", "drop", "add", "zero", "negative", "T"]))
    if len(dims) < 2:  # a missing tensor, or one already cut
        how = "add"
    if how == "grow":
        dims[draw(st.integers(0, len(dims) - 1))] += 1
    elif how == "drop":
        dims.pop()
    elif how == "add":
        dims.append(1)
    elif how == "zero":
        dims[draw(st.integers(0, len(dims) - 1))] = 0
    elif how == "negative":
        dims[0] = -B
    else:
        dims[1] = draw(st.sampled_from([0, SHAPE.max_speculative_tokens + 1, 2**40]))
    del t.shape[:]
    t.shape.extend(dims)


def _short_data(req, draw, B, T):
    t = getattr(req, draw(st.sampled_from("qkvab")))
    if t.data:
        t.data = t.data[: draw(st.integers(0, len(t.data) - 1))]


def _nonfinite(req, draw, B, T):
    t = getattr(req, draw(st.sampled_from("qkvab")))
    if t.dtype != gdn_pb2.BF16 or len(t.data) < 2:
        return
    data = bytearray(t.data)
    at = 2 * draw(st.integers(0, len(data) // 2 - 1))
    word = draw(st.sampled_from([0x7F80, 0xFF80, 0x7FC0, 0xFFFF, 0x7F81]))  # Inf, -Inf, NaNs
    data[at:at + 2] = word.to_bytes(2, "little")
    t.data = bytes(data)


def _bad_dtype(req, draw, B, T):
    getattr(req, draw(st.sampled_from("qkvab"))).dtype = draw(st.sampled_from([0, 7]))


def _missing(req, draw, B, T):
    req.ClearField(draw(st.sampled_from("qkvab")))


def _positions(req, draw, B, T):
    req.positions.extend(range(draw(st.sampled_from([B + 1, max(B - 1, 1) if B > 1 else 2]))))


FAULTS = [_wrong_layer, _bad_ids, _bad_dims, _short_data, _nonfinite, _bad_dtype, _missing, _positions]


@native_only
@settings(max_examples=400, deadline=None)
@given(data=near_valid_requests(), defer=st.booleans())
def test_native_validation_agrees_with_python(data, defer):
    native_req = parse_decode_request(data)
    python_req = parse_decode_request_python(data)
    assert _outcome(native_req, defer) == _outcome(python_req, defer)


@native_only
def test_valid_bf16_steps_take_the_native_path():
    """Not a check that can pass by falling back: the common request is parsed and checked in C."""
    B, T = 3, 1
    gen = torch.Generator().manual_seed(1)
    req = gdn_pb2.DecodeRequest(layer=2, session_ids=["a", "b", "c"], positions=[4, 5, 6], request_id="r1")
    for name, dims in (("q", [B, T, H, K]), ("k", [B, T, H, K]), ("v", [B, T, HV, V]), ("a", [B, T, HV]), ("b", [B, T, HV])):
        x = torch.randn(dims, generator=gen).bfloat16()
        getattr(req, name).CopyFrom(gdn_pb2.Tensor(dtype=gdn_pb2.BF16, shape=dims, data=x.view(torch.int16).numpy().tobytes()))
    parsed = parse_decode_request(req.SerializeToString())
    assert type(parsed) is ParsedDecodeRequest
    assert native_module.check_bf16_step(parsed, (3, H, HV, K, V, 4, 8, 128), DEFERRED_CHECK_BYTES) == 1
    assert native_module.check_bf16_step(parsed, (3, H, HV, K, V, 4, 8, 128), 16) == 2  # over the check's limit
    assert native_module.check_bf16_step(parsed, (2, H, HV, K, V, 4, 8, 128), DEFERRED_CHECK_BYTES) == 0  # layer 2 of 2
    work = decode_work_from_request(parsed, SHAPE)
    assert (work.layer, work.session_ids, work.positions, work.request_id) == (2, ("a", "b", "c"), (4, 5, 6), "r1")
    assert torch.equal(work.v, torch.frombuffer(bytearray(req.v.data), dtype=torch.bfloat16).view(B, T, HV, V))


@native_only
def test_big_bf16_step_leaves_its_finite_check_to_the_backend_only_when_deferred():
    B = DEFERRED_CHECK_BYTES // (2 * (2 * H * K + HV * V + 2 * HV)) + 1
    req = gdn_pb2.DecodeRequest(layer=0, session_ids=[f"s{i}" for i in range(B)])
    for name, dims in (("q", [B, 1, H, K]), ("k", [B, 1, H, K]), ("v", [B, 1, HV, V]), ("a", [B, 1, HV]), ("b", [B, 1, HV])):
        getattr(req, name).CopyFrom(gdn_pb2.Tensor(dtype=gdn_pb2.BF16, shape=dims, data=bytes(2 * int(np.prod(dims)))))
    req.v.data = req.v.data[:-2] + (0x7F80).to_bytes(2, "little")  # Inf, the last value
    parsed = parse_decode_request(req.SerializeToString())
    assert type(parsed) is ParsedDecodeRequest and isinstance(parsed.q.data, memoryview)
    assert decode_work_from_request(parsed, SHAPE, defer_finite_check=True).finite_checked is False
    with pytest.raises(InvalidArgument, match="v has NaN or Inf"):
        decode_work_from_request(parsed, SHAPE, defer_finite_check=False)


def test_of_bf16_builds_what_the_dataclass_does():
    from gdn_server.work import DecodeWork

    raw = tuple(bytes(2 * n) for n in (4, 4, 8, 2, 2))
    dims = ((1, 2, 1, 2), (1, 2, 1, 2), (1, 2, 1, 4), (1, 2, 1), (1, 2, 1))
    args = dict(layer=1, session_ids=("s",), positions=(3,), request_id="r", speculative=True, bf16_bytes=raw,
                input_dims=dims, finite_checked=False)
    fast, slow = DecodeWork.of_bf16(**args), DecodeWork(**args)
    assert fast.__dict__ == slow.__dict__ and fast.tokens == 2 and fast.rows == 1
    assert torch.equal(fast.v, slow.v) and fast.owner is None


@native_only
@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(0, 5), tail=st.lists(st.integers(0, 300), min_size=1, max_size=3),
    positions=st.lists(st.integers(0, 2**64 - 1), max_size=5), request_id=st.text(max_size=20),
    view=st.booleans(), threaded=st.booleans(),
)
def test_native_reply_is_protobufs_bytes(rows, tail, positions, request_id, view, threaded):
    import gdn_server.decode_rpcs as decode_rpcs
    from gdn_server.decode_rpcs import (
        decode_response,
        encode_decode_response,
        encode_decode_response_python,
    )
    from gdn_server.work import DecodeResult

    if threaded:  # every output counts as big: copied on several threads
        saved = decode_rpcs.THREADED_COPY_BYTES, decode_rpcs.COPY_THREADS
        decode_rpcs.THREADED_COPY_BYTES, decode_rpcs.COPY_THREADS = 0, 3

    shape = (rows, *tail)
    out = bytes(np.random.default_rng(rows).integers(0, 256, 2 * int(np.prod(shape)), dtype=np.uint8))
    result = DecodeResult(memoryview(out) if view else out, shape, tuple(positions), request_id)
    try:
        wire, at = encode_decode_response(result)
    finally:
        if threaded:
            decode_rpcs.THREADED_COPY_BYTES, decode_rpcs.COPY_THREADS = saved
    assert (wire, at) == encode_decode_response_python(result)
    assert wire == decode_response(result).SerializeToString()
    assert wire[at : at + len(out)] == out


@native_only
@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(st.integers(1, 3), min_size=1, max_size=6),
    kinds=st.lists(st.sampled_from(["bf16", "f32", "unchecked", "bad"]), min_size=6, max_size=6),
    small_limits=st.booleans(), threads=st.integers(1, 4), fill_threaded=st.booleans(), padding=st.integers(0, 3),
)
def test_native_fill_matches_python(rows, kinds, small_limits, threads, fill_threaded, padding):
    """Small checked bf16 requests are copied in one C call (on `threads` threads where
    `fill_threaded`); unchecked ones (some with a NaN or Inf: "bad") are checked as they are
    copied, and f32 ones are left to torch: the buffer is the Python fill's, and the culprits are
    those the staged-copy check names. A plan with `padding` rows more than the batch (a padded
    launch) gets slot -1 and layer 0 there."""
    import gdn_server.backends.staging as staging
    from gdn_server.work import DecodeWork, StepBatch

    shape = ModelShape(num_layers=2, num_q_heads=1, num_v_heads=2, head_dim_k=128, head_dim_v=128)
    gen = torch.Generator().manual_seed(sum(rows))
    batch, want_found = StepBatch(tokens=1), {}
    for i, (n, kind) in enumerate(zip(rows, kinds)):
        dims = ((n, 1, 1, 128), (n, 1, 1, 128), (n, 1, 2, 128), (n, 1, 2), (n, 1, 2))
        xs = [torch.randn(d, generator=gen).bfloat16() for d in dims]
        if kind == "bad":
            culprit = i % 5
            xs[culprit].view(-1)[n] = float("nan") if i % 2 else float("-inf")
            xs[4].view(-1)[0] = float("inf")  # a later input too: the first is named
            want_found[i] = "qkvab"[culprit]
        ids = tuple(f"w{i}r{r}" for r in range(n))
        if kind == "f32":
            work = DecodeWork(layer=0, session_ids=ids, q=xs[0].float(), k=xs[1].float(), v=xs[2].float(),
                              a=xs[3].float(), b=xs[4].float())
        else:
            raw = tuple(x.view(torch.int16).numpy().tobytes() for x in xs)
            work = DecodeWork.of_bf16(0, ids, None, "", False, raw, dims, kind == "bf16")
        batch.add(work, list(range(batch.rows, batch.rows + n)))
    plan = staging.make_plan(shape, batch.rows + padding, 1)
    bufs, founds = [], []
    for use_native in (False, True):
        buf = torch.zeros(plan.total, dtype=torch.uint8)
        host_bytes = buf.numpy()
        views = {name: staging.carve(buf, plan.entries[name]) for name in staging.INPUTS}
        names = ("native", "PARALLEL_COPY_BYTES", "THREADED_COPY_BYTES", "COPY_THREADS", "FILL_THREADED_BYTES",
                 "FILL_THREADS")
        saved = [getattr(staging, name) for name in names]
        staging.native = native_module if use_native else None
        if small_limits:  # pieces count as big: copied on `threads` threads
            staging.PARALLEL_COPY_BYTES, staging.THREADED_COPY_BYTES, staging.COPY_THREADS = 300, 300, threads
        if fill_threaded:  # the small ones on `threads` threads too, whatever their total
            staging.FILL_THREADED_BYTES, staging.FILL_THREADS = 0, threads
        try:
            founds.append(staging.fill(batch, plan, memoryview(host_bytes), host_bytes, views))
        finally:
            for name, value in zip(names, saved):
                setattr(staging, name, value)
        bufs.append(buf)
    assert torch.equal(bufs[0], bufs[1])
    assert founds[0] is None and founds[1] == want_found
    slots = staging.carve(bufs[1], plan.entries["slots"])
    layers = staging.carve(bufs[1], plan.entries["layers"])
    assert slots.tolist() == list(range(batch.rows)) + [-1] * padding
    assert layers.tolist() == [0] * (batch.rows + padding)


@native_only
@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 3000), min_size=1, max_size=6), threads=st.integers(1, 9),
       bad=st.lists(st.integers(0, 10**6), max_size=3), checks=st.lists(st.booleans(), min_size=6, max_size=6))
def test_copy_bf16_spans(lengths, threads, bad, checks):
    rng = np.random.default_rng(sum(lengths))
    srcs = [bytearray(rng.standard_normal(n, dtype=np.float32).astype(np.float32).view(np.uint32).__rshift__(16)
                      .astype(np.uint16).tobytes()) for n in lengths]
    for at in bad:  # a NaN or Inf somewhere
        i = at % len(srcs)
        if srcs[i]:
            j = 2 * (at % (len(srcs[i]) // 2))
            srcs[i][j:j + 2] = (0x7F80 | (at & 0x8000) | (at % 3)).to_bytes(2, "little")
    offsets, end = [], 7 * 2  # spans apart, with gaps the copy must not touch
    for src in srcs:
        offsets.append(end)
        end += len(src) + 6
    dst = bytearray(b"\xee" * (end + 10))
    spans = [(off, bytes(src), check) for off, src, check in zip(offsets, srcs, checks)]
    found = native_module.copy_bf16_spans(dst, spans, threads)
    want = bytearray(b"\xee" * (end + 10))
    for off, src, _ in spans:
        want[off:off + len(src)] = src
    assert dst == want
    words = [np.frombuffer(src, dtype=np.uint16) for src in srcs]
    assert found == [bool(check and ((w & 0x7F80) == 0x7F80).any()) for w, check in zip(words, checks)]


@native_only
def test_copy_bf16_spans_refuses_what_does_not_fit():
    dst = bytearray(16)
    with pytest.raises(ValueError):
        native_module.copy_bf16_spans(dst, [(10, b"12345678", False)], 2)
    with pytest.raises(ValueError):
        native_module.copy_bf16_spans(dst, [(0, b"123", False)], 2)
    with pytest.raises(TypeError):
        native_module.copy_bf16_spans(b"read-only", [(0, b"12", False)], 2)


@pytest.mark.skipif(NATIVE_TRANSPORT_MODE, reason="--frontend-transport native needs the native module")
def test_servers_with_and_without_the_native_module_answer_alike():
    """A real server on the Python path (GDN_NATIVE=0) and one on the native path: the same
    replies byte for byte over a stream of good steps, and the same errors for bad ones."""
    import grpc

    from gdn_client.proto.gdn.v1 import gdn_pb2_grpc
    from servers import start_server
    from util import decode_request, random_inputs

    B, T = 3, 2
    gen = torch.Generator().manual_seed(11)
    steps = [random_inputs(B, T, H, HV, gen=gen, dtype=torch.bfloat16) for _ in range(3)]
    bad = {n: x.clone() for n, x in steps[0].items()}
    bad["k"][1, 0, 0, 5] = float("nan")
    answers = []
    for native_flag in ("0", "1"):
        with start_server("--layers", "3", "--q-heads", str(H), "--v-heads", str(HV),
                          env={"GDN_NATIVE": native_flag}) as srv, grpc.insecure_channel(srv.address) as ch:
            stub = gdn_pb2_grpc.GdnDecodeStub(ch)
            ids = [stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=30).session_id for _ in range(B)]
            requests = [decode_request(layer, ids, x, positions=[i // 3 * T] * B, request_id=f"r{i}")
                        for i, (layer, x) in enumerate((layer, x) for x in steps for layer in range(3))]
            requests.insert(4, decode_request(1, ids, bad, positions=[0] * B, request_id="bad"))  # an error reply
            replies = list(stub.DecodeStream(iter(requests), timeout=60))
            got = [r.SerializeToString() for r in replies]
            with pytest.raises(grpc.RpcError) as err:
                stub.Decode(decode_request(7, ids, steps[0]), timeout=30)
            answers.append((got, err.value.code(), err.value.details()))
    assert answers[0] == answers[1]
    assert b"k has NaN or Inf" in answers[0][0][4] and answers[0][1] == grpc.StatusCode.INVALID_ARGUMENT


@native_only
def test_threaded_copies_from_many_threads_at_once_and_after_fork():
    """The copy threads are kept between calls: calls from several Python threads at once (two
    schedulers, say) each get their own bytes right, and a forked child (its parent's copy threads
    do not exist there) copies without hanging."""
    import os
    import threading

    rng = np.random.default_rng(5)
    srcs = [(rng.standard_normal(50_000, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
            for _ in range(6)]
    srcs[3] = srcs[3][:1000] + (0x7FC0).to_bytes(2, "little") + srcs[3][1002:]  # a NaN in one

    def copy_and_check(threads: int) -> bool:
        dst = bytearray(sum(map(len, srcs)))
        offsets = np.cumsum([0, *map(len, srcs[:-1])]).tolist()
        found = native_module.copy_bf16_spans(dst, [(o, s, True) for o, s in zip(offsets, srcs)], threads)
        return bytes(dst) == b"".join(srcs) and found == [False, False, False, True, False, False]

    assert copy_and_check(4)  # the pool exists from here on
    results = []
    workers = [threading.Thread(target=lambda t=t: results.extend(copy_and_check(t) for _ in range(20)))
               for t in (1, 2, 3, 4, 8, 8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert not any(w.is_alive() for w in workers) and len(results) == 120 and all(results)

    pid = os.fork()
    if pid == 0:  # the child: exit status says whether its threaded copy was right
        os._exit(0 if copy_and_check(4) else 1)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("a threaded copy hung in a forked child")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


_NATIVE_STATE_LOG = """
import logging, sys
class _HideNative:  # as if no C compiler had been there at install time
    def find_spec(self, name, path=None, target=None):
        if name == "gdn_server._native":
            raise ImportError("hidden by the test")
if sys.argv[1] == "hidden":
    sys.meta_path.insert(0, _HideNative())
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
from gdn_server import native
native.log_state(logging.getLogger("gdn_server.cli"))
"""


@pytest.mark.parametrize(
    ("case", "env", "expected"),
    [
        ("hidden", {}, "WARNING gdn_server._native is not built"),
        ("plain", {"GDN_NATIVE": "0"}, "INFO native decode path turned off (GDN_NATIVE=0)"),
    ],
)
def test_server_says_when_the_python_decode_path_runs(case, env, expected):
    """A server without the C module runs at about half the throughput; its log says so at start,
    with or without --frontends (a warning where the module is missing, a plain line where
    GDN_NATIVE=0 asked for it)."""
    out = subprocess.run([sys.executable, "-c", _NATIVE_STATE_LOG, case], capture_output=True, text=True,
                         check=False, timeout=120, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(expected), out.stdout


@native_only
def test_server_says_the_native_decode_path_runs():
    env = {k: v for k, v in os.environ.items() if k != "GDN_NATIVE"}
    out = subprocess.run([sys.executable, "-c", _NATIVE_STATE_LOG, "plain"], capture_output=True, text=True,
                         check=False, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("INFO native decode path: gdn_server._native"), out.stdout


@native_only
def test_driver_launch_functions_say_what_is_wrong():
    """_native_cuda.c's calls refuse bad arguments before touching the driver, and where there is
    no driver (this suite's CI host) they say so instead of crashing; with one, the thread has no
    current context until CUDA is used on it."""
    with pytest.raises(TypeError, match="takes 4 arguments"):
        native_module.cuda_launch_graph(0, 1, 0)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        native_module.cuda_event_query(0)
    with pytest.raises(TypeError):
        native_module.cuda_event_query(0, "not a handle")
    try:
        context = native_module.cuda_current_context()
    except RuntimeError as e:  # no driver: every call says why
        assert "libcuda.so.1" in str(e)
        for call in (lambda: native_module.cuda_launch_graph(0, 1, 0, 1), lambda: native_module.cuda_event_query(0, 1)):
            with pytest.raises(RuntimeError, match="libcuda.so.1"):
                call()
        return
    assert isinstance(context, int)
    with pytest.raises(ValueError, match="null"):  # never handed to the driver
        native_module.cuda_launch_graph(context, 0, 0, 1)
    with pytest.raises(ValueError, match="null"):
        native_module.cuda_event_query(context, 0)
