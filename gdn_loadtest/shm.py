"""gdn-loadtest --shared-memory system|cuda: clients whose tensors live in shared memory.

A `SharedMemoryWorker` is a `GdnWorker` that keeps its input sets and its output in a region it
registers with the server (host shared memory, or memory of this host's GPU through CUDA IPC;
gdn_client's `Region`), so its requests carry references (TensorRef, o_ref) instead of tensor
bytes: the load of a client on the server's host. Its echo run beside it sends the same (small)
messages, so the pair still compares the server with the gRPC floor of what went over the wire.
The server must run with --allow-shared-memory, on the same host.
"""
from __future__ import annotations

import grpc
import torch

from gdn_client import ModelInfo
from gdn_client._errors import error_from_rpc
from gdn_client._shared_memory import Region
from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_loadtest.config import LoadConfig
from gdn_loadtest.workers import INPUT_SETS, GdnWorker

__all__ = ["MODES", "SharedMemoryWorker", "gdn_worker"]

MODES = ("none", "system", "cuda")  # --shared-memory: inline tensors, or where the region lives


def gdn_worker(cfg: LoadConfig, info: ModelInfo, index: int) -> GdnWorker:
    """The load client `index` of a gdn run: tensors inline, or in shared memory."""
    return GdnWorker(cfg, info, index) if cfg.shared_memory == "none" else SharedMemoryWorker(cfg, info, index)


class SharedMemoryWorker(GdnWorker):
    """A load client whose INPUT_SETS input sets and output are tensors of its region."""

    def __init__(self, cfg: LoadConfig, info: ModelInfo, index: int) -> None:
        super().__init__(cfg, info, index)
        B, T, HV, V = cfg.batch, cfg.tokens, info.num_v_heads, info.head_dim_v
        nbytes = sum(x.numel() * x.element_size() for x in self.inputs[0]) * INPUT_SETS + 2 * B * T * HV * V
        self.region = Region(nbytes + 6 * INPUT_SETS * 256, "cpu" if cfg.shared_memory == "system" else "cuda")
        self.placed = []  # per input set: (offset of q, k, v, a, b in the region)
        for inputs in self.inputs:
            offsets = []
            for x in inputs:
                t = self.region.tensor(x.shape, x.dtype)
                t.copy_(x)
                offsets.append(self.region.reference(t))
            self.placed.append(offsets)
        self.output = self.region.tensor((B, T, HV, V))
        if self.region.device.type == "cuda":
            torch.cuda.synchronize(self.region.device)  # the inputs are written before any request

    async def open(self) -> None:
        try:
            await self.stub.RegisterSharedMemory(self.region.register_request(), timeout=self.cfg.timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        await super().open()

    def request_body(self, index: int) -> bytes:
        """Input set `index` by reference, o into the region."""
        request = gdn_pb2.DecodeRequest(session_ids=self.session_ids)
        for name, x, offset in zip("qkvab", self.inputs[index], self.placed[index]):
            tensor = getattr(request, name)
            tensor.dtype = {torch.bfloat16: gdn_pb2.BF16, torch.float16: gdn_pb2.F16, torch.float32: gdn_pb2.F32}[x.dtype]
            tensor.shape[:] = list(x.shape)
            tensor.ref.region, tensor.ref.offset = self.region.name, offset
        request.o_ref.region, request.o_ref.offset = self.region.name, self.region.reference(self.output)
        return request.SerializeToString()

    async def close(self) -> None:
        try:
            await self.stub.UnregisterSharedMemory(gdn_pb2.UnregisterSharedMemoryRequest(name=self.region.name),
                                                   timeout=self.cfg.timeout)
        except grpc.RpcError:
            pass  # the server is gone, or dropped it: it holds nothing of it
        await super().close()
        self.region.close()
