"""Host cost of one decode request, piece by piece, client and server side (issue 4, part (c)).

Times, in this process and without gRPC, each step a request goes through on its way: the
client building the DecodeRequest from tensors and serializing it, the server parsing and
validating it (the NaN/Inf check separately), building and serializing the reply, the client
parsing the reply into a tensor; and beside them what the echo floor does for the same bytes.
The pieces of one side run in sequence per iteration, as that side's process would run them,
so allocator effects (fresh multi-MiB buffers, page faults) show up where they would in a server.

    python bench/request_cost.py                       # qwen3-next, B=256, T=1, bf16
    python bench/request_cost.py --batch 1 --json out.json

What is not here is gRPC's own transport (the echo floor measures that) and the device step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from gdn_client._codec import SessionCursor, encode_request, prepare_step
from gdn_client._echo import _reply as echo_reply
from gdn_client._echo import echo_request
from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_server.config import ModelShape
from gdn_server.decode_rpcs import decode_response, decode_response_wire
from gdn_server.tuning import tune_gc, tune_malloc
from gdn_server.validation import decode_work_from_request
from gdn_server.work import DecodeResult

_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
SETS = 4  # pre-drawn input sets, rotated: no input is drawn inside the timed loop


class Timer:
    """Median wall time per named piece over the iterations of a loop."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}

    def run(self, name: str, fn: Callable[[], object]) -> object:
        t0 = time.perf_counter()
        out = fn()
        self.samples.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    def medians_ms(self, warmup: int) -> dict[str, float]:
        return {k: 1e3 * statistics.median(v[warmup:]) for k, v in self.samples.items()}


def measure(batch: int, tokens: int, dtype: str, iters: int, warmup: int = 3) -> list[dict]:
    shape = ModelShape(num_layers=36, num_q_heads=16, num_v_heads=32)
    B, T, H, HV, K, V = batch, tokens, shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v
    gen = torch.Generator().manual_seed(0)
    dims = [(B, T, H, K), (B, T, H, K), (B, T, HV, V), (B, T, HV), (B, T, HV)]
    inputs = [[torch.randn(*d, generator=gen).to(_DTYPES[dtype]) for d in dims] for _ in range(SETS)]
    ids = [f"{i:032x}" for i in range(B)]
    outputs = [torch.randn(B, T, HV, V, generator=gen).bfloat16() for _ in range(SETS)]

    # wire bytes of every request and reply, made up front so that each side's loop only does its own work
    request_wire = [encode_request(0, ids, [0] * B, x).SerializeToString() for x in inputs]
    reply_wire = [
        decode_response(DecodeResult(o.view(torch.int16).numpy().tobytes(), tuple(o.shape), tuple([T] * B), "7"))
        .SerializeToString() for o in outputs
    ]

    client, server, wire, echo = Timer(), Timer(), Timer(), Timer()
    for i in range(warmup + iters):
        s = i % SETS
        cursors = [SessionCursor(sid) for sid in ids]  # fresh: every step is at position 0, as the replies say
        # -- client: Client.decode_batch's request, then the reply into a tensor
        step = client.run("client: prepare_step (tensors -> DecodeRequest)", lambda: prepare_step(
            0, cursors, *inputs[s], single=False))
        client.run("client: serialize request (grpc's request_serializer)", step.request.SerializeToString)
        reply = client.run("client: parse reply (grpc's response_deserializer)",
                           lambda: gdn_pb2.DecodeResponse.FromString(reply_wire[s]))
        client.run("client: reply -> bf16 tensor (PreparedStep.complete)", lambda: step.complete(reply))

        # -- server: parse, validate, answer
        req = server.run("server: parse request (grpc's request_deserializer)",
                         lambda: gdn_pb2.DecodeRequest.FromString(request_wire[s]))
        server.run("server: validate (decode_work_from_request)", lambda: decode_work_from_request(req, shape))
        out = outputs[s]
        data = server.run("server: reply bytes from the output (scheduler)",
                          lambda: out.view(torch.int16).numpy().tobytes())
        result = DecodeResult(data, tuple(out.shape), tuple([T] * B), "7")
        resp = server.run("server: build DecodeResponse (decode_response)", lambda: decode_response(result))
        server.run("server: serialize reply (grpc's response_serializer)", resp.SerializeToString)
        # what the servicer runs instead of the two above (gdn_server.rpc_wrap.Serialized)
        wire.run("server: reply wire (decode_response_wire)", lambda: decode_response_wire(result))

        # -- echo floor, same sizes: its server copies the reply out of the request; no other work
        payload = echo_request(len(request_wire[s]), len(reply_wire[s]))
        echo.run("echo server: reply from request", lambda: echo_reply(payload))

    rows = []
    for side, timer in (("client", client), ("server", server), ("server reply by hand", wire), ("echo", echo)):
        for name, ms in timer.medians_ms(warmup).items():
            rows.append({"side": side, "piece": name, "ms": ms})
    rows.append({"side": "-", "piece": "request bytes", "ms": len(request_wire[0])})
    rows.append({"side": "-", "piece": "reply bytes", "ms": len(reply_wire[0])})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256, help="sessions per request B")
    p.add_argument("--tokens", type=int, default=1, help="T")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args()
    tune_malloc()  # as the server's entry points do
    tune_gc()
    rows = measure(args.batch, args.tokens, args.dtype, args.iters)
    print(f"B={args.batch} T={args.tokens} {args.dtype}, qwen3-next heads, median of {args.iters}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'piece':<62} {'ms':>9}")
    totals: dict[str, float] = {}
    for r in rows:
        if r["side"] == "-":
            print(f"{r['piece']:<62} {r['ms']:>9,.0f}")
            continue
        totals[r["side"]] = totals.get(r["side"], 0.0) + r["ms"]
        print(f"{r['piece']:<62} {r['ms']:>9.3f}")
    for side, ms in totals.items():
        print(f"{'total ' + side:<62} {ms:>9.3f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                         "totals_ms": totals}, indent=1))


if __name__ == "__main__":
    main()
