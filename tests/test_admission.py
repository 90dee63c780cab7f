"""Admission (gdn_server.calls): no client, signed in or not, can lock the others out. Hostile
clients are raw HTTP/2 connections (tests/hostile.py); the honest ones are stock gRPC clients."""
from __future__ import annotations

import asyncio
import queue
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from hostile import park
from servers import SMALL_MODEL, start_server
from util import decode_request, random_inputs

TOKENS = "alice:secret-alice\nmallory:secret-mallory\n"
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # a channel of its own: another peer


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096


def _served_within(address: str, token: str | None, seconds: float) -> bool:
    """Whether a new client creates a session within `seconds`."""
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(address, options=OWN_CONNECTION) as channel:
        stub = gdn_pb2_grpc.GdnDecodeStub(channel)
        stub.CreateSession(gdn_pb2.CreateSessionRequest(), metadata=metadata, timeout=seconds)
    return True


def _health(address: str) -> int:
    with grpc.insecure_channel(address, options=OWN_CONNECTION) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(TOKENS)
    with start_server(*SMALL_MODEL, "--auth-token-file", str(tokens), "--max-sessions", "64") as srv:
        yield srv


@pytest.mark.parametrize("connections, streams, sent, growth", [
    (6, 100, 0, 256 << 20),  # header-only calls
    (6, 100, 1 << 20, 256 << 20),  # each parks 1 MiB of a declared 30 MiB message
    (20, 100, 1 << 20, 1 << 30),
])
def test_calls_without_a_token_hold_nothing_an_authenticated_client_needs(token_server, connections, streams,
                                                                          sent, growth):
    before = _rss(token_server.proc.pid)
    hostile = park(token_server.port, connections, streams, declared=(30 << 20) if sent else 0, sent=sent)
    try:
        started = time.monotonic()
        assert _served_within(token_server.address, "secret-alice", 5.0)
        assert time.monotonic() - started < 5.0
        assert _health(token_server.address) == health_pb2.HealthCheckResponse.SERVING
        grown = _rss(token_server.proc.pid) - before
        assert grown <= growth, f"the server grew by {grown / 2**20:.0f} MiB"
        deadline = time.monotonic() + 10
        while hostile.ended < connections * streams and time.monotonic() < deadline:
            time.sleep(0.1)
        assert set(hostile.codes()) <= {f"grpc-status {grpc.StatusCode.UNAUTHENTICATED.value[0]}", "reset 0"}
        assert hostile.ended == connections * streams  # every one ended at once, none held
    finally:
        hostile.close()


def test_a_unary_call_whose_message_does_not_come_is_ended():
    with start_server(*SMALL_MODEL, "--message-timeout-s", "0.5") as srv:
        hostile = park(srv.port, 2, 10)  # no token needed: a server without auth admits them
        try:
            deadline = time.monotonic() + 10
            while hostile.ended < 20 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert hostile.codes() == {f"grpc-status {grpc.StatusCode.DEADLINE_EXCEEDED.value[0]}": 20}
            assert _served_within(srv.address, None, 5.0)
        finally:
            hostile.close()


class _Streams:
    """DecodeStreams held open on one connection of their own (one peer: one client)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=OWN_CONNECTION)
        self.stub = gdn_pb2_grpc.GdnDecodeStub(self.channel)
        self.open: list[tuple[queue.SimpleQueue, object]] = []

    def hold(self) -> object:
        """Opens one more stream and waits until the server answers on it (it is admitted)."""
        requests: queue.SimpleQueue = queue.SimpleQueue()
        call = self.stub.DecodeStream(iter(requests.get, None), timeout=60)
        requests.put(gdn_pb2.DecodeRequest(session_ids=["nope"]))
        next(call)  # INVALID_ARGUMENT in its place: the stream is on the server
        self.open.append((requests, call))
        return call

    def close(self) -> None:
        for requests, _ in self.open:
            requests.put(None)
        self.channel.close()


def _refused(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        next(call)
    return e.value.code()


def test_a_client_at_its_bound_is_refused_and_the_others_are_served():
    with start_server(*SMALL_MODEL, "--max-calls-per-client", "2") as srv:
        greedy, other = _Streams(srv.address), _Streams(srv.address)
        try:
            greedy.hold()
            greedy.hold()
            with pytest.raises(grpc.RpcError) as third:
                greedy.hold()
            assert third.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-calls-per-client" in third.value.details()
            other.hold()
            assert _served_within(srv.address, None, 5.0)
        finally:
            greedy.close()
            other.close()


def test_a_full_server_ends_a_call_of_the_client_holding_the_most_not_the_newcomer():
    with start_server(*SMALL_MODEL, "--max-calls", "3") as srv:
        greedy, modest = _Streams(srv.address), _Streams(srv.address)
        try:
            first, newest = greedy.hold(), greedy.hold()
            modest.hold()  # the server is full: 3 calls
            assert _served_within(srv.address, None, 5.0)  # a newcomer: greedy's newest call gives way
            assert _refused(newest) == grpc.StatusCode.RESOURCE_EXHAUSTED
            modest.hold()  # full again (greedy 1, modest 2): now modest holds the most
            with pytest.raises(grpc.RpcError) as again:
                modest.hold()
            assert again.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            greedy.open[0][0].put(gdn_pb2.DecodeRequest(session_ids=["nope"]))
            assert next(first).error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]  # its older call goes on
        finally:
            greedy.close()
            modest.close()


def test_4096_clients_each_holding_an_idle_stream_are_all_admitted():
    clients, connections = 4096, 40  # 103 streams a connection, under its 128
    flags = ("--layers", "1", "--q-heads", "1", "--v-heads", "1", "--head-dim", "128", "--max-sessions", str(clients))

    async def run(address: str) -> int:
        channels = [grpc.aio.insecure_channel(address, options=OWN_CONNECTION) for _ in range(connections)]
        stubs = [gdn_pb2_grpc.GdnDecodeStub(c) for c in channels]
        inputs = random_inputs(1, 1, 1, 1, gen=torch.Generator().manual_seed(0))
        gate = asyncio.Semaphore(64)

        async def create(i: int) -> str:
            async with gate:
                reply = await stubs[i % connections].CreateSession(gdn_pb2.CreateSessionRequest(), timeout=60)
            return reply.session_id

        ids = await asyncio.gather(*(create(i) for i in range(clients)))

        async def hold(i: int):
            requests: asyncio.Queue = asyncio.Queue()

            async def send():
                while (request := await requests.get()) is not None:
                    yield request

            call = stubs[i % connections].DecodeStream(send(), timeout=120)
            await requests.put(decode_request(0, [ids[i]], inputs, [0]))
            reply = await call.read()
            return call, requests, reply.error_code

        held = await asyncio.gather(*(hold(i) for i in range(clients)))
        admitted = sum(code == 0 for _, _, code in held)
        for _, requests, _ in held:
            await requests.put(None)
        for channel in channels:
            await channel.close()
        return admitted

    with start_server(*flags, timeout=120) as srv:
        assert asyncio.run(asyncio.wait_for(run(srv.address), 240)) == clients
