"""Shared-memory regions that clients register (RegisterSharedMemory), so that a request's tensors
can be referenced by region and offset (TensorRef) instead of carried in the message.

A region belongs to the caller that registered it (its identity where auth is on, else its
connection's quota key) and is found by (owner, name) only: another caller's region reads as one
that does not exist. A region is mapped once, at registration:

- system: the POSIX shared-memory object /dev/shm/<key> (shm_open's "/key"), opened without
  following links, a regular file only, mapped read-write from `offset` for `byte_size` bytes;
- cuda: device memory of another process, opened from its CUDA IPC handle on the GPU it lives on
  (gdn_client.proto.cuda_ipc), on a server whose backend is CUDA.

On a CUDA server (`DeviceAccess`) a system region is also page-locked at registration, which
makes it readable and writable by the GPUs at its own address. Tensors in CUDA regions, and the
references of a big request (one with a tensor of DEVICE_READ_BYTES or more) into page-locked
memory, are `DeviceSpan`s (addresses), not views. A big request's the GPU checks
(`DeviceAccess.check`: one kernel launch for the requests that arrive together, polled) and the
backend's launch reads in place, with none of their bytes passing through the server's CPU; a
small request's inputs in CUDA memory are copied to the host (`DeviceAccess.read`, the copies of
the requests that arrive together made back to back) and checked and staged as a message's bytes
are. An o_ref in CUDA memory is written by the launch.

It is unmapped when its owner unregisters it, when no request has used it for `idle_s` (a client
that died must not pin memory for ever: `sweep`), and at shutdown (`close`). A request that holds
views of a region keeps that memory mapped until it is answered (a memoryview holds its system
region's mapping; a DeviceSpan holds its region's tensor, whose last reference closes the IPC
mapping, or ends the page-lock and then the mapping), so unmapping never pulls memory from under
a step in flight. Each owner holds at most `max_regions_per_client` regions of
`max_bytes_per_client` bytes in all.

`resolver(owner)` is what the wire layer (gdn_server.validation) gets: a `Resolver`, called with
(region, offset, byte count, device_read) for a view of those bytes (a writable memoryview of
system memory, or a `DeviceSpan` of memory the GPU reads in place), raising NotFound or
InvalidArgument, with the check of tensors the GPU reads as its `check_device` and a memo of the
owner's request layouts. Nothing below the wire layer learns about regions.
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
from gdn_server.limits import MAX_LAYOUTS_PER_CLIENT, MAX_REGION_NAME_LEN, SharedMemoryLimits
from gdn_server.work import DeviceSpan

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # where Linux keeps shm_open's objects
# shm_open's name: one leading '/', then 1..NAME_MAX - 1 characters, none of them '/' or NUL
SHM_KEY = re.compile(r"/[^/\x00]{1,254}")
CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)

# A request with a tensor of this many bytes or more in page-locked memory is read by the GPU
# there: the check on the GPU and the launch's own reads cost less than the CPU's passes over
# its bytes (NaN/Inf check and digests, the copy into the staging buffer), which also leave the
# CPU's caches cold for the rest of the step (bench/DECISIONS.md, entry 23); a smaller one is
# checked and copied by the CPU, which answers sooner than a check launch can (its inputs in
# CUDA memory copied to the host first, `DeviceAccess.read`)
DEVICE_READ_BYTES = 512 << 10
# A small request's tensors in CUDA memory are copied to the host by one copy per run of them
# lying at most this far apart in one region (`DeviceAccess.read`): a few KB more bytes cost less
# than another copy call
READ_GAP_BYTES = 4096


def _nothing() -> None:
    pass


class DeviceAccess:
    """What a registry on a CUDA server does with the GPUs `devices`: opens CUDA IPC handles,
    page-locks system regions, checks a big request's tensors in device memory
    (gdn_server.kernels.TensorScan, one per device) and copies small ones' to the host, the
    requests that arrive together at once (`read`).
    Imports torch and the kernels only when made."""

    def __init__(self, devices: list) -> None:
        import torch

        from gdn_client.proto.cuda_ipc import CudaIpcError, open_handle
        from gdn_server.kernels._cudart import clear_last_error

        self._torch = torch
        self._devices = [torch.device(d) for d in devices]
        # the GPU that checks the tensors in page-locked host memory (every GPU can read them)
        self.host_check_device = self._devices[0].index
        self._open_handle, self._ipc_error = open_handle, CudaIpcError
        self._clear_last_error = clear_last_error  # after a failed runtime call (page-locking, copies)
        self._scans: dict = {}
        self._reads: _ReadBatch | None = None  # the copies out of CUDA memory not made yet
        self._pinned: Any = None  # where they land first (grown to the largest batch)

    def open_cuda(self, handle: bytes, device: int, nbytes: int) -> tuple[Any, Callable[[], None]]:
        """The CUDA uint8 tensor of a CUDA IPC handle's memory and its close; InvalidArgument for a
        handle that does not open (it names no region)."""
        try:
            return self._open_handle(handle, device, nbytes)
        except self._ipc_error as e:
            raise InvalidArgument(f"CUDA IPC handle on device {device} does not open: {e}") from None

    def pin(self, address: int, nbytes: int) -> Callable[[], None] | None:
        """Page-locks host memory, mapped for every GPU at its own address (what a 64-bit host's
        unified addressing gives); returns its unpin (which first waits for the devices' queued
        work, some of which may still read it), or None where the driver refuses or the GPU would
        see it at another address (the region then works through the staging buffer)."""
        cudart = self._cudart()
        error = cudart.cudaHostRegister(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), 0)
        if error == 0 and not self._same_address(address):
            cudart.cudaHostUnregister(ctypes.c_void_p(address))
            error = -1
        if error != 0:
            self._clear_last_error()
            log.warning("a system shared-memory region could not be page-locked at its own address (CUDA error "
                        "%d); its tensors go through the staging buffer", error)
            return None

        def unpin() -> None:
            for device in self._devices:
                self._torch.cuda.synchronize(device)
            cudart.cudaHostUnregister(ctypes.c_void_p(address))

        return unpin

    def _same_address(self, address: int) -> bool:
        """Whether the GPUs see page-locked `address` at that address (cudaHostGetDevicePointer)."""
        pointer = ctypes.c_void_p()
        try:
            error = self._cudart().cudaHostGetDevicePointer(ctypes.byref(pointer), ctypes.c_void_p(address), 0)
        except (OSError, AttributeError):
            return False
        return error == 0 and pointer.value == address

    def _cudart(self) -> Any:
        """The CUDA runtime torch loaded, through ctypes: torch's cudart module lacks some of the
        calls made here (cudaHostGetDevicePointer, cudaMemcpyAsync)."""
        from gdn_server.kernels._cudart import runtime

        return runtime()

    def read(self, spans: list) -> "PendingRead":
        """Starts the copy of a small request's DeviceSpans into host memory: what the CPU then
        checks and stages like a message's bytes (see DEVICE_READ_BYTES). The copies of every
        request that joins before the first poll or read of any of them run together: one
        `cudaMemcpyAsync` per run of spans at most READ_GAP_BYTES apart in one memory, back to
        back into pinned memory, and one synchronize of the device's legacy stream (which waits
        for none of the launches' streams) for all of them. A CUDA call costs 2-3x as much
        between the rest of a step's work as next to another (the caches it runs from gone cold:
        bench/DECISIONS.md, entry 23), so a turn's copies cost less made together than one
        synchronous copy per request as it arrives."""
        batch = self._reads
        if batch is None or batch.copied:
            batch = self._reads = _ReadBatch(self)
        return batch.add(spans)

    def _copy_out(self, runs: list[tuple[int, int]]) -> bytearray:
        """The bytes of device memory [address, end) of each run, one after another, copied into
        pinned memory and then into a bytearray of their own (the pinned buffer is the next
        batch's). RuntimeError where a copy fails."""
        total = max(1, sum(end - start for start, end in runs))
        pinned = self._pinned
        if pinned is None or pinned.numel() < total:
            pinned = self._pinned = self._torch.empty(max(total, 1 << 20), dtype=self._torch.uint8, pin_memory=True)
        from gdn_server.kernels._cudart import MEMCPY_DEFAULT

        cudart = self._cudart()
        base, offset = pinned.data_ptr(), 0
        if len(runs) == 1:  # one call where there is one copy: the synchronous one
            start, end = runs[0]
            error = cudart.cudaMemcpy(ctypes.c_void_p(base), ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                                      MEMCPY_DEFAULT)
        else:
            for start, end in runs:
                error = cudart.cudaMemcpyAsync(ctypes.c_void_p(base + offset), ctypes.c_void_p(start),
                                               ctypes.c_size_t(end - start), MEMCPY_DEFAULT, None)
                if error != 0:
                    break
                offset += end - start
            else:
                error = cudart.cudaStreamSynchronize(None)
        if error != 0:
            self._clear_last_error()
            raise RuntimeError(f"copying requests' tensors out of CUDA memory failed (CUDA error {error})")
        return bytearray(memoryview(pinned.numpy())[:total])

    def check(self, spans: list, rows: int) -> Any:
        """Starts the NaN/Inf check and digests of one request's bf16 tensors [rows, ...] that a
        GPU reads (DeviceSpans, all on one device) there (gdn_server.kernels.TensorScan): a PendingScan
        whose result() is (index of the first tensor holding a NaN or Inf, or None; each row's
        digest)."""
        device = spans[0].device
        scan = self._scans.get(device)
        if scan is None:
            from gdn_server.kernels import TensorScan

            scan = self._scans[device] = TensorScan(device)
        return scan(spans, rows)


class _ReadBatch:
    """The copies out of CUDA memory of the requests that joined before any of them was polled."""

    __slots__ = ("_access", "_requests", "copied", "_host", "_at", "_error")

    def __init__(self, access: DeviceAccess) -> None:
        self._access = access
        self._requests: list[list] = []  # each request's spans
        self.copied = False
        self._host: memoryview | None = None  # every run's bytes, one after another
        self._at: dict[int, int] = {}  # id(span) -> where its bytes start in `_host`
        self._error: Exception | None = None

    def add(self, spans: list) -> "PendingRead":
        self._requests.append(spans)
        return PendingRead(self, len(self._requests) - 1)

    def copy(self) -> None:
        """Makes every request's copies (once); a failure is each request's to raise. The spans of
        all the requests in address order: CUDA allocations do not interleave, so one memory's
        spans come together, and those at most READ_GAP_BYTES apart go in one copy (a request's
        tensors usually lie so, and a stream's requests of one turn often do too)."""
        if self.copied:
            return
        self.copied = True
        runs: list[tuple[int, int]] = []  # [address, end) of each copy
        at = self._at
        done = 0  # the bytes of the runs before the current one
        start = end = 0
        memory = None
        for span in sorted((span for spans in self._requests for span in spans), key=_address):
            address = span.address
            if span.memory is memory and address - end <= READ_GAP_BYTES:
                end = max(end, address + span.nbytes)
            else:
                if memory is not None:
                    runs.append((start, end))
                    done += end - start
                start, end, memory = address, address + span.nbytes, span.memory
            at[id(span)] = done + address - start
        if memory is not None:
            runs.append((start, end))
        try:
            self._host = memoryview(self._access._copy_out(runs))
        except RuntimeError as e:
            self._error = e

    def result(self, index: int) -> list[memoryview]:
        self.copy()
        if self._error is not None:
            raise self._error
        host, at = self._host, self._at
        return [host[at[id(span)]:at[id(span)] + span.nbytes] for span in self._requests[index]]


def _address(span: DeviceSpan) -> int:
    return span.address


class PendingRead:
    """One request's copy out of CUDA memory (`DeviceAccess.read`): `ready()` makes its batch's
    copies if they are not made yet (so it is always ready after), `result()` is its spans' bytes
    in host memory, in order. RuntimeError for a copy that failed."""

    __slots__ = ("_batch", "_index")

    def __init__(self, batch: _ReadBatch, index: int) -> None:
        self._batch, self._index = batch, index

    def ready(self) -> bool:
        self._batch.copy()
        return True

    def result(self) -> list[memoryview]:
        return self._batch.result(self._index)


class Region:
    """One registered region: its bytes (`memory`) and when a request last used it."""

    __slots__ = ("owner", "name", "kind", "byte_size", "memory", "last_used", "_release", "_device_memory",
                 "_address", "_device")

    def __init__(self, owner: str, name: str, kind: str, byte_size: int, memory: Any,
                 release: Callable[[], None], now: float, device_memory: Any = None,
                 device: int | None = None) -> None:
        self.owner = owner
        self.name = name
        self.kind = kind  # "system" or "cuda"
        self.byte_size = byte_size
        self.memory = memory  # memoryview (system) or CUDA uint8 tensor (cuda) of byte_size bytes
        self.last_used = now
        self._release = release
        # What a GPU reads in place: the CUDA tensor, or a page-locked system region's bytes as a
        # CPU uint8 tensor (None: not page-locked); a reference's DeviceSpan holds it, and with it
        # the mapping or the page-lock. Its first byte's address and the device that checks its
        # tensors, read once (a reference is an address: no torch call a reference).
        self._device_memory = device_memory
        self._address = self._device = None
        if device_memory is not None:
            self._address = device_memory.data_ptr()
            self._device = device_memory.device.index if kind == "cuda" else device

    def view(self, offset: int, nbytes: int, device_read: bool = False) -> Any:
        """The bytes [offset, offset + nbytes) of the region: a DeviceSpan of CUDA memory, and with
        `device_read` of page-locked memory at an even address (the GPU's copies move bf16
        words); else a memoryview. InvalidArgument past its end."""
        if offset > self.byte_size or nbytes > self.byte_size - offset:
            raise InvalidArgument(
                f"shared-memory region {self.name!r}: bytes [{offset}, {offset + nbytes}) lie past its end "
                f"({self.byte_size} bytes)"
            )
        address = self._address
        if address is not None and (self.kind == "cuda" or device_read and (address + offset) % 2 == 0):
            return DeviceSpan(self._device_memory, offset, nbytes, address + offset, self._device)
        return self.memory[offset:offset + nbytes]

    def unmap(self) -> None:
        """Drops the registry's hold on the memory: unmapped now, or when the last request using
        it is answered."""
        self.memory = self._device_memory = None
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
        # owner -> {a request's references: (the regions they name, what validation made of
        # them)}: a client's requests name the same few tensors over and over (`Resolver.recall`)
        self._layouts: dict[str, dict[Any, tuple[tuple[Region, ...], Any]]] = {}

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
        device_memory = device_index = None
        if system is not None:
            memory, release, device_memory = map_system(system[0], system[1], byte_size,
                                                        None if self._device is None else self._device.pin)
            kind = "system"
            if device_memory is not None:
                device_index = self._device.host_check_device
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
            device_memory, kind = memory, "cuda"
        region = Region(owner, name, kind, byte_size, memory, release, self._clock(), device_memory, device_index)
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

    def resolver(self, owner: str) -> "Resolver":
        """The resolution of `owner`'s references (see the module docstring and `Resolver`)."""
        return Resolver(self, owner)

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
        # every layout the owner's requests had resolved goes with any of its regions: a name
        # registered again names other memory, and the views must not hold the mapping open
        self._layouts.pop(region.owner, None)
        del self._regions[(region.owner, region.name)]
        regions, held = self._held[region.owner]
        if regions == 1:
            del self._held[region.owner]
        else:
            self._held[region.owner] = (regions - 1, held - region.byte_size)
        region.unmap()


class Resolver:
    """One owner's references resolved, for validation: called with (region, offset, nbytes,
    device_read=False), a view of those bytes (a writable memoryview of system memory, or a
    DeviceSpan of memory a GPU reads in place; see `Region.view`), NotFound for a region the
    owner has not registered, InvalidArgument past its end. `check_device` and `read_device` are
    the GPU's check and copy out of such spans (`DeviceAccess`; None without a CUDA backend).

    `keep(key, names, layout)` remembers what validation made of a request's references (`key`
    naming them, `names` the regions they lie in) and `recall(key)` gives it back: a client's
    requests name the same few tensors again and again, and resolving six references costs the
    event loop more than checking the bytes they name (bench/validation.py). What an owner keeps
    is forgotten when any of its regions goes, and at MAX_LAYOUTS_PER_CLIENT layouts."""

    __slots__ = ("_regions", "_owner", "_clock", "_registry", "check_device", "read_device")

    def __init__(self, registry: SharedMemoryRegistry, owner: str) -> None:
        self._registry, self._owner = registry, owner
        self._regions, self._clock = registry._regions, registry._clock
        device = registry._device
        self.check_device = None if device is None else device.check
        self.read_device = None if device is None else device.read

    def __call__(self, name: str, offset: int, nbytes: int, device_read: bool = False) -> Any:
        region = self._regions.get((self._owner, name))
        if region is None:
            raise NotFound(f"no shared-memory region {name!r}")
        region.last_used = self._clock()
        return region.view(offset, nbytes, device_read)

    def recall(self, key: Any) -> Any:
        """The layout kept for `key`, its regions marked used now; None if none is."""
        kept = self._registry._layouts.get(self._owner)
        hit = None if kept is None else kept.get(key)
        if hit is None:
            return None
        now = self._clock()
        for region in hit[0]:
            region.last_used = now
        return hit[1]

    def keep(self, key: Any, names: Any, layout: Any) -> None:
        """Remembers `layout` for `key`; `names` the regions its references lie in (registered)."""
        kept = self._registry._layouts.setdefault(self._owner, {})
        if len(kept) >= MAX_LAYOUTS_PER_CLIENT:
            kept.clear()
        kept[key] = (tuple(self._regions[(self._owner, name)] for name in set(names)), layout)


def map_system(key: str, offset: int, byte_size: int, pin: Callable[[int, int], Callable[[], None] | None] | None = None,
               ) -> tuple[memoryview, Callable[[], None], Any]:
    """Maps bytes [offset, offset + byte_size) of the shm object `key` read-write: its memoryview,
    the function that unmaps it (at once, or once the last view of it is gone) and, where `pin`
    (address, bytes) -> unpin page-locks it, the same bytes as a CPU uint8 tensor (else None),
    whose last reference ends the page-lock. InvalidArgument where `key` is not a plain shm_open
    name, or the object is not there, not a regular file the server may read and write, or
    smaller than offset + byte_size."""
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
    locked = None
    if pin is not None:
        anchor = ctypes.c_char.from_buffer(mapping)  # the mapping's address (the export ends with it)
        address = ctypes.addressof(anchor)
        del anchor
        unpin = pin(address, len(mapping))
        if unpin is not None:
            import torch  # a CUDA server's: loaded

            # The page-lock lasts as long as this tensor (the region's, then the DeviceSpans' of the
            # requests in flight): a launch that reads or writes it never meets unlocked memory. It
            # holds an export of the mapping, so the unmap follows the unpin.
            locked = torch.frombuffer(mapping, dtype=torch.uint8, count=byte_size, offset=offset - start)
            weakref.finalize(locked, unpin).atexit = False  # at exit the driver drops the lock anyway
    whole = memoryview(mapping)
    view = whole[offset - start:]

    def release() -> None:
        view.release()
        whole.release()
        try:
            mapping.close()
        except BufferError:  # a request in flight still holds a view: unmapped when it lets go
            pass

    return view, release, locked
