"""The load's clients: `GdnWorker` (a gdn-serve client) and `EchoWorker` (a client of the echo
floor with a gdn step's message sizes), both over grpc.aio, both sending and receiving bytes.

Latency is what both kinds of client have in common: from handing a ready request to gRPC until
its reply's bytes are in. Building the next request and checking the reply are client work the
echo client does not do; they run outside that interval, and count in steps/s, since each
client sends its next step only after.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Sequence

import grpc
import grpc.aio
import torch
from google.protobuf.message import DecodeError

from gdn_client import AsyncClient, ClientOptions, GdnError, ModelInfo, Stats
from gdn_client._errors import error_from_code, error_from_rpc
from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_client.wire import WireFormatError, tensor_from_proto, tensor_to_proto
from gdn_loadtest.config import LoadConfig
from gdn_loadtest.echo import STREAM as ECHO_STREAM
from gdn_loadtest.echo import UNARY as ECHO_UNARY
from gdn_loadtest.echo import echo_request
from gdn_loadtest.verify import StateVerifier, VerificationError, gate_params_from_seed

__all__ = ["DTYPES", "INPUT_SETS", "GdnWorker", "EchoWorker", "server_view"]

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
INPUT_SETS = 4  # pre-drawn input sets per client, rotated step by step
_DECODE = "/gdn.v1.GdnDecode/Decode"
_DECODE_STREAM = "/gdn.v1.GdnDecode/DecodeStream"
_MAX_MESSAGE_BYTES = 256 << 20


def channel_args(cfg: LoadConfig) -> list[tuple[str, Any]]:
    """A load client's channel arguments: its own connection unless cfg.shared_connection.

    grpc shares one TCP connection between the channels of a process that have the same target
    and arguments: 64 clients would be 64 HTTP/2 streams on one connection, and a server with
    several workers behind one port (SO_REUSEPORT spreads connections, not streams) would see a
    load process as one client. Separate client processes have a connection each."""
    options = ClientOptions(max_message_bytes=_MAX_MESSAGE_BYTES, own_connection=not cfg.shared_connection)
    return options.channel_options()


async def server_view(target: str, timeout: float) -> tuple[ModelInfo, Stats]:
    """The server's model and its counters now."""
    async with AsyncClient(target, ClientOptions(timeout=timeout, max_message_bytes=_MAX_MESSAGE_BYTES)) as client:
        return await client.model_info(), await client.stats()


async def _round_trip(stream: Any, unary: Any, request: bytes, timeout: float, stream_name: str) -> bytes:
    """One request's reply bytes: over the open `stream`, or (None) by one `unary` call; an RPC
    error becomes a GdnError, a stream that ends becomes UNAVAILABLE."""
    try:
        if stream is None:
            return await unary(request, timeout=timeout)
        await stream.write(request)
        reply = await stream.read()
    except grpc.RpcError as exc:
        raise error_from_rpc(exc) from None
    if reply is grpc.aio.EOF:
        raise GdnError(f"{stream_name} ended", grpc.StatusCode.UNAVAILABLE)
    return reply


async def _end_stream(call: Any) -> None:
    """Half-closes an open stream and reads it to its end (with read(): the API it was used
    with; grpc.aio refuses to mix read() and iteration on one call)."""
    if call is None:
        return
    with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass


class GdnWorker:
    """One client of the gdn server: its sessions, inputs and positions.

    Each client (its own channel and TCP connection) owns ``cfg.batch`` sessions and walks them
    through the model as a decoder would: layer 0..L-1 for one token, then the next token, one
    step in flight at a time (a layer's input depends on the previous layer's output).

    With ``cfg.speculative`` every step is a draft of T tokens, and the step at the last layer
    also settles the pass: one Commit per session, all with the same number of accepted tokens,
    drawn uniformly from 0..T, in flight together. Those Commits are part of that step's time;
    their round trip is also kept on its own (`commit_s`), since inside the step's latency it
    cannot be told apart from the step. The positions then are the ones the Commit replies name.

    The inputs are drawn and encoded before timing: each of INPUT_SETS sets is serialized once
    (session ids and tensors), and a step sends the bytes of its small header fields (layer,
    positions, request_id) followed by those of its set. Protobuf reads concatenated encodings as
    one message, so the server sees an ordinary DecodeRequest; the client does no per-step
    re-encoding of megabytes of tensors, as the echo floor does none.
    """

    def __init__(self, cfg: LoadConfig, info: ModelInfo, index: int) -> None:
        self.cfg = cfg
        self.info = info
        self.layers = min(cfg.layers_per_token or info.num_layers, info.num_layers)
        # a host of several server processes (gdn-server --processes): the clients spread over
        # them, each with its sessions in one process, as gdn_client spreads new sessions
        target = cfg.target
        if info.process_ports:
            host = cfg.target.rsplit(":", 1)[0]
            target = f"{host}:{info.process_ports[index % len(info.process_ports)]}"
        self.channel = grpc.aio.insecure_channel(target, channel_args(cfg))
        self.stub = gdn_pb2_grpc.GdnDecodeStub(self.channel)
        gen = torch.Generator().manual_seed(cfg.seed * 100_003 + index)
        B, T, H, HV, K, V = cfg.batch, cfg.tokens, info.num_q_heads, info.num_v_heads, info.head_dim_k, info.head_dim_v
        shapes = [(B, T, H, K), (B, T, H, K), (B, T, HV, V), (B, T, HV), (B, T, HV)]
        self.inputs = [[torch.randn(*s, generator=gen).to(DTYPES[cfg.dtype]) for s in shapes]
                       for _ in range(INPUT_SETS)]
        self.bodies: list[bytes] = []  # per input set: session ids and tensors, serialized
        self.session_ids: list[str] = []
        self.positions = [0] * self.layers
        self.step_index = 0
        self.layer = 0
        self.call: Any = None
        self.request_bytes = 0
        self.reply_bytes = 0
        self.verifier: StateVerifier | None = None
        self.accepts = torch.Generator().manual_seed(cfg.seed * 100_003 + index + 1)  # accepted tokens per pass
        self.accepted = 0  # this pass's accepted tokens (speculative)
        self.committed: list[int] | None = None  # positions after the last pass's Commit
        self.commit_s: float | None = None  # the last send's Commit round trip (seconds), if it settled a pass
        # requests go out as bytes we encoded, replies come in as bytes (as the echo client's do):
        # check() parses them after the latency is taken
        self.decode = self.channel.unary_unary(_DECODE)

    async def open(self) -> None:
        for _ in range(self.cfg.batch):  # one device for all of them: they share every request
            request = gdn_pb2.CreateSessionRequest(colocate_with=self.session_ids[0] if self.session_ids else "")
            try:
                reply = await self.stub.CreateSession(request, timeout=self.cfg.timeout)
            except grpc.RpcError as exc:
                raise error_from_rpc(exc) from None
            self.session_ids.append(reply.session_id)
        self.bodies = [self.request_body(i) for i in range(INPUT_SETS)]
        if self.cfg.verify:
            gates = gate_params_from_seed(self.info, self.cfg.server_seed)
            self.verifier = StateVerifier(self.info, gates, self.session_ids, self.layers, self.cfg.server_seed)
        if self.cfg.mode == "stream":
            self.call = self.channel.stream_stream(_DECODE_STREAM)()

    def request_body(self, index: int) -> bytes:
        """Input set `index` with the session ids, serialized (a step's header goes before)."""
        return _request_body(self.session_ids, self.inputs[index])

    def prepare(self) -> bytes:
        self.layer = layer = self.step_index % self.layers
        header = gdn_pb2.DecodeRequest(
            layer=layer, positions=[self.positions[layer]] * self.cfg.batch, request_id=str(self.step_index),
            speculative=self.cfg.speculative,
        ).SerializeToString()
        if self.cfg.speculative and layer == self.layers - 1:
            self.accepted = int(torch.randint(0, self.cfg.tokens + 1, (1,), generator=self.accepts))
        wire = header + self.bodies[self.step_index % INPUT_SETS]
        self.request_bytes = len(wire)
        return wire

    async def send(self, request: bytes) -> bytes:
        self.commit_s = None
        reply = await _round_trip(self.call, self.decode, request, self.cfg.timeout, "DecodeStream")
        if self.cfg.speculative and self.layer == self.layers - 1:
            self.committed = await self.commit(self.accepted)
        return reply

    async def commit(self, accepted: int) -> list[int]:
        """Commits `accepted` tokens of every session's open drafts; the positions after it. The
        time from issuing the first Commit to the last reply goes to `commit_s`."""
        t0 = time.perf_counter()
        calls = [self.stub.Commit(gdn_pb2.CommitRequest(session_id=sid, accepted=accepted), timeout=self.cfg.timeout)
                 for sid in self.session_ids]
        try:
            replies = await asyncio.gather(*calls)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        self.commit_s = time.perf_counter() - t0
        return list(replies[0].positions)[: self.layers]

    def check(self, reply: bytes) -> None:
        """Parses the reply (a DecodeStream error arrives in it), checks it answers this step
        (and with verify, its every output number), and advances the positions: by T at the
        step's layer, or after a speculative pass's Commit to the positions it named (whatever
        this step's own answer: the pass is settled)."""
        committed, self.committed = self.committed, None
        try:
            self._check_reply(reply)
        finally:
            if committed is not None:
                self.positions = committed
                self.step_index += 1
        if committed is None:
            self.positions[self.layer] += self.cfg.tokens
            self.step_index += 1
        if not self.reply_bytes:
            self.reply_bytes = len(reply)

    def _check_reply(self, reply: bytes) -> None:
        try:
            msg = gdn_pb2.DecodeResponse.FromString(reply)
        except DecodeError as exc:
            raise GdnError(f"malformed reply: {exc}") from None
        if msg.error_code:
            raise error_from_code(msg.error_code, msg.error_message)
        if msg.request_id != str(self.step_index):
            raise GdnError(f"a reply to request {msg.request_id!r} for request {str(self.step_index)!r}")
        if self.verifier is not None:
            try:
                output = tensor_from_proto(msg.o, "o")
            except WireFormatError as exc:
                raise VerificationError(f"layer {self.layer}: the reply's output is malformed: {exc}") from None
            self.verifier.check(self.layer, self.positions[self.layer], self.inputs[self.step_index % INPUT_SETS],
                                output)

    async def exchange(self) -> None:
        self.check(await self.send(self.prepare()))

    async def close(self) -> None:
        await _end_stream(self.call)
        for sid in self.session_ids:
            with contextlib.suppress(grpc.RpcError):
                await self.stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), timeout=self.cfg.timeout)
        await self.channel.close()


def _request_body(session_ids: Sequence[str], inputs: Sequence[torch.Tensor]) -> bytes:
    """The session ids and tensors of a DecodeRequest, serialized (a step's header goes before)."""
    request = gdn_pb2.DecodeRequest(session_ids=list(session_ids))
    for name, tensor in zip("qkvab", inputs):
        tensor_to_proto(tensor, getattr(request, name))
    return request.SerializeToString()


class EchoWorker:
    """One client of the echo server, with a gdn step's message sizes."""

    commit_s: float | None = None  # an echo step settles no pass

    def __init__(self, cfg: LoadConfig, address: str, request_bytes: int, reply_bytes: int) -> None:
        self.cfg = cfg
        self.channel = grpc.aio.insecure_channel(address, channel_args(cfg))
        self.payload = echo_request(request_bytes, reply_bytes)
        self.reply_bytes = reply_bytes
        self.call: Any = None  # the open stream in stream mode
        self.unary = self.channel.unary_unary(ECHO_UNARY)

    async def open(self) -> None:
        if self.cfg.mode == "stream":
            self.call = self.channel.stream_stream(ECHO_STREAM)()

    def prepare(self) -> bytes:
        return self.payload

    async def send(self, request: bytes) -> bytes:
        return await _round_trip(self.call, self.unary, request, self.cfg.timeout, "echo stream")

    def check(self, reply: bytes) -> None:
        if len(reply) != self.reply_bytes:
            raise GdnError(f"echo reply of {len(reply)} bytes, expected {self.reply_bytes}")

    async def exchange(self) -> None:
        self.check(await self.send(self.prepare()))

    async def close(self) -> None:
        await _end_stream(self.call)
        await self.channel.close()
