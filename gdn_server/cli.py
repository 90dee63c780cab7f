"""`gdn-server` / `python -m gdn_server`: the command line (docs/operations.md describes every flag)."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys

# nothing here imports grpc or torch: main() picks gRPC's I/O path and OpenMP's waits before they
# load (config.GRPC_EXPERIMENTS, config.OMP_WAIT_POLICY)
from gdn_server.config import (
    DEFAULT_STATE_DTYPE, GRPC_EXPERIMENTS, OMP_WAIT_POLICY, PRESETS, STATE_DTYPE_BYTES, ModelShape, SchedulerConfig,
    default_kernel_cache,
)
from gdn_server.limits import SPECULATIVE_TIMEOUT_S, Limits, SharedMemoryLimits

# the shapes served when the command line names none: the model this service was built for
DEFAULT_PRESET = "qwen3-next"
# what `--compile-kernels` compiles for on a machine without a GPU: the GPUs the kernels are built
# and measured on (H100, H200)
HOPPER_ARCH = "sm_90a"
from gdn_server.tuning import tune_process

log = logging.getLogger("gdn_server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gdn-server", description="gRPC service for Gated Delta Net decode steps")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="port; 0 takes a free one (default 50051)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="auto: CUDA with the CuTe kernel when a GPU is present, else CPU (default auto)")
    shape = p.add_argument_group(f"model shape (a preset, or explicit sizes; neither: --preset {DEFAULT_PRESET})")
    shape.add_argument("--preset", choices=sorted(PRESETS),
                       help=f"qwen3-next: H=16, HV=32, K=V=128, 36 layers (default {DEFAULT_PRESET} when no size "
                            "is given)")
    shape.add_argument("--layers", type=int, help="number of GDN layers L (no default: give all three sizes)")
    shape.add_argument("--q-heads", type=int, help="query/key heads H (no default: give all three sizes)")
    shape.add_argument("--v-heads", type=int, help="value heads HV, a multiple of H (no default: give all three sizes)")
    shape.add_argument("--head-dim", type=int, default=None, help="K = V head size, with the sizes above (default 128)")
    shape.add_argument("--state-dtype", choices=sorted(STATE_DTYPE_BYTES), default=DEFAULT_STATE_DTYPE,
                       help="element type of the recurrent states held: float32 as some models' serving configs "
                            "ask, at twice the memory per session and the device time of a step "
                            "(default %(default)s)")
    p.add_argument("--weights", help="safetensors file with float32 layers.{i}.A_log / layers.{i}.dt_bias [HV] "
                                     "(default: gates drawn from --seed)")
    p.add_argument("--seed", type=int, default=0, help="seed for A_log/dt_bias when --weights is not given (default 0)")
    p.add_argument("--scale", type=float, default=None, help="query scale (default 1/sqrt(K))")
    p.add_argument("--devices", default=None,
                   help="CUDA devices to serve from, e.g. 0,1 (default: every visible GPU; one state pool and "
                        "scheduler each, sessions placed on the one with the most free slots). With --device cpu: "
                        "that many CPU shards (for testing multi-device serving without a GPU)")
    p.add_argument("--max-sessions", type=int, default=None,
                   help="session capacity per device (default: on the CPU 256, fewer where their states and "
                        "history rings would pass half the host's memory, held only while in use; on a GPU, what "
                        "fits in 80%% of its free memory, at most 4096)")
    p.add_argument("--max-batch-rows", type=int, default=SchedulerConfig.max_batch_rows,
                   help="rows (session x layer) per kernel launch at most (default %(default)s)")
    p.add_argument("--max-queue-delay-us", type=int, default=SchedulerConfig.max_queue_delay_us,
                   help="once work is pending, wait at most this long for more before launching "
                        "(default %(default)s)")
    p.add_argument("--state-dir", default=None,
                   help="save every session here on SIGTERM/SIGINT and restore them on start (default: off)")
    p.add_argument("--session-idle-timeout-s", type=float, default=None,
                   help="close sessions unused for this many seconds; they answer NOT_FOUND (default: never)")
    p.add_argument("--max-queue-rows", type=int, default=SchedulerConfig.max_queue_rows,
                   help="rows waiting for the device at most; requests beyond get UNAVAILABLE, which clients "
                        "retry (default %(default)s)")
    p.add_argument("--speculative-timeout-s", type=float, default=SPECULATIVE_TIMEOUT_S,
                   help="open speculative steps of a session unused this long are dropped, as if never sent "
                        "(default %(default)s)")
    lim = p.add_argument_group("limits (what clients can make the server hold)")
    lim.add_argument("--max-calls", type=int, default=Limits.max_calls,
                     help="calls held at once over all clients; when full, the client holding the most "
                          "gives way to a newcomer (default %(default)s)")
    lim.add_argument("--max-calls-per-client", type=int, default=Limits.max_calls_per_client,
                     help="calls one client (token identity, else connection) may hold at once "
                          "(default %(default)s)")
    lim.add_argument("--message-timeout-s", type=float, default=Limits.message_timeout_s,
                     help="a unary call's request must arrive whole within this, else DEADLINE_EXCEEDED "
                          "(default %(default)s)")
    lim.add_argument("--max-streams-per-connection", type=int, default=Limits.max_streams_per_connection,
                     help="HTTP/2 streams one connection may have open (default %(default)s)")
    lim.add_argument("--max-connections", type=int, default=Limits.max_connections,
                     help="client connections at once; more are refused (default %(default)s)")
    lim.add_argument("--idle-connection-timeout-s", type=float, default=Limits.idle_connection_timeout_s,
                     help="a connection with no call for this long is closed (default %(default)s)")
    shm = p.add_argument_group("shared memory (clients on this host; docs/operations.md says who may use it)")
    shm.add_argument("--allow-shared-memory", action="store_true",
                     help="accept RegisterSharedMemory: tensors in the clients' POSIX shared memory or CUDA IPC memory, "
                          "referenced by region and offset (default: off)")
    shm.add_argument("--shared-memory-idle-s", type=float, default=SharedMemoryLimits.idle_s,
                     help="unmap a region no request has used for this long (default %(default)s)")
    ops = p.add_argument_group("operations")
    ops.add_argument("--metrics-port", type=int, default=None,
                     help="serve Prometheus /metrics on --host at this port; 0 takes a free one (default: off)")
    ops.add_argument("--shutdown-delay-s", type=float, default=0.0,
                     help="on SIGTERM, report NOT_SERVING but keep serving this long before draining (default 0)")
    ops.add_argument("--drain-timeout-s", type=float, default=30.0,
                     help="on shutdown, how long in-flight RPCs may take to finish (default 30)")
    ops.add_argument("--kernel-cache", default=str(default_kernel_cache()), metavar="DIR",
                     help="keep the compiled CUDA kernels in this folder (mode 0700, this user's only), so that "
                          "later starts load them in milliseconds instead of compiling each for a second or two; "
                          "'' compiles at every start (default %(default)s)")
    ops.add_argument("--compile-kernels", action="store_true",
                     help="compile every CUDA kernel a server of this model shape and --state-dtype launches into "
                          "--kernel-cache, then exit without serving; needs no GPU (without one the kernels are "
                          f"for CUTE_DSL_ARCH, {HOPPER_ARCH} unless set): an image's build runs it, so that its "
                          "containers start without compiling (default: off)")
    sec = p.add_argument_group("security")
    sec.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (with --tls-key; default: plaintext)")
    sec.add_argument("--tls-key", help="PEM private key of --tls-cert (default: none)")
    sec.add_argument("--tls-client-ca",
                     help="PEM CA bundle: require client certificates it signed, mutual TLS (default: off)")
    sec.add_argument("--auth-token-file",
                     help="file of `name:token` lines: every RPC needs `authorization: Bearer <token>` "
                          "(default: no tokens)")
    sec.add_argument("--max-sessions-per-client", type=int, default=None,
                     help="sessions one identity (token name or client certificate) may hold (default: no limit)")
    host = p.add_argument_group("several processes on one host")
    host.add_argument("--processes", type=_processes, default=1, metavar="K|auto",
                      help="server processes per device: each serves its own sessions on its own port (PORT, "
                           "PORT+1, ...) with 1/K of the device's memory, the processes of a GPU sharing it "
                           "through MPS; gdn_client follows each session to its process. auto: one per two "
                           "cores, at most 8 per GPU, 1 on the CPU (default 1)")
    # set by the supervisor for each of its processes (or by hand, docs/operations.md): this process's
    # place among every process's ports, e.g. 1 of 50051,50052; hidden from --help as internal
    host.add_argument("--process-index", type=int, default=None, help=argparse.SUPPRESS)
    host.add_argument("--process-ports", default=None, help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return p


def shape_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelShape:
    return dataclasses.replace(_sizes_from_args(args, parser), state_dtype=args.state_dtype)


def _sizes_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelShape:
    explicit = {"--layers": args.layers, "--q-heads": args.q_heads, "--v-heads": args.v_heads}
    sized = any(v is not None for v in explicit.values()) or args.head_dim is not None
    if args.preset:
        if sized:
            parser.error("--preset cannot be combined with --layers/--q-heads/--v-heads/--head-dim")
        return PRESETS[args.preset]
    if not sized:
        return PRESETS[DEFAULT_PRESET]
    missing = [k for k, v in explicit.items() if v is None]
    if missing:
        parser.error(f"give --preset or all of --layers --q-heads --v-heads (missing {' '.join(missing)})")
    head_dim = args.head_dim if args.head_dim is not None else 128
    try:
        return ModelShape(args.layers, args.q_heads, args.v_heads, head_dim, head_dim)
    except ValueError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)  # before grpc loads: see config.py
    os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)  # before torch loads: see config.py
    tune_process()  # before any big buffer: see gdn_server/tuning.py
    from gdn_server import server
    from gdn_server.security import SecurityConfig
    from gdn_server.snapshot import SnapshotError
    from gdn_server.weights import load_gate_params, random_gate_params

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    shape = shape_from_args(args, parser)
    if args.compile_kernels:
        return _compile_kernels(shape, args.kernel_cache)
    for flag in ("max_sessions", "max_batch_rows"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.max_queue_delay_us < 0:
        parser.error("--max-queue-delay-us must be >= 0")
    devices = None
    if args.devices is not None:
        try:
            devices = tuple(int(d) for d in args.devices.split(",") if d.strip())
        except ValueError:
            parser.error(f"--devices takes CUDA device numbers like 0,1; got {args.devices!r}")
    if args.max_queue_rows < 1:
        parser.error("--max-queue-rows must be >= 1")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        parser.error("--metrics-port must be 0..65535")
    if args.shutdown_delay_s < 0 or args.drain_timeout_s < 0:
        parser.error("--shutdown-delay-s and --drain-timeout-s must be >= 0")
    try:
        security = SecurityConfig(args.tls_cert, args.tls_key, args.tls_client_ca, args.auth_token_file,
                                  args.max_sessions_per_client)
    except ValueError as e:
        parser.error(str(e))
    process_ports: tuple[int, ...] = ()
    if (args.process_index is None) != (args.process_ports is None):
        parser.error("--process-index and --process-ports go together")
    if args.process_ports is not None:
        try:
            process_ports = tuple(int(p) for p in args.process_ports.split(","))
        except ValueError:
            parser.error(f"--process-ports takes ports like 50051,50052; got {args.process_ports!r}")
        if not 0 <= args.process_index < len(process_ports) or process_ports[args.process_index] != args.port:
            parser.error("--process-index must name this process's --port in --process-ports")
    try:
        limits = Limits(args.max_calls, args.max_calls_per_client, args.message_timeout_s,
                        args.max_streams_per_connection, args.max_connections, args.idle_connection_timeout_s)
    except ValueError as e:
        parser.error(str(e).replace("_", "-", 3))
    if not args.speculative_timeout_s > 0:
        parser.error("--speculative-timeout-s must be > 0")
    if not args.shared_memory_idle_s > 0:
        parser.error("--shared-memory-idle-s must be > 0")
    shared_memory = SharedMemoryLimits(idle_s=args.shared_memory_idle_s) if args.allow_shared_memory else None
    if args.session_idle_timeout_s is not None and not args.session_idle_timeout_s > 0:
        parser.error("--session-idle-timeout-s must be > 0")
    if args.weights:
        try:
            gates = load_gate_params(args.weights, shape.num_v_heads)
        except (OSError, ValueError) as e:
            parser.error(f"--weights: {e}")
        if gates.num_layers != shape.num_layers:
            parser.error(f"--weights has {gates.num_layers} GDN layers, the model shape has {shape.num_layers}")
    else:
        gates = random_gate_params(shape, args.seed)
    if args.processes == AUTO:
        args.processes = _auto_processes(args, devices)
        log.info("--processes auto: %d process(es) per device", args.processes)
    if args.processes > 1 and args.process_index is None:
        return _supervise(args, argv, devices)
    if args.kernel_cache and _gpus(args, devices) is not None:
        from gdn_server.kernels._compiled import use_disk_cache

        use_disk_cache(args.kernel_cache)
    settings = server.ServerSettings(
        shape=shape,
        gates=gates,
        host=args.host,
        port=args.port,
        device=args.device,
        devices=devices,
        max_sessions=args.max_sessions,
        scheduler=SchedulerConfig(args.max_batch_rows, args.max_queue_delay_us, args.max_queue_rows),
        limits=limits,
        scale=args.scale,
        grace_s=args.drain_timeout_s,
        shutdown_delay_s=args.shutdown_delay_s,
        security=security,
        metrics_port=args.metrics_port,
        state_dir=args.state_dir,
        session_idle_timeout_s=args.session_idle_timeout_s,
        speculative_timeout_s=args.speculative_timeout_s,
        processes=args.processes,
        process_index=args.process_index or 0,
        process_ports=process_ports,
        shared_memory=shared_memory,
    )
    try:
        app = server.build_app(settings)
    except (ValueError, RuntimeError, OSError) as e:
        log.error("cannot start: %s", e)
        return 2
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(server.serve(app))
    except SnapshotError as e:  # only load_snapshot raises it, before the server serves: a start failure
        log.error("cannot start: %s", e)
        return 2
    except (OSError, RuntimeError) as e:
        log.error("cannot serve: %s", e)
        return 2


AUTO = "auto"


def _processes(value: str) -> int | str:
    """--processes: a count >= 1, or auto."""
    if value == AUTO:
        return AUTO
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"takes a count >= 1 or auto, got {value!r}")
    return count


def _compile_kernels(shape: ModelShape, folder: str) -> int:
    """`--compile-kernels`: every kernel a CUDA server of `shape` launches (its warm-up's, and the
    shared-memory checks and copies), compiled into the kernel cache `folder` or found there."""
    import time

    from gdn_server.supervisor import device_count

    if not folder:
        log.error("--compile-kernels keeps the kernels in --kernel-cache: give it a folder")
        return 2
    if not os.environ.get("CUTE_DSL_ARCH") and device_count() == 0:
        # the DSL's own guess without a GPU is its newest architecture, not the GPUs this serves
        os.environ["CUTE_DSL_ARCH"] = HOPPER_ARCH
    from gdn_server.backends.cuda import check_kernel_shape, compile_kernels
    from gdn_server.kernels import _compiled, compile_segment_kernels

    try:
        check_kernel_shape(shape)
    except ValueError as e:
        log.error("%s", e)
        return 2
    kept = _compiled.use_disk_cache(folder)
    if kept is None:  # use_disk_cache logged why
        log.error("--compile-kernels: no kernels can be kept in %s", folder)
        return 2
    before = set(kept.glob("gdn_*.o"))
    started = time.perf_counter()
    count = compile_kernels(shape) + compile_segment_kernels()  # the latter: --allow-shared-memory's
    compiled = len(set(kept.glob("gdn_*.o")) - before)
    print(f"{count} kernels for {os.environ.get('CUTE_DSL_ARCH') or 'this GPU'} in {kept}: {compiled} compiled, "
          f"{count - compiled} there already ({time.perf_counter() - started:.1f} s)", flush=True)
    return 0


def _gpus(args: argparse.Namespace, devices: tuple[int, ...] | None) -> list[int] | None:
    """The GPUs the server's processes use; None on the CPU."""
    from gdn_server.supervisor import device_count

    on_gpu = args.device == "cuda" or (args.device == "auto" and device_count() > 0)
    return (list(devices) if devices is not None else list(range(device_count()))) if on_gpu else None


def _auto_processes(args: argparse.Namespace, devices: tuple[int, ...] | None) -> int:
    from gdn_server.supervisor import auto_processes, host_cores

    return auto_processes(len(_gpus(args, devices) or ()), host_cores())


def _supervise(args: argparse.Namespace, argv: list[str], devices: tuple[int, ...] | None) -> int:
    """--processes K: K server processes per device, under gdn_server.supervisor."""
    from gdn_server.supervisor import child_argvs, supervise

    gpus = _gpus(args, devices)
    children = child_argvs(argv, args.host, args.port, args.processes, gpus, args.state_dir, args.metrics_port)
    return supervise(children, args.host, share_gpus=gpus is not None and args.processes > 1)


def event_loop_factory():
    """uvloop's loop (a dependency wherever it has wheels): it runs the loop's own machinery (the
    ready queue, the selector, wake-ups from gRPC's poller thread) in C, and that loop's thread is
    what bounds a busy server. asyncio's own loop where uvloop is not installed."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
