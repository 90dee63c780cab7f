"""Shared-memory regions that clients register (RegisterSharedMemory), so that a request's tensors
can be referenced by region and offset (TensorRef) instead of carried in the message.

A region belongs to the caller that registered it (its identity where auth is on, else its
connection's quota key) and is found by (owner, name) only: another caller's region reads as one
that does not exist. A region is mapped once, at registration:

- system: the POSIX shared-memory object /dev/shm/<key> (shm_open's "/key"), opened without
  following links, a regular file only, mapped read-write from `offset` for `byte_size` bytes;
- cuda: device memory of another process, opened from its CUDA IPC handle on the GPU it lives on
  (gdn_client.proto.cuda_ipc), on a server whose backend is CUDA.

On a CUDA server (`DeviceAccess`) a system region is also page-locked at registration, so that
the backend copies its big tensors to the GPU by DMA instead of through its staging buffer, and
tensors in CUDA regions are checked on their GPU (`DeviceAccess.check`: one kernel launch for the
requests that arrive together, polled) and copied by the backend on the device: nothing of theirs
crosses the host. A reference into CUDA memory is a `DeviceSpan` (an address), not a tensor view.

It is unmapped when its owner unregisters it, when no request has used it for `idle_s` (a client
that died must not pin memory for ever: `sweep`), and at shutdown (`close`). A request that holds
views of a region keeps that memory mapped until it is answered (a system region's memoryviews
hold its mapping; a CUDA region's DeviceSpans hold its tensor, whose last reference closes the IPC
mapping), so unmapping never pulls memory from under a step in flight. Each owner holds at most
`max_regions_per_client` regions of `max_bytes_per_client` bytes in all.

`resolver(owner)` is what the wire layer (gdn_server.validation) gets: a function from (region,
offset, byte count) to a view of those bytes (a writable memoryview for system memory, a
`DeviceSpan`, an address, for device memory), raising NotFound or InvalidArgument, with the
check of tensors in device memory as its `check_device`. Nothing below the wire layer learns about regions.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import stat
import time
import weakref
from typing import Any, Callable

from gdn_server.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from gdn_server.limits import MAX_REGION_NAME_LEN, SharedMemoryLimits
from gdn_server.work import DeviceSpan

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # where Linux keeps shm_open's objects
# shm_open's name: one leading '/', then 1..NAME_MAX - 1 characters, none of them '/' or NUL
SHM_KEY = re.compile(r"/[^/\x00]{1,254}")
CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)

# What resolve(region, offset, nbytes, output=False) returns: a memoryview of system memory, or a
# DeviceSpan of CUDA memory; for an output (o_ref) of DMA_OUTPUT_BYTES or more in page-locked
# system memory, a CPU uint8 tensor there, which the CUDA backend's launch writes by DMA (a smaller
# one is copied when the request is answered: one memcpy costs less than a copy call per request)
Resolver = Callable[..., Any]
DMA_OUTPUT_BYTES = 512 << 10


def _nothing() -> None:
    pass


class DeviceAccess:
    """What a registry on a CUDA server does with the GPUs `devices`: opens CUDA IPC handles,
    page-locks system regions and checks tensors in device memory (gdn_server.kernels.TensorScan,
    one per device). Imports torch and the kernels only when made."""

    def __init__(self, devices: list) -> None:
        import torch

        from gdn_client.proto.cuda_ipc import CudaIpcError, open_handle

        self._torch = torch
        self._devices = [torch.device(d) for d in devices]
        self._open_handle, self._ipc_error = open_handle, CudaIpcError
        self._scans: dict = {}

    def open_cuda(self, handle: bytes, device: int, nbytes: int) -> tuple[Any, Callable[[], None]]:
        """The CUDA uint8 tensor of a CUDA IPC handle's memory and its close; InvalidArgument for a
        handle that does not open (it names no region)."""
        try:
            return self._open_handle(handle, device, nbytes)
        except self._ipc_error as e:
            raise InvalidArgument(f"CUDA IPC handle on device {device} does not open: {e}") from None

    def pin(self, address: int, nbytes: int) -> Callable[[], None] | None:
        """Page-locks host memory for DMA; returns its unpin (which first waits for the devices'
        queued work, some of which may still read it), or None where the driver refuses (the
        region then works through the staging buffer)."""
        cudart = self._torch.cuda.cudart()
        error = int(cudart.cudaHostRegister(address, nbytes, 0))
        if error != 0:
            self._clear_last_error()
            log.warning("a system shared-memory region could not be page-locked (CUDA error %d); its tensors "
                        "go through the staging buffer", error)
            return None

        def unpin() -> None:
            for device in self._devices:
                self._torch.cuda.synchronize(device)
            cudart.cudaHostUnregister(address)

        return unpin

    def _clear_last_error(self) -> None:
        """Reads, and so clears, the CUDA runtime's last error: a failed call leaves it set, and
        the next launch's check (torch's, the kernels') would report it as that launch's failure.
        torch's cudart module has no cudaGetLastError; the runtime torch loaded has, by its soname."""
        major = (self._torch.version.cuda or "").split(".")[0]
        try:
            ctypes.CDLL(f"libcudart.so.{major}").cudaGetLastError()
        except (OSError, AttributeError):
            log.warning("could not clear the CUDA runtime's last error; the next launch may report it")

    def check(self, spans: list, rows: int) -> Any:
        """Starts the NaN/Inf check and digests of one request's bf16 tensors [rows, ...] in device
        memory (DeviceSpans, all on one device) there (gdn_server.kernels.TensorScan): a PendingScan
        whose result() is (index of the first tensor holding a NaN or Inf, or None; each row's
        digest)."""
        device = spans[0].device
        scan = self._scans.get(device)
        if scan is None:
            from gdn_server.kernels import TensorScan

            scan = self._scans[device] = TensorScan(device)
        return scan(spans, rows)


class Region:
    """One registered region: its bytes (`memory`) and when a request last used it."""

    __slots__ = ("owner", "name", "kind", "byte_size", "memory", "last_used", "_release", "pinned", "_address",
                 "_device")

    def __init__(self, owner: str, name: str, kind: str, byte_size: int, memory: Any,
                 release: Callable[[], None], now: float, pinned: bool = False) -> None:
        self.owner = owner
        self.name = name
        self.kind = kind  # "system" or "cuda"
        self.byte_size = byte_size
        self.memory = memory  # memoryview (system) or CUDA uint8 tensor (cuda) of byte_size bytes
        self.last_used = now
        self._release = release
        self.pinned = pinned  # system memory page-locked for DMA (a CUDA server's)
        # CUDA memory: its first byte's address and device index, read once (a reference's view is
        # a DeviceSpan, an address: no torch call a reference)
        self._address = self._device = None
        if kind == "cuda":
            self._address, self._device = memory.data_ptr(), memory.device.index

    def view(self, offset: int, nbytes: int) -> Any:
        """The bytes [offset, offset + nbytes) of the region; InvalidArgument past its end."""
        if offset > self.byte_size or nbytes > self.byte_size - offset:
            raise InvalidArgument(
                f"shared-memory region {self.name!r}: bytes [{offset}, {offset + nbytes}) lie past its end "
                f"({self.byte_size} bytes)"
            )
        if self._address is not None:
            return DeviceSpan(self.memory, offset, nbytes, self._address + offset, self._device)
        return self.memory[offset:offset + nbytes]

    def unmap(self) -> None:
        """Drops the registry's hold on the memory: unmapped now, or when the last request using
        it is answered."""
        self.memory = None
        self._release()


class SharedMemoryRegistry:
    """Every registered region of a server process, by (owner, name)."""

    def __init__(self, limits: SharedMemoryLimits, device: DeviceAccess | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._device = device  # None: no CUDA backend (no CUDA regions, no page-locking)
        self._clock = clock
        self._regions: dict[tuple[str, str], Region] = {}
        self._held: dict[str, tuple[int, int]] = {}  # owner -> (regions, bytes)

    def __len__(self) -> int:
        return len(self._regions)

    def register(self, owner: str, name: str, byte_size: int, *, system: tuple[str, int] | None = None,
                 cuda: tuple[bytes, int] | None = None) -> Region:
        """Maps a region for `owner`: `system` (key, offset) or `cuda` (ipc handle, device).
        InvalidArgument for a malformed request, an object that is not there or too small, or a
        name the owner already uses; ResourceExhausted beyond the owner's bounds;
        FailedPrecondition for CUDA memory on a server without a CUDA backend."""
        if not 0 < len(name) <= MAX_REGION_NAME_LEN:
            raise InvalidArgument(f"a region's name has 1..{MAX_REGION_NAME_LEN} characters, got {len(name)}")
        if (system is None) == (cuda is None):
            raise InvalidArgument("a region is either system or cuda shared memory")
        if byte_size < 1:
            raise InvalidArgument("a region's byte_size must be at least 1")
        if (owner, name) in self._regions:
            raise InvalidArgument(f"shared-memory region {name!r} is already registered: unregister it first")
        regions, held = self._held.get(owner, (0, 0))
        lim = self.limits
        if regions + 1 > lim.max_regions_per_client:
            raise ResourceExhausted(f"a client holds at most {lim.max_regions_per_client} shared-memory regions")
        if held + byte_size > lim.max_bytes_per_client:
            raise ResourceExhausted(
                f"a client maps at most {lim.max_bytes_per_client} bytes of shared memory; it holds {held}, "
                f"this region would add {byte_size}"
            )
        pinned = False
        if system is not None:
            memory, release, pinned = map_system(system[0], system[1], byte_size,
                                                 None if self._device is None else self._device.pin)
            kind = "system"
        else:
            handle, device = cuda
            if self._device is None:
                raise FailedPrecondition("CUDA shared memory needs a server on the CUDA backend; this one runs on the CPU")
            if len(handle) != CUDA_IPC_HANDLE_BYTES:
                raise InvalidArgument(f"a CUDA IPC handle has {CUDA_IPC_HANDLE_BYTES} bytes, got {len(handle)}")
            if device < 0:
                raise InvalidArgument(f"CUDA device {device} is not a device ordinal")
            memory, close = self._device.open_cuda(handle, device, byte_size)
            # The mapping closes once nothing holds its tensor: a request's DeviceSpans hold it
            # until the request is answered (its launch done), so a region unregistered, swept or
            # shut while a step reads it closes after that step, never under it (the kernels
            # would fault on a closed mapping, and such a fault ends every request of the process)
            weakref.finalize(memory, close).atexit = False  # at exit the driver frees it anyway
            release = _nothing
            kind = "cuda"
        region = Region(owner, name, kind, byte_size, memory, release, self._clock(), pinned)
        self._regions[(owner, name)] = region
        self._held[owner] = (regions + 1, held + byte_size)
        return region

    def unregister(self, owner: str, name: str) -> int:
        """Unmaps the owner's region `name` ("": all of the owner's); returns how many went.
        NotFound for a name the owner has no region of."""
        if name:
            region = self._regions.get((owner, name))
            if region is None:
                raise NotFound(f"no shared-memory region {name!r}")
            self._drop(region)
            return 1
        mine = [r for r in self._regions.values() if r.owner == owner]
        for region in mine:
            self._drop(region)
        return len(mine)

    def resolver(self, owner: str) -> Resolver:
        """The resolve(region, offset, nbytes) of `owner`'s requests (see the module docstring)."""
        regions, clock = self._regions, self._clock

        def resolve(name: str, offset: int, nbytes: int, output: bool = False) -> Any:
            region = regions.get((owner, name))
            if region is None:
                raise NotFound(f"no shared-memory region {name!r}")
            region.last_used = clock()
            view = region.view(offset, nbytes)
            if output and region.pinned and nbytes >= DMA_OUTPUT_BYTES:
                import torch  # a CUDA server's: loaded

                return torch.frombuffer(view, dtype=torch.uint8)  # the launch writes it by DMA
            return view

        resolve.check_device = None if self._device is None else self._device.check  # type: ignore[attr-defined]
        return resolve

    def sweep(self) -> list[Region]:
        """Unmaps the regions no request has used for `idle_s`; returns them."""
        deadline = self._clock() - self.limits.idle_s
        idle = [r for r in self._regions.values() if r.last_used < deadline]
        for region in idle:
            log.info("shared-memory region %r of %s unmapped after %.0f s unused", region.name, region.owner,
                     self.limits.idle_s)
            self._drop(region)
        return idle

    def close(self) -> None:
        """Unmaps every region (shutdown)."""
        for region in list(self._regions.values()):
            self._drop(region)

    def _drop(self, region: Region) -> None:
        del self._regions[(region.owner, region.name)]
        regions, held = self._held[region.owner]
        if regions == 1:
            del self._held[region.owner]
        else:
            self._held[region.owner] = (regions - 1, held - region.byte_size)
        region.unmap()


def map_system(key: str, offset: int, byte_size: int, pin: Callable[[int, int], Callable[[], None] | None] | None = None,
               ) -> tuple[memoryview, Callable[[], None], bool]:
    """Maps bytes [offset, offset + byte_size) of the shm object `key` read-write: its memoryview,
    the function that unmaps it (at once, or once the last view of it is gone) and whether it is
    page-locked (by `pin` (address, bytes) -> unpin, where given and the driver agrees).
    InvalidArgument where `key` is not a plain shm_open name, or the object is not there, not a
    regular file the server may read and write, or smaller than offset + byte_size."""
    if SHM_KEY.fullmatch(key) is None or key in ("/.", "/.."):
        raise InvalidArgument(f"shared-memory key {key[:64]!r} is not a plain shm_open name (\"/name\", no other '/')")
    try:
        fd = os.open(SHM_DIR + key, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise InvalidArgument(f"shared-memory object {key!r} cannot be opened: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(f"shared-memory object {key!r} is not a regular shared-memory object")
        if offset > info.st_size or byte_size > info.st_size - offset:
            raise InvalidArgument(
                f"shared-memory object {key!r} has {info.st_size} bytes: [{offset}, {offset + byte_size}) lies past its end"
            )
        start = offset - offset % mmap.ALLOCATIONGRANULARITY  # mmap's offset must be page-aligned
        mapping = mmap.mmap(fd, byte_size + (offset - start), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                            offset=start)
    finally:
        os.close(fd)
    unpin = None
    if pin is not None:
        anchor = ctypes.c_char.from_buffer(mapping)  # the mapping's address (the export ends with it)
        address = ctypes.addressof(anchor)
        del anchor
        unpin = pin(address, len(mapping))
    whole = memoryview(mapping)
    view = whole[offset - start:]

    def release() -> None:
        if unpin is not None:  # before the unmap, and once no queued copy reads it
            unpin()
        view.release()
        whole.release()
        try:
            mapping.close()
        except BufferError:  # a request in flight still holds a view: unmapped when it lets go
            pass

    return view, release, unpin is not None
