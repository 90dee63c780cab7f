"""One server over two GPUs: placement, routing, per-device capacity (needs >= 2 GPUs)."""
from __future__ import annotations

import grpc
import pytest
import torch

from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_client.wire import tensor_from_proto
from gdn_server.config import ModelShape
from gdn_server.weights import random_gate_params
from reference import ReferenceModel, rel_err
from servers import start_server
from util import decode_request, random_inputs

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def test_sessions_spread_over_two_gpus_and_decode_correctly():
    gates = random_gate_params(ModelShape(2, 16, 32), seed=3)
    ref = ReferenceModel(gates.A_log, gates.dt_bias)
    gen = torch.Generator().manual_seed(1)
    with start_server("--device", "cuda", "--devices", "0,1", "--layers", "2", "--q-heads", "16", "--v-heads", "32",
                      "--seed", "3", "--max-sessions", "8", timeout=600) as srv, grpc.insecure_channel(srv.address) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        ids = [stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=60).session_id for _ in range(4)]
        info = stub.GetModelInfo(gdn_pb2.GetModelInfoRequest(), timeout=60)
        assert [d.sessions_in_use for d in info.devices] == [2, 2] and info.max_sessions == 16
        buddy = stub.CreateSession(gdn_pb2.CreateSessionRequest(colocate_with=ids[0]), timeout=60).session_id
        for sid in ids:
            x = random_inputs(1, 2, 16, 32, gen=gen)
            out = tensor_from_proto(stub.Decode(decode_request(1, [sid], x), timeout=120).o)
            assert rel_err(out, ref.step(1, [sid], **x)) < 1e-2
        x = random_inputs(2, 1, 16, 32, gen=gen)
        stub.Decode(decode_request(0, [ids[0], buddy], x), timeout=120)  # same device: one request
        with pytest.raises(grpc.RpcError) as info_err:
            stub.Decode(decode_request(0, [ids[0], ids[1]], x), timeout=120)
        assert info_err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
