"""Tensors through system shared memory against real server processes (--allow-shared-memory),
with stock gRPC stubs: the wire contract as a client in any language sees it.

Numbers by reference are bit-equal to the same inputs sent inline; every status of the contract,
each with nothing applied; regions belong to the connection that registered them; a region no
request uses is unmapped after --shared-memory-idle-s, a dead client's too; unregistering unmaps.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing import shared_memory

import grpc
import numpy as np
import pytest
import torch

from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from servers import SMALL_MODEL, start_server
from util import decode_request, random_inputs

H, HV, K = 2, 4, 128
REGION_BYTES = 1 << 20
ALIGN = 64


@pytest.fixture(scope="module")
def shm_server():
    with start_server(*SMALL_MODEL, "--max-sessions", "32", "--seed", "7", "--allow-shared-memory") as server:
        yield server


class Stub:
    """One connection to a server: a channel and its GdnDecode stub."""

    def __init__(self, address: str) -> None:
        # a connection of its own (channels of one process to one target share one by default):
        # without auth the server tells callers apart by connection
        self.channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        self.rpc = gdn_pb2_grpc.GdnDecodeStub(self.channel)

    def session(self) -> str:
        return self.rpc.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10).session_id

    def register(self, name: str, key: str, byte_size: int = REGION_BYTES, offset: int = 0) -> None:
        self.rpc.RegisterSharedMemory(gdn_pb2.RegisterSharedMemoryRequest(
            name=name, byte_size=byte_size, system=gdn_pb2.SystemSharedMemory(key=key, offset=offset)), timeout=10)

    def status(self, method: str, request) -> tuple[grpc.StatusCode, str]:
        try:
            getattr(self.rpc, method)(request, timeout=10)
        except grpc.RpcError as e:
            return e.code(), e.details()
        return grpc.StatusCode.OK, ""


@pytest.fixture
def stub(shm_server):
    s = Stub(shm_server.address)
    yield s
    s.channel.close()


@pytest.fixture
def shm():
    """A fresh POSIX shared-memory object of REGION_BYTES, unlinked at the end."""
    mem = shared_memory.SharedMemory(create=True, size=REGION_BYTES)
    yield mem
    mem.close()
    mem.unlink()


def by_reference(req: gdn_pb2.DecodeRequest, mem: shared_memory.SharedMemory, region: str,
                 names: str = "qkvab", start: int = 0, output: bool = True) -> int:
    """Moves the bytes of `names` into `mem` (from `start`, 64-byte aligned) and points the request at
    them; with `output`, o goes to the region after them. Returns the output's offset (or the end)."""
    buf = np.ndarray((len(mem.buf),), dtype=np.uint8, buffer=mem.buf)
    offset = start
    for name in names:
        tensor = getattr(req, name)
        data = tensor.data
        buf[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        tensor.ClearField("data")
        tensor.ref.region, tensor.ref.offset = region, offset
        offset += -(-len(data) // ALIGN) * ALIGN
    if output:
        req.o_ref.region, req.o_ref.offset = region, offset
    return offset


def inputs(seed: int, B: int = 1, T: int = 1, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    return random_inputs(B, T, H, HV, K, gen=torch.Generator().manual_seed(seed), dtype=dtype)


def server_maps(server, key: str) -> bool:
    """Whether the server process has the shm object `key` mapped."""
    with open(f"/proc/{server.proc.pid}/maps") as maps:
        return any(line.rstrip().endswith("/dev/shm" + key) for line in maps)


@pytest.mark.parametrize("dtype,names", [(torch.bfloat16, "qkvab"), (torch.float32, "qvb")])
def test_numbers_by_reference_equal_inline_bytes(stub, shm, dtype, names):
    """Two sessions take the same steps, one inline, one by reference (all or some inputs, the
    output into the region): the outputs are bit-equal, positions advance alike, a retry by
    reference is answered from the first try."""
    stub.register("io", "/" + shm.name)
    inline, shared = stub.session(), stub.session()
    out = np.ndarray((REGION_BYTES,), dtype=np.uint8, buffer=shm.buf)
    for step in range(3):
        x = inputs(step, T=2, dtype=dtype)
        want = stub.rpc.Decode(decode_request(1, [inline], x, [2 * step]), timeout=10)
        req = decode_request(1, [shared], x, [2 * step])
        at = by_reference(req, shm, "io", names)
        got = stub.rpc.Decode(req, timeout=10)
        assert list(got.o.shape) == [1, 2, HV, K] and got.o.data == b"" and got.o.dtype == gdn_pb2.BF16
        assert out[at:at + len(want.o.data)].tobytes() == want.o.data
        assert list(got.positions) == list(want.positions) == [2 * step + 2]
    out[at:at + len(want.o.data)] = 0
    again = stub.rpc.Decode(req, timeout=10)  # the last step resent: answered again, not applied twice
    assert list(again.positions) == [6] and out[at:at + len(want.o.data)].tobytes() == want.o.data
    stub.rpc.UnregisterSharedMemory(gdn_pb2.UnregisterSharedMemoryRequest(name="io"), timeout=10)


def test_a_stream_and_a_batch_by_reference(stub, shm):
    stub.register("io", "/" + shm.name)
    a, b = stub.session(), stub.session()
    c, d = stub.session(), stub.session()
    x = inputs(5, B=2)
    want = stub.rpc.Decode(decode_request(0, [a, b], x, [0, 0]), timeout=10)
    req = decode_request(0, [c, d], x, [0, 0], request_id="r0")
    at = by_reference(req, shm, "io")
    replies = list(stub.rpc.DecodeStream(iter([req]), timeout=10))
    assert replies[0].error_code == 0 and list(replies[0].positions) == [1, 1]
    assert bytes(shm.buf[at:at + len(want.o.data)]) == want.o.data


def test_a_name_registered_again_is_read_anew_by_the_same_references(stub, shm):
    """A client's requests naming the same tensors again reuse their resolution (the server
    keeps it), but only while the regions are the same: a name unregistered and registered again
    over another shm object is read there, and its old memory no more."""
    other = shared_memory.SharedMemory(create=True, size=REGION_BYTES)
    try:
        inline, shared = stub.session(), stub.session()
        for step, mem in enumerate((shm, shm, other, other)):
            if step in (0, 2):
                if step:
                    stub.rpc.UnregisterSharedMemory(gdn_pb2.UnregisterSharedMemoryRequest(name="io"), timeout=10)
                stub.register("io", "/" + mem.name)
            x = inputs(10 + step)
            want = stub.rpc.Decode(decode_request(1, [inline], x, [step]), timeout=10)
            req = decode_request(1, [shared], x, [step])
            at = by_reference(req, mem, "io")  # the same offsets every step
            assert list(stub.rpc.Decode(req, timeout=10).positions) == [step + 1]
            assert bytes(mem.buf[at:at + len(want.o.data)]) == want.o.data
        stub.rpc.UnregisterSharedMemory(gdn_pb2.UnregisterSharedMemoryRequest(name="io"), timeout=10)
    finally:
        other.close()
        other.unlink()


def test_a_clients_remembered_layouts_are_bounded_used_and_go_with_its_regions(shm):
    """What a client's resolver keeps: at most MAX_LAYOUTS_PER_CLIENT layouts (then it starts
    over), another client's never, a recall marks the regions used (the idle sweep spares them),
    and everything of a client goes when any of its regions does."""
    from gdn_server.limits import MAX_LAYOUTS_PER_CLIENT, SharedMemoryLimits
    from gdn_server.shared_memory import SharedMemoryRegistry

    now = [0.0]
    registry = SharedMemoryRegistry(SharedMemoryLimits(idle_s=10), clock=lambda: now[0])
    region = registry.register("c", "io", REGION_BYTES, system=("/" + shm.name, 0))
    registry.register("c", "other", REGION_BYTES, system=("/" + shm.name, 0))
    resolve = registry.resolver("c")
    for i in range(MAX_LAYOUTS_PER_CLIENT):
        resolve.keep(i, ["io", "io"], f"layout {i}")
    assert registry.resolver("c").recall(0) == "layout 0" and registry.resolver("d").recall(0) is None
    resolve.keep("one more", ["io"], "x")
    assert resolve.recall(0) is None and resolve.recall("one more") == "x"
    now[0] = 8.0
    assert resolve.recall("one more") == "x" and region.last_used == 8.0
    now[0] = 15.0
    assert [r.name for r in registry.sweep()] == ["other"]  # "io" was used at 8 s, "other" never
    assert resolve.recall("one more") is None  # its client's region "other" went
    registry.close()


def test_register_statuses(stub, shm, shm_server):
    bad = [
        ("x", "no-slash", REGION_BYTES, 0), ("x", "/a/b", REGION_BYTES, 0), ("x", "/..", REGION_BYTES, 0),
        ("x", "/gdn-test-missing-object", REGION_BYTES, 0),
        ("x", "/" + shm.name, REGION_BYTES + 1, 0), ("x", "/" + shm.name, REGION_BYTES, 1),
        ("x", "/" + shm.name, 1, 2**64 - 1), ("x", "/" + shm.name, 0, 0), ("", "/" + shm.name, 8, 0),
    ]
    for name, key, size, offset in bad:
        req = gdn_pb2.RegisterSharedMemoryRequest(name=name, byte_size=size,
                                                  system=gdn_pb2.SystemSharedMemory(key=key, offset=offset))
        code, details = stub.status("RegisterSharedMemory", req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (key, size, offset, details)
    code, _ = stub.status("RegisterSharedMemory", gdn_pb2.RegisterSharedMemoryRequest(name="x", byte_size=8))
    assert code == grpc.StatusCode.INVALID_ARGUMENT  # neither system nor cuda
    cuda = gdn_pb2.RegisterSharedMemoryRequest(name="x", byte_size=8, cuda=gdn_pb2.CudaSharedMemory(ipc_handle=b"\0" * 64))
    assert stub.status("RegisterSharedMemory", cuda)[0] == grpc.StatusCode.FAILED_PRECONDITION  # a CPU server
    stub.register("r0", "/" + shm.name, 4096, offset=4096)
    code, details = stub.status("RegisterSharedMemory", gdn_pb2.RegisterSharedMemoryRequest(
        name="r0", byte_size=8, system=gdn_pb2.SystemSharedMemory(key="/" + shm.name)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "already registered" in details
    for i in range(1, 16):  # 16 regions per client, the default bound
        stub.register(f"r{i}", "/" + shm.name, 4096)
    code, details = stub.status("RegisterSharedMemory", gdn_pb2.RegisterSharedMemoryRequest(
        name="r16", byte_size=8, system=gdn_pb2.SystemSharedMemory(key="/" + shm.name)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert server_maps(shm_server, "/" + shm.name)
    assert stub.status("UnregisterSharedMemory", gdn_pb2.UnregisterSharedMemoryRequest(name="nope"))[0] == \
        grpc.StatusCode.NOT_FOUND
    stub.rpc.UnregisterSharedMemory(gdn_pb2.UnregisterSharedMemoryRequest(name=""), timeout=10)  # all of them
    assert not server_maps(shm_server, "/" + shm.name)
    stub.register("r16", "/" + shm.name, 4096)  # room again
    stub.rpc.UnregisterSharedMemory(gdn_pb2.UnregisterSharedMemoryRequest(name="r16"), timeout=10)


def test_reference_statuses_apply_nothing(stub, shm, shm_server):
    """Unknown region, another connection's region, past the end, o overlapping an input, data and
    ref together: each refused with its status, and the session's next step is still position 0."""
    stub.register("io", "/" + shm.name)
    other = Stub(shm_server.address)
    try:
        session = stub.session()
        x = inputs(9)

        def refused(edit) -> tuple[grpc.StatusCode, str]:
            req = decode_request(2, [session], x, [0])
            by_reference(req, shm, "io")
            edit(req)
            return stub.status("Decode", req)

        def field(name, **values):
            def edit(req):
                for key, value in values.items():
                    setattr(getattr(req, name).ref if name != "o_ref" else req.o_ref, key, value)
            return edit

        def with_data(req):
            req.v.data = b"\0" * (HV * K * 2)

        cases = [
            (field("q", region="nope"), grpc.StatusCode.NOT_FOUND),
            (field("o_ref", region="nope"), grpc.StatusCode.NOT_FOUND),
            (field("a", offset=2**64 - 1), grpc.StatusCode.INVALID_ARGUMENT),
            (field("o_ref", offset=REGION_BYTES - 8), grpc.StatusCode.INVALID_ARGUMENT),
            (field("o_ref", offset=ALIGN), grpc.StatusCode.INVALID_ARGUMENT),  # overlaps k
            (with_data, grpc.StatusCode.INVALID_ARGUMENT),
        ]
        for edit, code in cases:
            got, details = refused(edit)
            assert got == code, details
        req = decode_request(2, [session], x, [0])
        by_reference(req, shm, "io")
        code, details = other.status("Decode", req)  # another connection names the same region
        assert code == grpc.StatusCode.NOT_FOUND and "no shared-memory region 'io'" in details
        assert other.status("UnregisterSharedMemory", gdn_pb2.UnregisterSharedMemoryRequest(name="io"))[0] == \
            grpc.StatusCode.NOT_FOUND
        assert list(stub.rpc.Decode(req, timeout=10).positions) == [1]  # nothing was applied before
    finally:
        other.channel.close()
        stub.rpc.UnregisterSharedMemory(gdn_pb2.UnregisterSharedMemoryRequest(name=""), timeout=10)


def test_off_by_default(small_server, shm):
    s = Stub(small_server.address)
    try:
        assert not s.rpc.GetModelInfo(gdn_pb2.GetModelInfoRequest(), timeout=10).shared_memory
        req = gdn_pb2.RegisterSharedMemoryRequest(name="x", byte_size=8, system=gdn_pb2.SystemSharedMemory(key="/" + shm.name))
        assert s.status("RegisterSharedMemory", req)[0] == grpc.StatusCode.FAILED_PRECONDITION
        session = s.session()
        ref = decode_request(0, [session], inputs(1), [0])
        by_reference(ref, shm, "x", names="vb", output=False)
        code, details = s.status("Decode", ref)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("v refers to shared memory")
        only_o = decode_request(0, [session], inputs(1), [0])
        only_o.o_ref.region, only_o.o_ref.offset = "x", 0
        code, details = s.status("Decode", only_o)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("o_ref refers to shared memory")
        assert list(s.rpc.Decode(decode_request(0, [session], inputs(1), [0]), timeout=10).positions) == [1]
    finally:
        s.channel.close()


DYING_CLIENT = textwrap.dedent("""
    import sys, time, grpc
    from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
    stub = gdn_pb2_grpc.GdnDecodeStub(grpc.insecure_channel(sys.argv[1]))
    stub.RegisterSharedMemory(gdn_pb2.RegisterSharedMemoryRequest(
        name="mine", byte_size=4096, system=gdn_pb2.SystemSharedMemory(key="/" + sys.argv[2])), timeout=10)
    print("registered", flush=True)
    time.sleep(60)
""")


def test_idle_regions_are_unmapped_a_dead_clients_too(shm):
    """With --shared-memory-idle-s 1: a region in use stays; one left alone is unmapped (a
    reference then is NOT_FOUND), and so is the region of a client killed while holding it."""
    with start_server(*SMALL_MODEL, "--allow-shared-memory", "--shared-memory-idle-s", "1") as server:
        key = "/" + shm.name
        dying = subprocess.Popen([sys.executable, "-c", DYING_CLIENT, server.address, shm.name],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert dying.stdout.readline().strip() == "registered"
            os.kill(dying.pid, signal.SIGKILL)
        finally:
            dying.wait(timeout=10)
        s = Stub(server.address)
        try:
            s.register("io", key)
            session = s.session()
            for step in range(4):  # used every 0.4 s: not idle
                req = decode_request(0, [session], inputs(step), [step])
                by_reference(req, shm, "io")
                s.rpc.Decode(req, timeout=10)
                time.sleep(0.4)
            assert server_maps(server, key)
            deadline = time.monotonic() + 10
            while server_maps(server, key) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not server_maps(server, key)  # both regions unmapped: the dead client's and ours
            code, details = s.status("Decode", req)
            assert code == grpc.StatusCode.NOT_FOUND and "io" in details
            s.register("io", key)  # a client registers it again and goes on
            req.positions[:] = [4]
            assert list(s.rpc.Decode(req, timeout=10).positions) == [5]
        finally:
            s.channel.close()
        assert server.stop() == 0


def test_a_page_locked_region_is_read_in_place_and_stays_locked_while_a_request_holds_it(shm):
    """What a registry on a GPU server does with a system region, the page-lock recorded instead
    of made (this box has no GPU): it locks the mapping's bytes at registration; a reference of a
    request the GPU reads (`device_read`) is a DeviceSpan at the bytes' own address, the other
    references and one at an odd address stay memoryviews; the lock ends once the region is gone
    and no request holds a span of it, whether its owner unregisters it or the server shuts down."""
    import ctypes
    import gc

    from gdn_server.limits import SharedMemoryLimits
    from gdn_server.shared_memory import SharedMemoryRegistry
    from gdn_server.work import DeviceSpan

    events = []

    class RecordedDevice:  # the part of shared_memory.DeviceAccess a system region meets
        check = read = None
        host_check_device = 3

        def pin(self, address: int, nbytes: int):
            events.append(("pin", address, nbytes))
            return lambda: events.append(("unpin", address))

    registry = SharedMemoryRegistry(SharedMemoryLimits(), RecordedDevice())
    registry.register("me", "io", REGION_BYTES, system=("/" + shm.name, 0))
    assert events[0][0] == "pin" and events[0][2] >= REGION_BYTES
    resolve = registry.resolver("me")
    span = resolve("io", 64, 1024, True)
    assert type(span) is DeviceSpan and span.device == 3 and span.nbytes == 1024
    ctypes.memmove(span.address, b"\1\2\3\4", 4)  # the region's own bytes, not a copy
    assert bytes(shm.buf[64:68]) == bytes([1, 2, 3, 4])
    assert bytes(span.tensor()[:4].tolist()) == bytes([1, 2, 3, 4])
    assert type(resolve("io", 64, 1024)) is memoryview  # a small request's: the CPU checks and copies it
    assert type(resolve("io", 65, 1024, True)) is memoryview  # the GPU's copies move 2-byte words
    registry.unregister("me", "io")
    assert [e[0] for e in events] == ["pin"]  # a request in flight holds the span: still locked
    del span
    gc.collect()
    assert events[-1] == ("unpin", events[0][1])
    registry.register("me", "io", REGION_BYTES, system=("/" + shm.name, 0))
    registry.close()
    assert [e[0] for e in events] == ["pin", "unpin", "pin", "unpin"]


def test_a_cuda_region_closes_after_the_last_request_holding_it():
    """A CUDA region's IPC mapping (opened by a stand-in here: this box has no GPU) stays open
    while a request holds a reference into it, whether its owner unregistered it or the server
    shut down meanwhile, and closes when the last such reference goes; a reference is an address
    into the mapping (a DeviceSpan), not a copy."""
    import gc

    from gdn_server.limits import SharedMemoryLimits
    from gdn_server.shared_memory import SharedMemoryRegistry
    from gdn_server.work import DeviceSpan

    closed = []

    class Mapping:  # what DeviceAccess.open_cuda returns: a CUDA uint8 tensor of the region
        device = torch.device("cpu")  # only its index is read
        base = 1 << 40

        def data_ptr(self) -> int:
            return self.base

    class StandInDevice:
        check = read = None

        def open_cuda(self, handle: bytes, device: int, nbytes: int):
            return Mapping(), lambda: closed.append(handle)

    registry = SharedMemoryRegistry(SharedMemoryLimits(), StandInDevice())
    handle = bytes(range(64))
    registry.register("me", "gpu", 1 << 20, cuda=(handle, 0))
    span = registry.resolver("me")("gpu", 4096, 512)
    assert type(span) is DeviceSpan and span.address == Mapping.base + 4096 and span.nbytes == 512
    registry.unregister("me", "gpu")
    gc.collect()
    assert closed == []  # a request still holds it
    del span
    assert closed == [handle]
    registry.register("me", "gpu", 1 << 20, cuda=(handle, 0))
    registry.close()
    assert closed == [handle, handle]  # nothing held it: closed with the registry



def test_the_copies_out_of_cuda_memory_of_one_turn_are_made_together_and_checked_by_the_cpu():
    """Small requests with tensors in CUDA memory (stand-ins here: spans at host addresses, the
    copy itself reading them; this box has no GPU): nothing is copied until the first poll of any
    of them, then every request that joined is copied by one `_copy_out` (a run per cluster of
    tensors, a far one apart), and each request's DecodeWork is what the same bytes inline give.
    A request after that starts the next batch; a NaN copied out is refused by the CPU's check;
    a failed copy fails each request of its batch."""
    import ctypes

    from gdn_server.config import ModelShape
    from gdn_server.errors import InvalidArgument
    from gdn_server.shared_memory import READ_GAP_BYTES, DeviceAccess
    from gdn_server.validation import PendingCheck, decode_work, parse_decode_request, step_limits
    from gdn_server.work import DeviceSpan

    shape = ModelShape(num_layers=3, num_q_heads=H, num_v_heads=HV, head_dim_k=K, head_dim_v=K)
    memory = bytearray(1 << 16)  # the "device" memory of region "r"
    base = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    access = DeviceAccess(["cuda:0"])
    copies = []

    def copy_out(runs):
        copies.append([(start - base, end - base) for start, end in runs])
        if failing:
            raise RuntimeError("copying requests' tensors out of CUDA memory failed (CUDA error 700)")
        return bytearray(b"".join(ctypes.string_at(start, end - start) for start, end in runs))

    access._copy_out = copy_out
    failing = False

    def resolve(region, offset, nbytes, device_read=False):
        return DeviceSpan(memory, offset, nbytes, base + offset, 0)

    resolve.read_device, resolve.check_device = access.read, None
    resolve.recall, resolve.keep = (lambda key: None), (lambda key, names, layout: None)  # no memo here

    def request(seed, at, far=None):
        """A B = 2 step whose five inputs lie from `at` on, 64 bytes apart (v at `far` if given)."""
        x = random_inputs(2, 1, H, HV, K, gen=torch.Generator().manual_seed(seed), dtype=torch.bfloat16)
        req = decode_request(1, [f"s{seed}-0", f"s{seed}-1"], x, request_id=f"r{seed}")
        inline = decode_work(parse_decode_request(req.SerializeToString(), step_limits(shape)), shape)
        offset = at
        for name in "qkvab":
            data = x[name].contiguous().view(torch.uint8).numpy().tobytes()
            where = far if name == "v" and far is not None else offset
            memory[where:where + len(data)] = data
            tensor = getattr(req, name)
            tensor.ClearField("data")
            tensor.ref.region, tensor.ref.offset = "r", where
            offset = where + len(data) + 64 if where == offset else offset
        step = parse_decode_request(req.SerializeToString(), step_limits(shape))
        return decode_work(step, shape, resolve=resolve), inline

    (a, a_inline), (b, b_inline) = request(1, 0, far=4096 + 2 * READ_GAP_BYTES), request(2, 24576)
    assert type(a) is PendingCheck and type(b) is PendingCheck and copies == []
    assert b.ready() and len(copies) == 1 and a.ready() and len(copies) == 1
    (runs,) = copies
    assert len(runs) == 3 and runs[0][0] == 0 and runs[1][0] == 4096 + 2 * READ_GAP_BYTES and runs[2][0] == 24576
    for pending, inline in ((a, a_inline), (b, b_inline)):
        work = pending.work()
        assert work.digests == inline.digests and work.session_ids == inline.session_ids
        assert [bytes(x) for x in work.bf16_bytes] == [bytes(x) for x in inline.bf16_bytes]
    c, _ = request(3, 32768)
    assert len(copies) == 1 and c.ready() and len(copies) == 2  # the next batch
    d, _ = request(4, 40960)
    memory[40960:40962] = b"\xc0\x7f"  # q's first value a bf16 NaN, before the copy
    with pytest.raises(InvalidArgument, match="q has NaN or Inf"):
        d.ready() and d.work()
    failing = True
    e, f = request(5, 49152)[0], request(6, 57344)[0]
    for pending in (e, f):
        assert pending.ready()
        with pytest.raises(RuntimeError, match="CUDA error 700"):
            pending.work()
    assert len(copies) == 4

# -- gdn_client ------------------------------------------------------------------------------------

def test_client_passes_region_tensors_by_reference(shm_server):
    """Client.shared_memory: decode, decode_batch and a stream with inputs and out in the region
    give what plain tensors give, bit for bit; leaving the block unregisters (the server unmaps)."""
    from gdn_client import Client

    with Client(shm_server.address) as client:
        assert client.model_info().shared_memory
        plain, shared = client.create_session(), client.create_session()
        pair = [client.create_session() for _ in range(2)]
        pair_plain = [client.create_session() for _ in range(2)]
        with client.shared_memory(REGION_BYTES) as mem:
            key = mem.region.register_request().system.key
            assert server_maps(shm_server, key)
            x = inputs(21, T=2)
            names = "qkvab"
            one = {n: mem.tensor(x[n].shape[1:]) for n in names}
            for n in names:
                one[n].copy_(x[n][0])
            out = mem.tensor((2, HV, K))
            got = shared.decode(0, *(one[n] for n in names), out=out)
            assert got.data_ptr() == out.data_ptr()
            assert torch.equal(got, plain.decode(0, *(x[n][0] for n in names)))
            xb = inputs(22, B=2)
            batch = {n: mem.tensor(xb[n].shape) for n in names}
            for n in names:
                batch[n].copy_(xb[n])
            out_b = mem.tensor((2, 1, HV, K))
            client.decode_batch(1, pair, *(batch[n] for n in names), out=out_b)
            assert torch.equal(out_b, client.decode_batch(1, pair_plain, *(xb[n] for n in names)))
            with client.stream() as st:
                f = st.submit(2, shared, *(one[n] for n in names), out=out)
                g = st.submit(2, plain, *(x[n][0] for n in names))
                assert torch.equal(f.result(timeout=30), g.result(timeout=30))
            mixed = shared.decode(1, one["q"], x["k"][0], one["v"], x["a"][0], one["b"])  # some inline, o in the reply
            assert torch.equal(mixed, plain.decode(1, *(x[n][0] for n in names)))
        assert not server_maps(shm_server, key)
        with pytest.raises(ValueError):
            mem.tensor((1,))  # closed


def test_async_client_and_the_region_dropped_by_the_server(shm_server):
    """AsyncClient.shared_memory; a region the server no longer has (here: unregistered behind the
    client's back) is registered again and the step goes through."""
    import asyncio

    from gdn_client import AsyncClient

    async def main():
        async with AsyncClient(shm_server.address) as client:
            async with client.session() as plain, client.session() as shared:
                async with await client.shared_memory(REGION_BYTES) as mem:
                    x = inputs(31)
                    t = {n: mem.tensor(x[n].shape[1:]) for n in "qkvab"}
                    for n in "qkvab":
                        t[n].copy_(x[n][0])
                    out = mem.tensor((1, HV, K))
                    await shared.decode(0, *t.values(), out=out)
                    assert torch.equal(out, await plain.decode(0, *(x[n][0] for n in "qkvab")))
                    stub = gdn_pb2_grpc.GdnDecodeStub(client._channel)
                    await stub.UnregisterSharedMemory(gdn_pb2.UnregisterSharedMemoryRequest(name=mem.region.name))
                    again = await shared.decode(1, *t.values(), out=out)
                    assert torch.equal(again, await plain.decode(1, *(x[n][0] for n in "qkvab")))
                    async with client.stream() as st:
                        o = await st.submit(2, shared, *t.values(), out=out)
                        assert torch.equal(o, await plain.decode(2, *(x[n][0] for n in "qkvab")))

    asyncio.run(main())


def test_loadtest_through_shared_memory(shm_server, tmp_path):
    """gdn-loadtest --shared-memory system: its clients' requests refer to their regions; every
    step answered, and each client's region is unregistered at the end."""
    import json

    out = tmp_path / "load.json"
    run = subprocess.run(
        [sys.executable, "-m", "gdn_loadtest", "--target", shm_server.address, "--clients", "2", "--batch", "2",
         "--requests", "24", "--shared-memory", "system", "--mode", "unary", "--no-progress", "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    (result,) = json.loads(out.read_text())["runs"]
    assert result["steps"] == 24 and result["errors"] == 0
    assert result["request_bytes"] < 1024  # references, not tensors
    with open(f"/proc/{shm_server.proc.pid}/maps") as maps:
        assert "/dev/shm/gdn-" not in maps.read()


def test_validation_benchmark_times_every_path(tmp_path):
    """bench/validation.py runs the server's checks of one step inline and by reference (host
    memory, and CUDA memory with its copy made by a memmove) and writes what it timed."""
    import json

    done = subprocess.run([sys.executable, "bench/validation.py", "--requests", "1,4", "--turns", "20",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    (path,) = tmp_path.glob("validation-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["requests"] for r in rows] == [1, 4]
    assert all(r[k] > 0 for r in rows for k in ("inline_us", "system_us", "cuda_us"))
