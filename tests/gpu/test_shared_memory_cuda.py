"""Tensors in GPU memory through CUDA IPC between two processes: this test (the client, its
region from gdn_client) and a real server process on the GPU with --allow-shared-memory. The
outputs equal those of the same inputs sent inline, bit for bit, in the region and in the reply;
a host region works on the GPU server too (a big request's tensors checked and read by the GPU
in the page-locked region, a retry answered from the output kept); a request with a NaN in GPU
or host memory is refused with nothing applied (a small request's tensors copied out of GPU
memory and checked by the CPU, a big one's checked by the GPU); f32 tensors and a mix of region and inline
tensors work; clients stepping at once through GPU memory each get their own answers; the
server refuses a handle that does not open.
"""
from __future__ import annotations

import concurrent.futures

import grpc
import pytest
import torch

from gdn_client import Client, InvalidArgumentError
from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from servers import start_server
from util import decode_request, random_inputs

H, HV, K = 16, 32, 128
NAMES = "qkvab"


@pytest.fixture(scope="module")
def gpu_server():
    with start_server("--device", "cuda", "--devices", "0", "--layers", "2", "--q-heads", str(H), "--v-heads",
                      str(HV), "--max-sessions", "160", "--allow-shared-memory", timeout=600) as server:
        yield server


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("B", [8, 64])  # 64: v is 512 KiB, what a page-locked host region sends by DMA
def test_region_tensors_equal_inline_tensors(gpu_server, device, B):
    with Client(gpu_server.address) as client:
        inline = [client.create_session() for _ in range(B)]
        shared = [client.create_session(colocate_with=inline[0]) for _ in range(B)]
        with client.shared_memory(8 << 20, device=device) as mem:
            for step in range(3):
                x = random_inputs(B, 1, H, HV, gen=torch.Generator().manual_seed(step), dtype=torch.bfloat16)
                t = {}
                for n in NAMES:
                    t[n] = mem.tensor(x[n].shape)
                    t[n].copy_(x[n])
                    if n == "k":  # a gap: the server copies a small request's tensors out in two runs
                        mem.tensor((16 << 10,), dtype=torch.uint8)
                out = mem.tensor((B, 1, HV, K))
                if device == "cuda":
                    torch.cuda.synchronize()  # the inputs are written before the request goes
                got = client.decode_batch(step % 2, shared, *t.values(), out=out)
                want = client.decode_batch(step % 2, inline, *x.values())
                assert got.device.type == device and torch.equal(got.cpu(), want)
                mem.reset()
        for s_ in inline + shared:
            client.close_session(s_)


@pytest.mark.parametrize("B", [4, 64])  # 4: copied out and checked by the CPU; 64: checked by the GPU
def test_a_nan_in_gpu_memory_is_refused_with_nothing_applied_and_f32_and_mixes_work(gpu_server, B):
    with Client(gpu_server.address) as client:
        inline = [client.create_session() for _ in range(B)]
        shared = [client.create_session(colocate_with=inline[0]) for _ in range(B)]
        with client.shared_memory(4 << 20, device="cuda") as mem:
            gen = torch.Generator().manual_seed(11)
            x = random_inputs(B, 1, H, HV, gen=gen, dtype=torch.bfloat16)
            t = {n: mem.tensor(x[n].shape) for n in NAMES}
            for n in NAMES:
                t[n].copy_(x[n])
            t["v"][1, 0, 3, 5] = float("nan")
            torch.cuda.synchronize()
            with pytest.raises(InvalidArgumentError, match="v has NaN"):
                client.decode_batch(0, shared, *t.values())
            # nothing applied: the same sessions then step as their inline twins do
            x32 = random_inputs(B, 1, H, HV, gen=gen, dtype=torch.float32)
            mem.reset()
            t = {n: mem.tensor(x32[n].shape, dtype=torch.float32) for n in NAMES}
            for n in NAMES:
                t[n].copy_(x32[n])
            torch.cuda.synchronize()
            got = client.decode_batch(0, shared, *t.values())
            want = client.decode_batch(0, inline, *x32.values())
            assert torch.equal(got.cpu(), want)
            mixed = random_inputs(B, 1, H, HV, gen=gen, dtype=torch.bfloat16)
            mem.reset()
            q = mem.tensor(mixed["q"].shape)
            q.copy_(mixed["q"])
            torch.cuda.synchronize()
            got = client.decode_batch(0, shared, q, *(mixed[n] for n in "kvab"))
            want = client.decode_batch(0, inline, *mixed.values())
            assert torch.equal(got.cpu(), want)
        for s_ in inline + shared:
            client.close_session(s_)


def test_concurrent_clients_through_gpu_memory_each_get_their_own_answers(gpu_server):
    """Requests of several clients at once, small ones (copied out of GPU memory and checked by
    the CPU) beside a big one (checked on the GPU): each gets the outputs of its own inputs, and
    a NaN or Inf refuses only the request that holds it."""
    def run(index: int) -> list[str]:
        problems = []
        with Client(gpu_server.address) as client:
            B = 64 if index == 2 else 1 + index % 3
            inline = [client.create_session() for _ in range(B)]
            shared = [client.create_session(colocate_with=inline[0]) for _ in range(B)]
            with client.shared_memory(4 << 20, device="cuda") as mem:
                for step in range(6):
                    x = random_inputs(B, 1, H, HV, gen=torch.Generator().manual_seed(100 * index + step),
                                      dtype=torch.bfloat16)
                    t = {n: mem.tensor(x[n].shape) for n in NAMES}
                    for n in NAMES:
                        t[n].copy_(x[n])
                    poisoned = (index, step) in ((3, 2), (2, 4))
                    if poisoned:
                        t["k"][0, 0, 1, 2] = float("inf")
                    torch.cuda.synchronize()
                    if poisoned:
                        try:
                            client.decode_batch(step % 2, shared, *t.values())
                            problems.append(f"client {index}: an Inf in k was applied")
                        except InvalidArgumentError:
                            pass
                    else:
                        got = client.decode_batch(step % 2, shared, *t.values())
                        want = client.decode_batch(step % 2, inline, *x.values())
                        if not torch.equal(got.cpu(), want):
                            problems.append(f"client {index} step {step}: outputs differ from inline")
                    mem.reset()
            for s_ in inline + shared:
                client.close_session(s_)
        return problems

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        problems = [p for found in pool.map(run, range(8)) for p in found]
    assert problems == []


def test_a_handle_that_does_not_open_is_invalid_argument(gpu_server):
    channel = grpc.insecure_channel(gpu_server.address)
    try:
        stub = gdn_pb2_grpc.GdnDecodeStub(channel)
        request = gdn_pb2.RegisterSharedMemoryRequest(
            name="bogus", byte_size=4096, cuda=gdn_pb2.CudaSharedMemory(ipc_handle=b"\x01" * 64, device=0))
        with pytest.raises(grpc.RpcError) as refused:
            stub.RegisterSharedMemory(request, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        channel.close()


def test_a_big_request_in_host_memory_is_read_by_the_gpu_refused_for_a_nan_and_retried_from_its_output(gpu_server):
    """A request with a tensor of 512 KiB or more in a page-locked host region (B = 64: v is
    512 KiB) is checked and read by the GPU where it is, its o written there from the GPU: a NaN
    is refused with nothing applied; the outputs equal those of inline twins; a resent step (same
    positions) is answered from the output kept when it was applied, written into its o_ref again."""
    from multiprocessing import shared_memory

    B, size = 64, 16 << 20
    mem = shared_memory.SharedMemory(create=True, size=size)
    channel = grpc.insecure_channel(gpu_server.address, options=[("grpc.use_local_subchannel_pool", 1)])
    region = None
    try:
        stub = gdn_pb2_grpc.GdnDecodeStub(channel)
        stub.RegisterSharedMemory(gdn_pb2.RegisterSharedMemoryRequest(
            name="host", byte_size=size, system=gdn_pb2.SystemSharedMemory(key="/" + mem.name)), timeout=30)
        shared = [stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=30).session_id for _ in range(B)]
        inline = [stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=30).session_id for _ in range(B)]
        region = torch.frombuffer(mem.buf, dtype=torch.uint8)

        def by_reference(x: dict, positions: list[int]) -> tuple[gdn_pb2.DecodeRequest, slice]:
            req = decode_request(0, shared, x, positions=positions)
            offset = 0
            for n in NAMES:
                tensor = getattr(req, n)
                data = torch.frombuffer(bytearray(tensor.data), dtype=torch.uint8)
                region[offset:offset + data.numel()] = data
                tensor.ClearField("data")
                tensor.ref.region, tensor.ref.offset = "host", offset
                offset += -(-data.numel() // 256) * 256
            req.o_ref.region, req.o_ref.offset = "host", offset
            return req, slice(offset, offset + B * HV * K * 2)

        gen = torch.Generator().manual_seed(5)
        bad = random_inputs(B, 1, H, HV, gen=gen, dtype=torch.bfloat16)
        bad["v"][7, 0, 3, 9] = float("nan")
        req, _ = by_reference(bad, [0] * B)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Decode(req, timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "v has NaN" in refused.value.details()
        for step in range(2):  # nothing was applied: both sets start at position 0
            x = random_inputs(B, 1, H, HV, gen=gen, dtype=torch.bfloat16)
            req, o_bytes = by_reference(x, [step] * B)
            got = stub.Decode(req, timeout=60)
            want = stub.Decode(decode_request(0, inline, x, positions=[step] * B), timeout=60)
            assert list(got.positions) == list(want.positions) == [step + 1] * B and not got.o.data
            assert bytes(region[o_bytes].numpy()) == want.o.data
        region[o_bytes] = 0
        again = stub.Decode(req, timeout=60)  # the last step resent: answered from its kept output
        assert list(again.positions) == [2] * B and bytes(region[o_bytes].numpy()) == want.o.data
        stub.UnregisterSharedMemory(gdn_pb2.UnregisterSharedMemoryRequest(name=""), timeout=30)
        for sid in shared + inline:
            stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), timeout=30)
    finally:
        region = None  # its export of the buffer ends before the close
        channel.close()
        mem.close()
        mem.unlink()
