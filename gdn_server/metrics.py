"""Prometheus metrics, served on `--metrics-port` (off unless the flag is given; 0 takes a free port).

Families (all prefixed `gdn_`):

    gdn_rpcs_total{method, code}             counter    every RPC of gdn.v1.GdnDecode, by final status
    gdn_rpc_duration_seconds{method}         histogram  RPC wall time (streams: the whole stream)
    gdn_decode_requests_total{method, code}  counter    decode steps, one per DecodeRequest, also the
                                                        ones inside a DecodeStream (method label)
    gdn_launch_rows                          histogram  rows (session x layer) per backend launch
    gdn_queue_wait_seconds                   histogram  per request: submit -> its launch
    gdn_device_seconds                       histogram  per launch: launch -> output on the host
    gdn_sessions_in_use, gdn_sessions_capacity, gdn_state_pool_bytes, gdn_queue_depth   gauges
    gdn_process_cpu_seconds_total            counter    CPU seconds (user + system) of the server process

Each server has its own `CollectorRegistry`, so tests can run several in one process. RPC counts
come from gdn_server.calls, which sees every call's end (refused ones too: UNAUTHENTICATED is counted);
launch and queue figures from the scheduler's `on_launch` / `on_dispatch` hooks.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


if TYPE_CHECKING:
    from gdn_server.placement import Placement

log = logging.getLogger(__name__)

SERVICE_PREFIX = "/gdn.v1.GdnDecode/"
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_WAIT_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5)
_RPC_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _ProcessCpu(Collector):
    """gdn_process_cpu_seconds_total, read at scrape time from the process's own clock (every
    thread, user and system): no view of /proc or a container's other processes needed."""

    def collect(self):
        yield CounterMetricFamily(
            "gdn_process_cpu_seconds", "CPU seconds (user + system) of the server process", value=time.process_time()
        )


class Metrics:
    """Every family of one server process, and its /metrics endpoint."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.rpcs = Counter("gdn_rpcs", "RPCs by method and final status code", ["method", "code"], registry=r)
        self.rpc_seconds = Histogram(
            "gdn_rpc_duration_seconds", "RPC wall time", ["method"], buckets=_RPC_BUCKETS, registry=r
        )
        self.decode_requests = Counter(
            "gdn_decode_requests", "Decode steps (one per DecodeRequest) by method and status code",
            ["method", "code"], registry=r,
        )
        self.launch_rows = Histogram("gdn_launch_rows", "Rows per backend launch", buckets=_ROW_BUCKETS, registry=r)
        self.queue_wait = Histogram(
            "gdn_queue_wait_seconds", "Per request: time from submit to its backend launch",
            buckets=_WAIT_BUCKETS, registry=r,
        )
        self.device_seconds = Histogram(
            "gdn_device_seconds", "Per launch: time from launch to output on the host", buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.sessions_in_use = Gauge("gdn_sessions_in_use", "Open sessions", registry=r)
        self.sessions_capacity = Gauge("gdn_sessions_capacity", "Session capacity of the state pool", registry=r)
        self.pool_bytes = Gauge("gdn_state_pool_bytes", "Bytes of the state pool", registry=r)
        self.queue_depth = Gauge("gdn_queue_depth", "Items waiting in the scheduler queue", registry=r)
        r.register(_ProcessCpu())
        self._http: Any = None
        self.port: int | None = None  # of the /metrics endpoint, once serving

    def attach(self, placement: Placement) -> None:
        """Takes the schedulers' hooks and reads the gauges from `placement` at scrape time."""
        shards = placement.shards
        for shard in shards:
            shard.scheduler.on_launch = self.observe_launch
            shard.scheduler.on_dispatch = self.queue_wait.observe
        self.sessions_in_use.set_function(lambda: placement.in_use)
        self.sessions_capacity.set_function(lambda: placement.capacity)
        self.pool_bytes.set_function(lambda: sum(s.backend.pool_bytes for s in shards))
        self.queue_depth.set_function(lambda: sum(s.scheduler.queue_depth() for s in shards))

    def observe_launch(self, rows: int, device_s: float) -> None:
        self.launch_rows.observe(rows)
        self.device_seconds.observe(device_s)

    def observe_rpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        """One gdn.v1.GdnDecode call's end (gdn_server.calls reports every call, refused ones too)."""
        self.rpcs.labels(method, code.name).inc()
        self.rpc_seconds.labels(method).observe(seconds)

    def count_decode(self, method: str, code: grpc.StatusCode) -> None:
        self.decode_requests.labels(method, code.name).inc()

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
