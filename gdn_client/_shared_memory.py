"""Tensors through shared memory: a region of host shared memory or GPU memory that the client
registers with a server on the same host, so that steps pass tensors living there by reference
(region and offset) instead of carrying their bytes (gdn.v1.TensorRef; docs/protocol.md).

`SharedMemory` (blocking) and `AsyncSharedMemory` (asyncio) are what `Client.shared_memory()` and
`AsyncClient.shared_memory()` return. Both are a `Region` (allocation, tensors handed out, the
references of a step's tensors, no I/O) and the client they register it with. A step whose
inputs live in a registered region sends references for them; its `out=` tensor, in a region
too, is where the server writes o. Every other tensor travels inline as before, in the same
request if need be.

A region is registered with each server process that a step using it goes to, on first use, and
again when a server answers NOT_FOUND for it (it unmaps regions no request has used for a while,
and without auth a region belongs to the connection that registered it). It is unregistered and
freed on `close()` (the context manager's exit).
"""
from __future__ import annotations

import itertools
import os
import threading
import uuid
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch

from gdn_client._errors import GdnError, InvalidArgumentError, NotFoundError
from gdn_client.proto.gdn.v1 import gdn_pb2

if TYPE_CHECKING:
    from gdn_client._aio import AsyncClient
    from gdn_client._client import Client

__all__ = ["Region", "SharedMemory", "AsyncSharedMemory", "missing_region"]

ALIGN = 256  # bytes: each tensor handed out starts here, for the kernel's vector loads and DMA
SHM_DIR = "/dev/shm"  # where Linux keeps shm_open's objects
_MISSING = "no shared-memory region "  # how the server's NOT_FOUND for a region begins
_names = itertools.count()


def missing_region(err: GdnError) -> bool:
    """Whether `err` is a server's NOT_FOUND for a shared-memory region (dropped or never there)."""
    return isinstance(err, NotFoundError) and err.message.startswith(_MISSING)


class Region:
    """`byte_size` bytes of shared memory: host memory from shm_open (``device="cpu"``), or
    memory of a local GPU with a CUDA IPC handle (``device="cuda"`` or ``"cuda:N"``).

    Host memory is a new POSIX shared-memory object, readable and writable by this user only
    (mode 0600: a server running as another user cannot open it), mapped by torch: tensors handed
    out keep the mapping alive after `close`, which removes the object's name.

    >>> region = Region(1 << 20)                                       # doctest: +SKIP
    >>> q = region.tensor((1, 1, 16, 128))                              # doctest: +SKIP
    >>> region.reference(q)                                             # doctest: +SKIP
    0
    >>> region.close()                                                  # doctest: +SKIP
    """

    def __init__(self, byte_size: int, device: str | torch.device = "cpu", name: str | None = None) -> None:
        if byte_size < 1:
            raise ValueError(f"a region needs at least 1 byte, got {byte_size}")
        self.device = torch.device(device)
        self.byte_size = byte_size
        # unique among a process's regions: two clients of one process may share a connection
        self.name = name or f"gdn-{os.getpid()}-{next(_names)}"
        self._lock = threading.Lock()
        self._next = 0  # where the next tensor goes
        self.registered_on: set[int | None] = set()  # server processes that have it (None: the target)
        self._key: str | None = None
        self._cuda: Any = None
        if self.device.type == "cpu":
            key = f"/gdn-{uuid.uuid4().hex}"
            fd = os.open(SHM_DIR + key, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, byte_size)
            except BaseException:
                os.unlink(SHM_DIR + key)
                raise
            finally:
                os.close(fd)
            self._key = key
            self.memory = torch.from_file(SHM_DIR + key, shared=True, size=byte_size, dtype=torch.uint8)
        elif self.device.type == "cuda":
            from gdn_client.proto.cuda_ipc import DeviceAllocation

            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            self._cuda = DeviceAllocation(byte_size, index)
            self.memory = self._cuda.tensor
        else:
            raise ValueError(f"a region lives in host memory (cpu) or on a CUDA device, not {device}")
        self._start = self.memory.data_ptr()

    def register_request(self) -> gdn_pb2.RegisterSharedMemoryRequest:
        """The RegisterSharedMemory request that tells a server about this region."""
        request = gdn_pb2.RegisterSharedMemoryRequest(name=self.name, byte_size=self.byte_size)
        if self._key is not None:
            request.system.key = self._key
        else:
            request.cuda.ipc_handle = self._cuda.handle
            request.cuda.device = self.device.index
        return request

    def tensor(self, shape: Sequence[int], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A new tensor of `shape` living in the region (its contents undefined until written);
        ValueError once the region is full (`reset` starts it over)."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if self.memory is None:
            raise ValueError(f"region {self.name!r} is closed")
        with self._lock:
            start = self._next
            if nbytes > self.byte_size - start:
                raise ValueError(f"region {self.name!r} has {self.byte_size - start} bytes left, {nbytes} asked for")
            self._next = min(self.byte_size, start + -(-nbytes // ALIGN) * ALIGN)
        return self.memory[start:start + nbytes].view(dtype).view(tuple(shape))

    def reset(self) -> None:
        """The next `tensor` starts at the region's beginning again (tensors handed out before
        then share its bytes with the new ones)."""
        with self._lock:
            self._next = 0

    def reference(self, t: torch.Tensor) -> int | None:
        """The byte offset of tensor `t` in this region, or None where `t` does not lie in it
        whole and dense (then it travels inline)."""
        if t.device != self.device or not t.is_contiguous():
            return None
        offset = t.data_ptr() - self._start
        if 0 <= offset and offset + t.numel() * t.element_size() <= self.byte_size:
            return offset
        return None

    def close(self) -> None:
        """Frees the memory (the server must have let go of it: unregister first). Host memory
        loses its name at once and its pages with the last tensor of it; device memory is freed
        at once (its tensors must not be used after)."""
        self.memory = None
        if self._key is not None:
            os.unlink(SHM_DIR + self._key)
            self._key = None
        if self._cuda is not None:
            self._cuda.free()
            self._cuda = None


def references(regions: Iterable[Region], tensors: Sequence[torch.Tensor]) -> list[tuple[Region, int] | None]:
    """For each tensor, the region holding it and its offset there, or None (sent inline)."""
    regions = list(regions)
    out: list[tuple[Region, int] | None] = []
    for t in tensors:
        found = None
        if isinstance(t, torch.Tensor):
            for region in regions:
                offset = region.reference(t)
                if offset is not None:
                    found = (region, offset)
                    break
        out.append(found)
    return out


class _Registered:
    """What both flavours share: the region, its tensors, and leaving the client's list."""

    def __init__(self, client: Any, region: Region) -> None:
        self.client = client
        self.region = region
        client._regions.append(region)

    def tensor(self, shape: Sequence[int], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A new tensor of `shape` in the region (see `Region.tensor`)."""
        return self.region.tensor(shape, dtype)

    def reset(self) -> None:
        """The next `tensor` starts at the region's beginning again."""
        self.region.reset()

    def _leave(self) -> list[int | None]:
        """Takes the region off the client; the server processes to unregister it from (none
        once closed)."""
        if self.region.memory is None:
            return []
        self.client._regions.remove(self.region)
        return list(self.region.registered_on)


class SharedMemory(_Registered):
    """A `Region` registered with a `Client`'s server. Tensors from `tensor()` go by reference
    in `Session.decode`, `Client.decode_batch` and `DecodeStream.submit`; pass ``out=`` a tensor
    of the region for o to be written there.

    >>> with Client("127.0.0.1:50051") as client:                       # doctest: +SKIP
    ...     with client.shared_memory(8 << 20) as shm, client.session() as s:
    ...         q, k = shm.tensor((1, H, K)), shm.tensor((1, H, K))
    ...         v, a, b = shm.tensor((1, HV, V)), shm.tensor((1, HV)), shm.tensor((1, HV))
    ...         o = shm.tensor((1, HV, V))
    ...         q.copy_(torch.randn(1, H, K)); ...                       # fill the inputs in place
    ...         s.decode(0, q, k, v, a, b, out=o)                        # o now holds the output

    Close it (or leave the ``with``) before the client: it unregisters and frees the memory.
    """

    client: "Client"

    def close(self) -> None:
        """Unregisters the region from every server process that has it, then frees it."""
        for process in self._leave():
            try:
                self.client._unregister(self.region, process)
            except GdnError:
                pass  # the server dropped it already, or is gone: nothing of it is held there
        self.region.close()

    def __enter__(self) -> "SharedMemory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSharedMemory(_Registered):
    """The asyncio `SharedMemory` (`AsyncClient.shared_memory()`); ``await close()`` or
    ``async with``.

    >>> async with await client.shared_memory(8 << 20) as shm:         # doctest: +SKIP
    ...     q = shm.tensor((1, H, K))
    ...     o = await session.decode(0, q, k, v, a, b, out=shm.tensor((1, HV, V)))
    """

    client: "AsyncClient"

    async def close(self) -> None:
        """Unregisters the region from every server process that has it, then frees it."""
        for process in self._leave():
            try:
                await self.client._unregister(self.region, process)
            except GdnError:
                pass
        self.region.close()

    async def __aenter__(self) -> "AsyncSharedMemory":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def already_registered(err: GdnError) -> bool:
    """A RegisterSharedMemory refused because the server still has the region under its name."""
    return isinstance(err, InvalidArgumentError) and "already registered" in err.message
