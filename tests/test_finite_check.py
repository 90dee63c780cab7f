"""The NaN/Inf rule of bf16 inputs: validation checks every request, whatever its size, in the
pass that digests it (gdn_server._wire), so no request reaches the scheduler unchecked, and a
big request with a NaN or Inf is INVALID_ARGUMENT naming the input and changes nothing (against a
real server, with requests of over 1 MiB). Nothing below validation checks again."""
from __future__ import annotations

import grpc
import pytest
import torch

from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_server.config import ModelShape
from gdn_server.errors import InvalidArgument
from gdn_server.validation import decode_work, decode_work_from_request, parse_decode_request, step_limits
from servers import start_server
from util import decode_request, random_inputs

SHAPE = ModelShape(num_layers=2, num_q_heads=1, num_v_heads=2)
TIMEOUT = 60


@pytest.mark.parametrize("rows", [1, 64, 300])  # 16.5 KB to 5 MB of inputs
@pytest.mark.parametrize("culprit", ["q", "k", "v", "a", "b", None])
def test_validation_checks_every_bf16_request_whatever_its_size(rows, culprit):
    shape = ModelShape(num_layers=1, num_q_heads=16, num_v_heads=32)
    x = random_inputs(rows, 1, 16, 32, gen=torch.Generator().manual_seed(rows), dtype=torch.bfloat16)
    if culprit is not None:
        x[culprit][rows - 1, 0].view(-1)[-1] = float("-inf")
    data = decode_request(0, [f"s{i}" for i in range(rows)], x).SerializeToString()
    for make in (lambda: decode_work(parse_decode_request(data, step_limits(shape)), shape),
                 lambda: decode_work_from_request(gdn_pb2.DecodeRequest.FromString(data), shape)):
        if culprit is None:
            work = make()
            assert len(work.digests) == rows
        else:
            with pytest.raises(InvalidArgument, match=f"^{culprit} has NaN or Inf values$"):
                make()


@pytest.fixture(scope="module")
def wide_server():
    """Qwen3-Next's head counts on one layer: 70 rows of inputs are over 1 MiB."""
    with start_server("--layers", "1", "--q-heads", "16", "--v-heads", "32", "--max-sessions", "80") as srv:
        yield srv


GOOD = random_inputs(70, 1, 16, 32, gen=torch.Generator().manual_seed(5), dtype=torch.bfloat16)
OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def _refused_then_stepped(stub, culprit: str) -> bytes:
    """On 70 new sessions: GOOD with an Inf in `culprit` is refused with INVALID_ARGUMENT naming
    it, then GOOD itself is still their first step. Returns that step's output bytes (the
    sessions are closed)."""
    sids = [stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=TIMEOUT).session_id for _ in range(70)]
    bad = {k: v.clone() for k, v in GOOD.items()}
    bad[culprit][37, 0].view(-1)[0] = float("inf")
    with pytest.raises(grpc.RpcError) as err:
        stub.Decode(decode_request(0, sids, bad, positions=[0] * 70), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"{culprit} has NaN or Inf values"
    reply = stub.Decode(decode_request(0, sids, GOOD, positions=[0] * 70), timeout=TIMEOUT)
    assert list(reply.positions) == [1] * 70
    for sid in sids:
        stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), timeout=TIMEOUT)
    return reply.o.data


def _first_step(stub) -> bytes:
    """GOOD as the first step of 70 fresh sessions: its output bytes (the sessions are closed)."""
    sids = [stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=TIMEOUT).session_id for _ in range(70)]
    out = stub.Decode(decode_request(0, sids, GOOD, positions=[0] * 70), timeout=TIMEOUT).o.data
    for sid in sids:
        stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), timeout=TIMEOUT)
    return out


@pytest.mark.parametrize("culprit", ["q", "v", "b"])
def test_a_big_request_with_nan_is_invalid_argument_and_changes_nothing(wide_server, culprit):
    # nothing moved: after the refusal the request without the Inf is a first step, and its
    # outputs are those of fresh sessions' first step on the same inputs
    with grpc.insecure_channel(wide_server.address, options=OPTIONS) as channel:
        stub = gdn_pb2_grpc.GdnDecodeStub(channel)
        assert _refused_then_stepped(stub, culprit) == _first_step(stub)
