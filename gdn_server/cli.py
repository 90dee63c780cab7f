"""`gdn-server` / `python -m gdn_server`: the command line of ../shared/design/API.md."""
from __future__ import annotations

import argparse
import logging
import sys

from gdn_server import native
from gdn_server.config import DEVICE_WAIT, PRESETS, SCHEDULER_RUNS_ON, ModelShape, SchedulerConfig
from gdn_server.event_loop import EVENT_LOOPS, loop_factory
from gdn_server.event_loop import run as run_loop
from gdn_server.frontend_native import TRANSPORTS, check_transport
from gdn_server.security import SecurityConfig
from gdn_server.server import ServerSettings, build_app, serve
from gdn_server.snapshot import SnapshotError
from gdn_server.tuning import tune_gc, tune_malloc
from gdn_server.weights import load_gate_params, random_gate_params

log = logging.getLogger("gdn_server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gdn-server", description="gRPC service for Gated Delta Net decode steps")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="port; 0 takes a free one (default 50051)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="auto: CUDA with the CuTe kernel when a GPU is present, else CPU")
    shape = p.add_argument_group("model shape (a preset, or explicit sizes)")
    shape.add_argument("--preset", choices=sorted(PRESETS), help="qwen3-next: H=16, HV=32, K=V=128, 36 layers")
    shape.add_argument("--layers", type=int, help="number of GDN layers L")
    shape.add_argument("--q-heads", type=int, help="query/key heads H")
    shape.add_argument("--v-heads", type=int, help="value heads HV (a multiple of H)")
    shape.add_argument("--head-dim", type=int, default=None, help="K = V head size (default 128)")
    p.add_argument("--weights", help="safetensors file with float32 layers.{i}.A_log / layers.{i}.dt_bias [HV]")
    p.add_argument("--seed", type=int, default=0, help="seed for A_log/dt_bias when --weights is not given")
    p.add_argument("--scale", type=float, default=None, help="query scale (default 1/sqrt(K))")
    p.add_argument("--devices", default=None,
                   help="CUDA devices to serve from, e.g. 0,1 (default: every visible GPU; one state pool and "
                        "scheduler each, sessions placed on the one with the most free slots). With --device cpu: "
                        "that many CPU shards (for testing multi-device serving without a GPU)")
    p.add_argument("--max-sessions", type=int, default=None,
                   help="session capacity per device (default: 64 on the CPU; on a GPU, what fits in 80%% of its "
                        "free memory, at most 4096)")
    p.add_argument("--speculative-sessions", type=int, default=None,
                   help="sessions that may hold uncommitted speculative steps at once; each uses up to 2 scratch "
                        "states per layer (default: min(max sessions, 32); 0 turns speculative steps off)")
    p.add_argument("--max-batch-rows", type=int, default=SchedulerConfig.max_batch_rows,
                   help="rows (session x layer) per kernel launch at most")
    p.add_argument("--max-queue-delay-us", type=int, default=SchedulerConfig.max_queue_delay_us,
                   help="once work is pending, wait at most this long for more before launching")
    p.add_argument("--batch-fill", type=float, default=SchedulerConfig.batch_fill, metavar="FRACTION",
                   help="under load, hold a launch until this share of the rows in circulation (estimated "
                        "from the launch rate and each session's time between steps) is queued: more rows "
                        "per launch; one client stepping alone is never held (0..1; default %(default)s: off)")
    p.add_argument("--batch-fill-max-us", type=int, default=SchedulerConfig.batch_fill_max_us,
                   help="--batch-fill holds a launch at most this long after its oldest request "
                        "(default %(default)s)")
    p.add_argument("--batch-fill-min-rows", type=int, default=SchedulerConfig.batch_fill_min_rows, metavar="N",
                   help="--batch-fill holds nothing while fewer rows than this are in circulation: a loop with "
                        "time to spare only makes its clients wait (default %(default)s)")
    p.add_argument("--scheduler-runs-on", choices=SCHEDULER_RUNS_ON, default=SchedulerConfig.runs_on,
                   help="where batches are formed and answered: 'loop' (on the gRPC event loop, polling the "
                        "device: no thread hand-offs), 'thread' (a thread per device), or 'auto' (loop for a "
                        "GPU backend, thread for the CPU one, whose steps compute on the host)")
    p.add_argument("--device-wait", choices=DEVICE_WAIT, default=SchedulerConfig.device_wait,
                   help="with the scheduler on the loop, how it waits for a launch: 'inline' (the round that "
                        "launches waits for the device and answers: one round fewer per request), 'poll' (once "
                        "per loop iteration), 'thread' (a waiter thread wakes the loop), or 'auto' (inline in a "
                        "--frontends engine of one device, whose loop serves no decode RPCs; else poll while one "
                        "request is in flight, the thread once launches carry several)")
    p.add_argument("--busy-poll-us", type=int, default=SchedulerConfig.busy_poll_us,
                   help="with the scheduler on the loop, after answering keep polling for the next request this "
                        "long instead of sleeping: lower latency at low load for a CPU core while clients keep "
                        "the server busy; with --frontends, a worker's loop too while it serves one request at a time "
                        "(default %(default)s; 0: off)")
    p.add_argument("--event-loop", choices=EVENT_LOOPS, default="auto",
                   help="the asyncio loop every server process runs on: 'uvloop' (its loop machinery in C), "
                        "'asyncio' (the standard one), or 'auto' (uvloop where installed; default)")
    p.add_argument("--state-dir", default=None,
                   help="save every session here on SIGTERM/SIGINT and restore them on start (default: off)")
    p.add_argument("--session-idle-timeout-s", type=float, default=None,
                   help="close sessions unused for this many seconds; they answer NOT_FOUND (default: never)")
    p.add_argument("--max-queue-rows", type=int, default=SchedulerConfig.max_queue_rows,
                   help="rows waiting for the device at most; requests beyond get UNAVAILABLE (clients retry)")
    p.add_argument("--frontends", type=int, default=0,
                   help="gRPC front-end worker processes: they parse, validate and answer requests, and hand "
                        "decode steps to one engine process per device, which owns its state pool (0: serve "
                        "everything in this process; they pay off with several GPUs, see the README)")
    p.add_argument("--frontend-transport", choices=TRANSPORTS, default="grpc",
                   help="how --frontends workers serve gRPC: 'grpc' (grpc.aio, the default) or 'native' "
                        "(HTTP/2 in C over the system's libnghttp2: several times less CPU per message; no TLS)")
    ops = p.add_argument_group("operations")
    ops.add_argument("--metrics-port", type=int, default=None,
                     help="serve Prometheus /metrics on --host at this port; 0 takes a free one (default: off)")
    ops.add_argument("--shutdown-delay-s", type=float, default=0.0,
                     help="on SIGTERM, report NOT_SERVING but keep serving this long before draining (default 0)")
    ops.add_argument("--drain-timeout-s", type=float, default=30.0,
                     help="on shutdown, how long in-flight RPCs may take to finish (default 30)")
    sec = p.add_argument_group("security")
    sec.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (with --tls-key)")
    sec.add_argument("--tls-key", help="PEM private key of --tls-cert")
    sec.add_argument("--tls-client-ca", help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    sec.add_argument("--auth-token-file",
                     help="file of `name:token` lines: every RPC needs `authorization: Bearer <token>`")
    sec.add_argument("--max-sessions-per-client", type=int, default=None,
                     help="sessions one identity (token name or client certificate) may hold (default: no limit)")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return p


def shape_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelShape:
    explicit = {"--layers": args.layers, "--q-heads": args.q_heads, "--v-heads": args.v_heads}
    if args.preset:
        if any(v is not None for v in explicit.values()) or args.head_dim is not None:
            parser.error("--preset cannot be combined with --layers/--q-heads/--v-heads/--head-dim")
        return PRESETS[args.preset]
    missing = [k for k, v in explicit.items() if v is None]
    if missing:
        parser.error(f"give --preset or all of --layers --q-heads --v-heads (missing {' '.join(missing)})")
    head_dim = args.head_dim if args.head_dim is not None else 128
    try:
        return ModelShape(args.layers, args.q_heads, args.v_heads, head_dim, head_dim)
    except ValueError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> int:
    tune_malloc()  # before any big buffer: see gdn_server/tuning.py
    tune_gc()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    shape = shape_from_args(args, parser)
    for flag in ("max_sessions", "max_batch_rows"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.max_queue_delay_us < 0:
        parser.error("--max-queue-delay-us must be >= 0")
    if args.busy_poll_us < 0:
        parser.error("--busy-poll-us must be >= 0")
    if not 0.0 <= args.batch_fill <= 1.0:
        parser.error("--batch-fill must be in 0..1")
    if args.batch_fill_max_us < 0:
        parser.error("--batch-fill-max-us must be >= 0")
    if args.batch_fill_min_rows < 0:
        parser.error("--batch-fill-min-rows must be >= 0")
    try:
        loop_factory(args.event_loop)  # --event-loop uvloop without uvloop: say so before anything starts
    except RuntimeError as e:
        parser.error(str(e))
    if args.speculative_sessions is not None and args.speculative_sessions < 0:
        parser.error("--speculative-sessions must be >= 0")
    devices = None
    if args.devices is not None:
        try:
            devices = tuple(int(d) for d in args.devices.split(",") if d.strip())
        except ValueError:
            parser.error(f"--devices takes CUDA device numbers like 0,1; got {args.devices!r}")
    if args.frontends < 0:
        parser.error("--frontends must be >= 0")
    if args.frontend_transport != "grpc" and not args.frontends:
        parser.error("--frontend-transport applies to --frontends workers: add --frontends N")
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
    transport_problem = check_transport(args.frontend_transport, security)
    if transport_problem is not None:
        parser.error(transport_problem)
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
    settings = ServerSettings(
        shape=shape,
        gates=gates,
        host=args.host,
        port=args.port,
        device=args.device,
        devices=devices,
        max_sessions=args.max_sessions,
        speculative_sessions=args.speculative_sessions,
        scheduler=SchedulerConfig(args.max_batch_rows, args.max_queue_delay_us, args.max_queue_rows,
                                  args.scheduler_runs_on, args.device_wait, args.busy_poll_us,
                                  args.batch_fill, args.batch_fill_max_us, args.batch_fill_min_rows),
        scale=args.scale,
        grace_s=args.drain_timeout_s,
        shutdown_delay_s=args.shutdown_delay_s,
        security=security,
        metrics_port=args.metrics_port,
        state_dir=args.state_dir,
        session_idle_timeout_s=args.session_idle_timeout_s,
        frontends=args.frontends,
        event_loop=args.event_loop,
        frontend_transport=args.frontend_transport,
    )
    native.log_state(log)  # every process of this install parses and copies the same way
    if settings.frontends:  # workers, a router, and one engine process per device
        from gdn_server.router import serve_router

        try:
            return run_loop(serve_router(settings), settings.event_loop)
        except (ValueError, RuntimeError, OSError) as e:
            log.error("cannot serve: %s", e)
            return 2
    try:
        app = build_app(settings)
    except (ValueError, RuntimeError, OSError) as e:
        log.error("cannot start: %s", e)
        return 2
    try:
        run_loop(serve(app), settings.event_loop)
    except (OSError, RuntimeError) as e:
        log.error("cannot serve: %s", e)
        return 2
    except SnapshotError as e:
        log.error("%s", e)
        return 1
    return 0
