"""gdn-serve: a gRPC service for the decode step of Gated Delta Net layers.

Data flows one way: request -> `validation` (tensors) -> `scheduler` (batches) -> `backends`
(the state pool and the math) -> reply. `servicer` is the thin gRPC layer, `server` wires it up,
`cli` is the command line.
"""
import os

# torch's OpenMP threads (big copies and NaN/Inf checks, backends/staging.py, gdn_client/wire_checks.py)
# spin after each parallel region by default, taking cores from gRPC's and the clients' threads:
# a B=256 step took 12.7 ms with spinning threads, 8.4 ms with passive ones and 9.4 ms on one
# thread (H200 host, bench/results/trace_big_v3). Read by OpenMP when torch loads, so set here,
# before any module of ours imports torch; an operator's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# gRPC's I/O for the connections a server accepts: with gRPC's default (the EventEngine
# listener), a request's bytes are read on an EventEngine thread and handed to the thread that
# polls grpc.aio's completion queue, which wakes the event loop: a thread wake-up more each way
# than gRPC's older iomgr path, where the completion-queue thread reads the socket itself. On
# the H200 host (bench/NOTES.md, twenty-first session, one A/B call) one process answered one
# client in 0.29-0.33 instead of 0.40-0.50 ms and ran 64 clients 10-16% faster, though in
# launches of ~28 rows instead of ~46 (why is open: the CPU box does not show it);
# behind `--frontends 8` one client went 0.53-0.55 -> 0.44 ms. On the 2-core CPU box a bytes
# echo's round trip at one client went 334-371 -> 254-307 us with the older path (twentieth
# session). Read by gRPC when it loads, so set here, before any module of ours imports grpc; it
# reaches the --frontends workers and engines through their environment. An operator's own
# setting wins: GRPC_EXPERIMENTS= (empty) keeps gRPC's defaults.
GRPC_EXPERIMENTS = "-event_engine_listener"
os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)

__version__ = "0.1.0"
