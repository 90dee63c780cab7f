"""Prometheus metrics, served on `--metrics-port` (off unless the flag is given; 0 takes a free port).

Families (all prefixed `gdn_`):

    gdn_rpcs_total{method, code}             counter    every RPC of gdn.v1.GdnDecode, by final status
    gdn_rpc_duration_seconds{method}         histogram  RPC wall time (streams: the whole stream)
    gdn_decode_requests_total{method, code}  counter    decode steps, one per DecodeRequest, also the
                                                        ones inside a DecodeStream (method label)
    gdn_launch_rows                          histogram  rows (session x layer) per backend launch
    gdn_queue_wait_seconds                   histogram  per request: submit -> its launch
    gdn_device_seconds                       histogram  per launch: submit -> output on the host
    gdn_sessions_in_use, gdn_sessions_capacity, gdn_state_pool_bytes, gdn_queue_depth   gauges
    gdn_process_cpu_seconds_total{role}      counter    CPU seconds (user + system) of the processes
                                                        that serve decode steps, by role: "server"
                                                        (one process), or "engine" and "worker"
                                                        (--frontends; the router's own is not counted)

Each server has its own `CollectorRegistry`, so tests can run several in one process. RPC counts
come from a server interceptor (`MetricsInterceptor`, outermost, so UNAUTHENTICATED is counted);
launch and queue figures from the scheduler's `on_launch` / `on_dispatch` hooks. With
--frontends the RPC families are counted in the worker processes and the others in the engine
processes (one per device); all of them write to files in the server's private directory
(prometheus_client multiprocess mode; gauges refreshed every `GAUGE_REFRESH_S`), and the main
process's /metrics serves their sums.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.multiprocess import MultiProcessCollector

from gdn_server.rpc_wrap import final_code, wrap_handler

if TYPE_CHECKING:
    from gdn_server.placement import Placement

log = logging.getLogger(__name__)

SERVICE_PREFIX = "/gdn.v1.GdnDecode/"
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_WAIT_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5)
GAUGE_REFRESH_S = 0.5  # how often an engine process writes its gauges (--frontends)
# how often a process adds its CPU seconds to gdn_process_cpu_seconds_total: a scrape lags the
# truth by at most this, so two scrapes a few seconds apart give cores within a few percent
CPU_REFRESH_S = 0.1
_RPC_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RpcMetrics:
    """The per-RPC families, counted where gRPC is served: in the server process, or with
    --frontends in each worker (prometheus_client's multiprocess mode; the router serves the sum)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry
        self.rpcs = Counter("gdn_rpcs", "RPCs by method and final status code", ["method", "code"], registry=r)
        self.rpc_seconds = Histogram(
            "gdn_rpc_duration_seconds", "RPC wall time", ["method"], buckets=_RPC_BUCKETS, registry=r
        )
        self.decode_requests = Counter(
            "gdn_decode_requests", "Decode steps (one per DecodeRequest) by method and status code",
            ["method", "code"], registry=r,
        )

    def count_decode(self, method: str, code: grpc.StatusCode) -> None:
        self.decode_requests.labels(method, code.name).inc()


class EngineMetrics:
    """The launch, queue and session families, counted where the state pools are: in the server
    process, or with --frontends in each engine process (multiprocess files, summed by /metrics)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        """`registry` None: multiprocess mode (PROMETHEUS_MULTIPROC_DIR set before the import)."""
        r = registry
        self.multiprocess = registry is None
        # gauges of several engines add up; a dead engine's values drop out
        live = {"multiprocess_mode": "livesum"} if self.multiprocess else {}
        self.launch_rows = Histogram("gdn_launch_rows", "Rows per backend launch", buckets=_ROW_BUCKETS, registry=r)
        self.queue_wait = Histogram(
            "gdn_queue_wait_seconds", "Per request: time from submit to its backend launch",
            buckets=_WAIT_BUCKETS, registry=r,
        )
        self.device_seconds = Histogram(
            "gdn_device_seconds", "Per launch: time from submit to output on the host", buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.sessions_in_use = Gauge("gdn_sessions_in_use", "Open sessions", registry=r, **live)
        self.sessions_capacity = Gauge("gdn_sessions_capacity", "Session capacity of the state pool", registry=r, **live)
        self.pool_bytes = Gauge("gdn_state_pool_bytes", "Bytes of the bf16 state pool", registry=r, **live)
        self.queue_depth = Gauge("gdn_queue_depth", "Items waiting in the scheduler queue", registry=r, **live)
        self.rows_in_circulation = Gauge(
            "gdn_batch_fill_rows_in_circulation",
            "--batch-fill's estimate of the rows its clients keep in circulation (0 while off)", registry=r, **live,
        )
        self._placement: Placement | None = None

    def attach(self, placement: Placement) -> None:
        """Takes the schedulers' hooks and reads the gauges from `placement` (summed over devices):
        at scrape time in one process; in multiprocess mode whenever `refresh` runs."""
        self._placement = placement
        shards = placement.shards
        for shard in shards:
            shard.scheduler.on_launch = self.observe_launch
            shard.scheduler.on_dispatch = self.queue_wait.observe
        if self.multiprocess:  # files hold values, not functions: `refresh` writes them
            self.refresh()
            return
        self.sessions_in_use.set_function(lambda: placement.in_use)
        self.sessions_capacity.set_function(lambda: placement.capacity)
        self.pool_bytes.set_function(lambda: sum(s.backend.pool_bytes for s in shards))
        self.queue_depth.set_function(lambda: sum(s.scheduler.queue_depth() for s in shards))
        self.rows_in_circulation.set_function(lambda: _rows_in_circulation(shards))

    def refresh(self) -> None:
        """Writes the gauges' current values (multiprocess mode; an engine calls this every so often)."""
        placement = self._placement
        if placement is None:
            return
        self.sessions_in_use.set(placement.in_use)
        self.sessions_capacity.set(placement.capacity)
        self.pool_bytes.set(sum(s.backend.pool_bytes for s in placement.shards))
        self.queue_depth.set(sum(s.scheduler.queue_depth() for s in placement.shards))
        self.rows_in_circulation.set(_rows_in_circulation(placement.shards))

    def observe_launch(self, rows: int, queue_wait_s: float, device_s: float) -> None:
        self.launch_rows.observe(rows)
        self.device_seconds.observe(device_s)


class ProcessCpu:
    """This process's CPU seconds as `gdn_process_cpu_seconds_total{role}`, brought up to date by
    `refresh` (every CPU_REFRESH_S in `count_forever`). It reads the process's own clock
    (`time.process_time`: every thread, user and system), so it needs no view of the other
    processes (a container's /proc, a monitoring agent): the sum over a role's processes says
    which role holds a host's cores (bench/NOTES.md, twenty-sixth session)."""

    def __init__(self, role: str, registry: CollectorRegistry | None) -> None:
        counter = Counter(
            "gdn_process_cpu_seconds", "CPU seconds (user + system) of the server's processes by role",
            ["role"], registry=registry,
        )
        self._counted = counter.labels(role)
        self._seen = time.process_time()

    def refresh(self) -> None:
        now = time.process_time()
        self._counted.inc(now - self._seen)
        self._seen = now

    async def count_forever(self) -> None:
        while True:
            await asyncio.sleep(CPU_REFRESH_S)
            self.refresh()


def _rows_in_circulation(shards) -> float:
    return sum(s.scheduler.batch_fill.rows_in_circulation for s in shards if s.scheduler.batch_fill.enabled)


class Metrics:
    """The /metrics endpoint of the process clients reach.

    One process (`Metrics()`): every family lives here. With --frontends (`Metrics(files_dir)`):
    workers and engine processes write their families to files in `files_dir`, and this
    endpoint serves their sums."""

    def __init__(self, files_dir: str | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.rpc: RpcMetrics | None = None
        self.engine: EngineMetrics | None = None
        self.cpu: ProcessCpu | None = None  # one process: its own CPU (the owner runs `count_forever`)
        if files_dir is None:
            self.rpc = RpcMetrics(self.registry)
            self.engine = EngineMetrics(self.registry)
            self.cpu = ProcessCpu("server", self.registry)
        else:
            MultiProcessCollector(self.registry, path=files_dir)
        self._http: Any = None
        self.port: int | None = None  # of the /metrics endpoint, once serving

    def serve(self, host: str, port: int) -> int:
        """Starts the /metrics HTTP endpoint; returns the port bound."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        self.port = int(server.server_address[1])
        return self.port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts and times every gdn.v1.GdnDecode RPC by its final status code."""

    def __init__(self, metrics: RpcMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(SERVICE_PREFIX):
            return handler
        name = method[len(SERVICE_PREFIX):]
        metrics = self.metrics

        @contextlib.asynccontextmanager
        async def around(context):
            started = time.perf_counter()
            error: BaseException | None = None
            try:
                yield
            except BaseException as e:
                error = e
                raise
            finally:
                metrics.rpcs.labels(name, final_code(context, error).name).inc()
                metrics.rpc_seconds.labels(name).observe(time.perf_counter() - started)

        return wrap_handler(handler, around)
