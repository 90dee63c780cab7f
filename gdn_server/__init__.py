"""gdn-serve: a gRPC service for the decode step of Gated Delta Net layers.

Data flows one way: request -> `validation` (tensors) -> `scheduler` (batches) -> `backends`
(the state pool and the math) -> reply. `servicer` is the thin gRPC layer, `server` wires it up,
`cli` is the command line.
"""
import os

# torch's OpenMP threads (big copies and NaN/Inf checks, backends/staging.py, gdn_client/wire.py)
# spin after each parallel region by default, taking cores from gRPC's and the clients' threads:
# a B=256 step took 12.7 ms with spinning threads, 8.4 ms with passive ones and 9.4 ms on one
# thread (H200 host, bench/results/trace_big_v3). Read by OpenMP when torch loads, so set here,
# before any module of ours imports torch; an operator's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
