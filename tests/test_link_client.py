"""A front-end worker's end of the engine link (gdn_server.frontend.EngineLinkClient) against a
scripted engine on a real socket pair: replies reach the right caller once, a cancelled request's
reply is dropped (after its cancel frame went out), and an engine that goes away answers what
was still out with UNAVAILABLE."""
from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from gdn_server.config import ModelShape
from gdn_server.errors import FailedPrecondition, GdnError, Unavailable
from gdn_server.frontend import EngineLinkClient
from gdn_server.link import KIND_CANCEL, LENGTH, decode_cancel, decode_request, encode_reply
from gdn_server.work import DecodeResult, DecodeWork

SHAPE = ModelShape(num_layers=2, num_q_heads=1, num_v_heads=2, head_dim_k=8, head_dim_v=8)


def _work(request_id: str) -> DecodeWork:
    H, HV, K, V = SHAPE.num_q_heads, SHAPE.num_v_heads, SHAPE.head_dim_k, SHAPE.head_dim_v
    x = {n: torch.randn(*s).to(torch.bfloat16) for n, s in
         {"q": (1, 1, H, K), "k": (1, 1, H, K), "v": (1, 1, HV, V), "a": (1, 1, HV), "b": (1, 1, HV)}.items()}
    raw = tuple(x[n].view(torch.int16).numpy().tobytes() for n in "qkvab")
    return DecodeWork(layer=1, session_ids=("s",), positions=None, request_id=request_id, bf16_bytes=raw, **x)


def _result(seed: int) -> DecodeResult:
    out = torch.randn(1, 1, SHAPE.num_v_heads, SHAPE.head_dim_v, generator=torch.Generator().manual_seed(seed))
    return DecodeResult(out.to(torch.bfloat16).view(torch.int16).numpy().tobytes(), tuple(out.shape), (seed,))


async def _frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    return await reader.readexactly(size)


async def _until(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


@pytest.mark.timeout(60)
def test_answers_cancels_and_a_lost_engine():
    async def scenario() -> None:
        worker_sock, engine_sock = socket.socketpair()
        link = EngineLinkClient(*await asyncio.open_unix_connection(sock=worker_sock), SHAPE)
        engine_in, engine_out = await asyncio.open_unix_connection(sock=engine_sock)
        answers: dict[str, list] = {"a": [], "b": [], "c": [], "d": []}

        link.submit_to(_work("a"), answers["a"].append)
        cancelled = link.submit_to(_work("b"), answers["b"].append)
        future = link.submit(_work("c"))  # the unary path: a future
        tags = {}
        for name in "abc":
            tag, work = decode_request(await _frame(engine_in), SHAPE)
            assert work.request_id == name
            tags[name] = tag
        cancelled.cancel()
        frame = await _frame(engine_in)
        assert frame[0] == KIND_CANCEL and decode_cancel(frame) == tags["b"]
        cancelled.cancel()  # a second cancel sends nothing more (checked by the next frame read)

        engine_out.writelines(encode_reply(tags["b"], _result(2)) + encode_reply(tags["a"], _result(1))
                              + encode_reply(tags["c"], FailedPrecondition("position 0 != 1")))
        await engine_out.drain()
        await _until(lambda: answers["a"] and future.done())
        (got,) = answers["a"]
        assert isinstance(got, DecodeResult) and got.request_id == "a"
        assert bytes(got.out) == _result(1).out and got.positions == (1,)
        with pytest.raises(GdnError, match="position 0"):
            future.result()
        assert answers["b"] == []  # cancelled: its reply (which frees its bytes) is dropped

        link.submit_to(_work("d"), answers["d"].append)
        tag, work = decode_request(await _frame(engine_in), SHAPE)  # no stray cancel frame came first
        assert work.request_id == "d"
        engine_out.close()  # the engine goes away with "d" unanswered
        await asyncio.wait_for(link.closed.wait(), 5)
        (lost,) = answers["d"]
        assert isinstance(lost, Unavailable)
        with pytest.raises(Unavailable):
            link.submit_to(_work("e"), answers["d"].append)
        await link.close()

    asyncio.run(scenario())
