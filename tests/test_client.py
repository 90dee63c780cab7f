"""The client library against a real CPU server (small model, weights written by the test)."""
from __future__ import annotations

import asyncio
from typing import Any, Iterator

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from gdn_client import (
    AsyncClient,
    Client,
    ClientOptions,
    FailedPreconditionError,
    GdnError,
    InvalidArgumentError,
    NotFoundError,
)
from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_client.wire import tensor_to_proto
from servers import start_server
from util import random_inputs
from reference import gdn_reference_step, rel_err

L, H, HV, K = 3, 2, 4, 128
MODEL = ("--layers", str(L), "--q-heads", str(H), "--v-heads", str(HV), "--head-dim", str(K))
TOL = 1e-2


@pytest.fixture(scope="module")
def gates(tmp_path_factory) -> tuple[torch.Tensor, torch.Tensor, str]:
    """A_log, dt_bias [L, HV] chosen so the state decays slowly (the reference then matters)."""
    gen = torch.Generator().manual_seed(11)
    A_log = torch.log(torch.empty(L, HV).uniform_(0.05, 0.5, generator=gen))
    dt_bias = torch.empty(L, HV).uniform_(-2.0, 0.0, generator=gen)
    path = tmp_path_factory.mktemp("weights") / "gates.safetensors"
    tensors = {}
    for i in range(L):
        tensors[f"layers.{i}.A_log"] = A_log[i].contiguous()
        tensors[f"layers.{i}.dt_bias"] = dt_bias[i].contiguous()
    save_file(tensors, str(path))
    return A_log, dt_bias, str(path)


@pytest.fixture(scope="module")
def server(gates) -> Iterator[Any]:
    with start_server(*MODEL, "--max-sessions", "64", "--weights", gates[2]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> Iterator[Client]:
    with Client(server.address, ClientOptions(timeout=20)) as c:
        yield c


def inputs(T: int, B: int | None = None, seed: int = 0) -> list[torch.Tensor]:
    """Random q, k, v, a, b (float32), per-session [T, ...] or batched [B, T, ...]."""
    gen = torch.Generator().manual_seed(seed)
    lead = (T,) if B is None else (B, T)
    shapes = [(H, K), (H, K), (HV, K), (HV,), (HV,)]
    return [torch.randn(*lead, *s, generator=gen) for s in shapes]


class Reference:
    """The reference state of some sessions at every layer (float32, rounded to bf16 per step)."""

    def __init__(self, gates, B: int = 1) -> None:
        self.A_log, self.dt_bias = gates[0], gates[1]
        self.state = torch.zeros(L, B, HV, K, K)

    def step(self, layer: int, q, k, v, a, b, rows=None) -> torch.Tensor:
        """Batched [B, T, ...] inputs, as the server sees them (after the wire dtype)."""
        rows = slice(None) if rows is None else rows
        S = self.state[layer, rows]
        Bn = S.shape[0]
        o, new = gdn_reference_step(
            S, q, k, v, a, b,
            self.A_log[layer].expand(Bn, HV), self.dt_bias[layer].expand(Bn, HV),
            dtype=torch.float32,
        )
        self.state[layer, rows] = new.to(torch.bfloat16).float()
        return o


def as_sent(x) -> torch.Tensor:
    """The float values the server receives for an input (numpy or torch, any wire dtype)."""
    t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    return t.float()


def test_the_package_exports_every_name_it_lists_and_the_stubs_load_no_torch():
    """gdn_client's names load on first use: every name in __all__ resolves, an unknown one is an
    AttributeError, and the stubs and their checks come without torch."""
    import subprocess
    import sys

    import gdn_client

    assert sorted(gdn_client.__all__) == sorted(gdn_client._EXPORTS)
    for name in gdn_client.__all__:
        assert getattr(gdn_client, name).__name__ == name
    with pytest.raises(AttributeError):
        gdn_client.NoSuchName  # noqa: B018
    code = "import sys, gdn_client.proto.gdn.v1.gdn_pb2, gdn_client.proto.checks; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_model_info(client):
    info = client.model_info()
    assert (info.num_layers, info.num_q_heads, info.num_v_heads, info.head_dim_k, info.head_dim_v) == (L, H, HV, K, K)
    assert info.backend == "cpu-torch" and info.max_sessions == 64 and info.max_tokens_per_step >= 4


def test_session_context_manager_closes(client):
    with client.session() as s:
        o = s.decode(0, *inputs(1))
        assert o.shape == (1, HV, K) and o.dtype == torch.bfloat16
        sid = s.id
    assert s.closed
    with pytest.raises(NotFoundError) as info:
        client.close_session(sid)  # the server no longer knows it
    assert info.value.code == grpc.StatusCode.NOT_FOUND and isinstance(info.value, GdnError)
    assert info.value.__suppress_context__  # raised from None
    with pytest.raises(GdnError) as info:
        s.decode(0, *inputs(1))
    assert info.value.code == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("T", [1, 3])
def test_decode_matches_reference(client, gates, T):
    ref = Reference(gates)
    with client.session() as s:
        for step in range(3):
            for layer in range(L):
                x = [t.to(torch.bfloat16) for t in inputs(T, seed=100 * step + layer)]
                o = s.decode(layer, *x)
                want = ref.step(layer, *(t.float()[None] for t in x))[0]
                assert o.shape == (T, HV, K) and o.dtype == torch.bfloat16
                assert rel_err(o, want) < TOL, (step, layer)
        assert s.positions == {layer: 3 * T for layer in range(L)}


@pytest.mark.parametrize(
    "convert",
    [
        lambda t: t.to(torch.bfloat16),
        lambda t: t.to(torch.float16),
        lambda t: t,
        lambda t: t.numpy().astype(np.float16),
        lambda t: t.numpy().astype(np.float32),
    ],
    ids=["torch-bf16", "torch-f16", "torch-f32", "numpy-f16", "numpy-f32"],
)
def test_input_dtypes(client, gates, convert):
    ref = Reference(gates)
    with client.session() as s:
        for step in range(2):
            x = [convert(t) for t in inputs(2, seed=7 + step)]
            o = s.decode(1, *x)
            want = ref.step(1, *(as_sent(t)[None] for t in x))[0]
            assert o.dtype == torch.bfloat16 and rel_err(o, want) < TOL


def test_batched_form_accepted_for_one_session(client, gates):
    ref = Reference(gates)
    with client.session() as s:
        x = [t[None] for t in inputs(2, seed=3)]  # [1, T, ...]
        o = s.decode(0, *x)
        assert o.shape == (2, HV, K)
        assert rel_err(o, ref.step(0, *x)[0]) < TOL


def test_decode_batch(client, gates):
    B, T = 3, 2
    ref = Reference(gates, B)
    sessions = [client.create_session() for _ in range(B)]
    try:
        for step in range(2):
            x = inputs(T, B, seed=50 + step)
            o = client.decode_batch(2, sessions, *x)
            assert o.shape == (B, T, HV, K) and o.dtype == torch.bfloat16
            want = ref.step(2, *x)
            for i in range(B):
                assert rel_err(o[i], want[i]) < TOL, i
        assert [s.positions for s in sessions] == [{2: 2 * T}] * B
        with pytest.raises(ValueError):
            client.decode_batch(2, sessions, *inputs(T, B - 1))  # B mismatch caught before sending
    finally:
        for s in sessions:
            s.close()


def test_outputs_are_the_callers_own_memory():
    # replies are decoded without a copy: each output must still be independent and writable
    from gdn_client._steps import SessionCursor, prepare_step

    x = [torch.zeros(1, 1, H, K), torch.zeros(1, 1, H, K), torch.zeros(1, 1, HV, K), torch.zeros(1, 1, HV),
         torch.zeros(1, 1, HV)]
    want = torch.randn(1, 1, HV, K).bfloat16()
    reply = gdn_pb2.DecodeResponse(o=tensor_to_proto(want), positions=[1])
    first = prepare_step(0, [SessionCursor("a")], *x, single=False).complete(reply)
    second = prepare_step(0, [SessionCursor("b")], *x, single=False).complete(reply)
    first += 1
    assert torch.equal(second, want) and torch.equal(first, want + 1)
    assert reply.o.data == tensor_to_proto(want).data  # the reply message is untouched


def test_decode_batch_is_atomic(client):
    with client.session() as good, client.session() as gone:
        gone.close()
        gone._cursor.closed = False  # let the client send it, so the server is the one refusing
        with pytest.raises(NotFoundError):
            client.decode_batch(0, [good, gone], *inputs(1, 2))
        assert good.positions == {}
        good.decode(0, *inputs(1))  # position 0 still: nothing was applied
        assert good.positions == {0: 1}
        gone._cursor.closed = True


def test_server_errors_map_to_gdn_error(client):
    with client.session() as s:
        bad = inputs(1)
        bad[2] = torch.randn(1, HV, 64)  # wrong V
        with pytest.raises(InvalidArgumentError) as info:
            s.decode(0, *bad)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.message
        nan = inputs(1)
        nan[0][0, 0, 0] = float("nan")
        with pytest.raises(InvalidArgumentError):
            s.decode(0, *nan)
        assert s.positions == {}  # both rolled back
        s.decode(0, *inputs(1))
        assert s.positions == {0: 1}


def test_stream_pipelined_with_error_in_middle(client, gates):
    ref = Reference(gates)
    with client.session() as s, client.stream() as st:
        sent, futs = [], []
        for i in range(6):
            layer = i % 2  # layers 0 and 1, three tokens each
            x = inputs(1, seed=200 + i)
            futs.append(st.submit(layer, s, *x))
            sent.append((layer, x))
            if i == 2:  # a bad step on another layer, in the middle of the pipeline
                bad = inputs(1)
                bad[0] = torch.randn(1, H, 64)
                futs.append(st.submit(2, s, *bad))
                sent.append((2, None))
        for (layer, x), fut in zip(sent, futs):
            if x is None:
                with pytest.raises(InvalidArgumentError):
                    fut.result(timeout=20)
                continue
            o = fut.result(timeout=20)
            assert rel_err(o, ref.step(layer, *(t[None] for t in x))[0]) < TOL
        assert s.positions == {0: 3, 1: 3}
        # the stream is still usable after the error, including the layer that failed
        o = st.submit(2, s, *inputs(1, seed=9)).result(timeout=20)
        assert rel_err(o, ref.step(2, *(t[None] for t in inputs(1, seed=9)))[0]) < TOL


def test_stream_batched_and_many_in_flight(client):
    sessions = [client.create_session() for _ in range(2)]
    try:
        with client.stream() as st:
            futs = [st.submit(i % L, sessions, *inputs(1, 2, seed=i)) for i in range(3 * L)]
            outs = [f.result(timeout=20) for f in futs]
        assert all(o.shape == (2, 1, HV, K) for o in outs)
        assert [s.positions for s in sessions] == [{0: 3, 1: 3, 2: 3}] * 2
    finally:
        for s in sessions:
            s.close()


def test_retry_with_same_positions_applies_once(server, client):
    """The wire-level contract the client's retries rely on."""
    stub = gdn_pb2_grpc.GdnDecodeStub(client._channel)
    with client.session() as s:
        def request(pos: int, T: int = 1, seed: int = 0) -> gdn_pb2.DecodeRequest:
            req = gdn_pb2.DecodeRequest(layer=0, session_ids=[s.id], positions=[pos])
            for name, t in zip("qkvab", inputs(T, 1, seed=seed)):
                tensor_to_proto(t, getattr(req, name))
            return req

        first = stub.Decode(request(0), timeout=20)
        again = stub.Decode(request(0), timeout=20)  # the same step, resent
        assert list(first.positions) == [1] and list(again.positions) == [1]
        assert first.o.data == again.o.data
        with pytest.raises(grpc.RpcError) as info:
            stub.Decode(request(0, T=2), timeout=20)  # not a retry: T differs
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as info:
            stub.Decode(request(5), timeout=20)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        nxt = stub.Decode(request(1, seed=1), timeout=20)
        assert list(nxt.positions) == [2]


class _LoseReplies(grpc.UnaryUnaryClientInterceptor):
    """Lets Decode calls reach the server, then reports the first ``n`` as UNAVAILABLE."""

    class Lost(grpc.RpcError, grpc.Call):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "reply lost (test)"

        def initial_metadata(self): ...
        def trailing_metadata(self): ...
        def is_active(self): return False
        def time_remaining(self): return None
        def cancel(self): return False
        def add_callback(self, cb): return False

    def __init__(self, n: int) -> None:
        self.n = n
        self.sent = 0
        self.metadata: list = []

    def intercept_unary_unary(self, continuation, details, request):
        self.metadata.append(tuple(details.metadata or ()))
        outcome = continuation(details, request)
        if details.method.endswith("/Decode"):
            self.sent += 1
            outcome.result()  # the server applied it
            if self.n > 0:
                self.n -= 1
                raise self.Lost()
        return outcome


def test_client_retries_lost_reply_without_applying_twice(server, gates):
    lose = _LoseReplies(n=2)
    opts = ClientOptions(timeout=20, max_attempts=3, backoff_initial=0.01, token="t0k", interceptors=[lose])
    ref = Reference(gates)
    with Client(server.address, opts) as c, c.session() as s:
        for step in range(2):
            x = inputs(1, seed=300 + step)
            o = s.decode(0, *x)
            assert rel_err(o, ref.step(0, *(t[None] for t in x))[0]) < TOL  # fails if applied twice
        assert lose.sent == 4 and s.positions == {0: 2}
    assert all(("authorization", "Bearer t0k") in md for md in lose.metadata)


def test_step_in_doubt_after_last_retry_is_recovered(server, gates):
    lose = _LoseReplies(n=1)
    ref = Reference(gates)
    with Client(server.address, ClientOptions(timeout=20, max_attempts=1, interceptors=[lose])) as c:
        with c.session() as s:
            x = inputs(1, seed=400)
            with pytest.raises(GdnError) as info:
                s.decode(0, *x)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(FailedPreconditionError):  # refuses to guess the position
                s.decode(0, *inputs(1))
            (o,) = s.recover()  # resends the same step: answered, not applied again
            assert rel_err(o[None], ref.step(0, *(t[None] for t in x))) < TOL
            x2 = inputs(1, seed=401)
            assert rel_err(s.decode(0, *x2), ref.step(0, *(t[None] for t in x2))[0]) < TOL
            assert s.positions == {0: 2}


def test_async_client(server, gates):
    ref = Reference(gates, B=2)

    async def main() -> None:
        async with AsyncClient(server.address, ClientOptions(timeout=20)) as c:
            info = await c.model_info()
            assert info.num_layers == L
            async with c.session() as s1, c.session() as s2:
                x = inputs(2, seed=500)
                o = await s1.decode(0, *x)
                assert rel_err(o, ref.step(0, *(t[None] for t in x), rows=slice(0, 1))[0]) < TOL
                xb = inputs(1, 2, seed=501)
                ob = await c.decode_batch(1, [s1, s2], *xb)
                assert rel_err(ob, ref.step(1, *xb)) < TOL
                async with c.stream() as st:
                    xs = [inputs(1, seed=510 + i) for i in range(3)]
                    futs = [st.submit(2, s2, *x) for x in xs]
                    bad = st.submit(2, s1, *inputs(1)[:2], torch.randn(1, HV, 8), *inputs(1)[3:])
                    outs = await asyncio.gather(*futs)
                    with pytest.raises(InvalidArgumentError):
                        await bad
                for x, o in zip(xs, outs):
                    assert rel_err(o, ref.step(2, *(t[None] for t in x), rows=slice(1, 2))[0]) < TOL
                assert s2.positions == {1: 1, 2: 3}
                sid = s1.id
            with pytest.raises(NotFoundError):
                await c.close_session(sid)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_options_validate():
    with pytest.raises(ValueError):
        ClientOptions(max_attempts=0)
    with pytest.raises(ValueError):
        ClientOptions(private_key=b"k")
    assert ClientOptions(root_certificates=b"pem").secure
    assert ClientOptions(token="x").call_metadata() == (("authorization", "Bearer x"),)


@pytest.mark.parametrize("own", [False, True])
def test_own_connection_gives_each_client_its_own(own):
    """grpc puts a process's alike channels on one connection; own_connection=True gives each
    client its own (without auth the server's per-client limits count per connection). Both
    clients count."""
    from concurrent import futures

    peers: set[str] = set()

    def get_stats(request: bytes, context: grpc.ServicerContext) -> bytes:
        peers.add(context.peer())
        return gdn_pb2.Stats(requests=1).SerializeToString()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "gdn.v1.GdnDecode", {"GetStats": grpc.unary_unary_rpc_method_handler(get_stats)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        target, options = f"127.0.0.1:{port}", ClientOptions(timeout=10.0, own_connection=own)
        clients = [Client(target, options) for _ in range(3)]
        assert all(c.stats().requests == 1 for c in clients)

        async def three_async_clients() -> None:
            async_clients = [AsyncClient(target, options) for _ in range(3)]
            for c in async_clients:
                assert (await c.stats()).requests == 1
            for c in async_clients:
                await c.close()

        asyncio.run(three_async_clients())
        for c in clients:
            c.close()
    finally:
        server.stop(None)
    # the sync clients' and the async clients' channels never share one (grpc.aio has its own)
    assert len(peers) == (6 if own else 2)


def test_unreachable_server_raises_unavailable():
    opts = ClientOptions(timeout=1, max_attempts=2, backoff_initial=0.01)
    with Client("127.0.0.1:1", opts) as c:
        with pytest.raises(GdnError) as info:
            c.model_info()
    assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class _BreakFirstStream(grpc.StreamStreamClientInterceptor):
    """Cuts the first DecodeStream with UNAVAILABLE after ``after`` replies (a connection reset)."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.calls = 0

    def intercept_stream_stream(self, continuation, details, request_iterator):
        call = continuation(details, request_iterator)
        self.calls += 1
        return call if self.calls > 1 else _Breaking(call, self.after)


class _Breaking:
    def __init__(self, call, after: int) -> None:
        self.call, self.left = call, after

    def __iter__(self):
        return self

    def __next__(self):
        if self.left == 0:
            self.call.cancel()
            raise _LoseReplies.Lost()
        self.left -= 1
        return next(self.call)

    def cancel(self):
        return self.call.cancel()


def test_stream_reopens_and_resends_after_reset(server, gates):
    brk = _BreakFirstStream(after=1)
    ref = Reference(gates)
    opts = ClientOptions(timeout=20, backoff_initial=0.01, interceptors=[brk])
    with Client(server.address, opts) as c, c.session() as s, c.stream() as st:
        for token in range(2):  # one step in flight per layer, as a decoder pipelines
            xs = [inputs(1, seed=600 + 10 * token + layer) for layer in range(L)]
            futs = [st.submit(layer, s, *x) for layer, x in enumerate(xs)]
            for layer, (x, fut) in enumerate(zip(xs, futs)):
                o = fut.result(timeout=20)
                assert rel_err(o, ref.step(layer, *(t[None] for t in x))[0]) < TOL, (token, layer)
        assert brk.calls == 2 and s.positions == {0: 2, 1: 2, 2: 2}


def test_async_client_speculates_forks_and_moves_sessions(tmp_path):
    """The asyncio client has the session operations of the blocking one, speculate() and the
    ReplicaSet included."""
    from gdn_client import AsyncClient, AsyncReplicaSet

    flags = ("--layers", "2", "--q-heads", "2", "--v-heads", "4", "--seed", "3")
    gen = torch.Generator().manual_seed(2)
    x = {n: t[0] for n, t in random_inputs(1, 3, 2, 4, gen=gen).items()}
    with start_server(*flags) as a, start_server(*flags) as b:

        async def main():
            async with AsyncClient(a.address) as ca, AsyncClient(b.address) as cb:
                info = await ca.model_info()
                assert info.max_speculative_tokens == 8 and [d.index for d in info.devices] == [0]
                s = await ca.create_session()
                buddy = await ca.create_session(colocate_with=s)
                await s.decode(0, **x, speculative=True)
                assert await s.commit(2) == {0: 2}
                async with s.speculate() as spec:  # left without commit: as if never sent
                    await spec.decode(1, **x)
                async with s.speculate() as spec:
                    await spec.decode(1, **x)
                    assert await spec.commit(1) == {0: 2, 1: 1}
                child = await s.fork()
                assert child.positions == {0: 2, 1: 1}
                moved = await cb.import_state(await s.export())
                assert moved.positions == {0: 2, 1: 1}
                nxt = {n: t[:1] for n, t in x.items()}
                outs = [await t.decode(0, **nxt) for t in (s, child, moved)]
                assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
                for t in (s, buddy, child, moved):
                    await t.close()
            async with AsyncReplicaSet([a.address, b.address]) as replicas:
                r = await replicas.create_session()
                await r.decode(0, **nxt)
                other = b.address if replicas.home_of(r) == a.address else a.address
                assert await replicas.migrate(r, other) is r
                assert replicas.home_of(r) == other and r.positions == {0: 1}
                await r.decode(0, **nxt)
                await r.close()

        asyncio.run(main())
