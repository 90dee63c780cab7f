import time, statistics
from gdn_server.backends.cpu import CpuBackend
from gdn_server.config import ModelShape, SchedulerConfig
from gdn_server.scheduler import Scheduler
from gdn_server.sessions import SessionTable
from gdn_server.weights import random_gate_params
from gdn_server.work import DecodeWork
import torch
shape = ModelShape(num_layers=2, num_q_heads=1, num_v_heads=2, head_dim_k=8, head_dim_v=8)
backend = CpuBackend(shape, random_gate_params(shape, 0), 4)
table = SessionTable(4, 2)
ids = [table.create().id for _ in range(4)]
raw = tuple(bytes(16) for _ in range(5)); dims = ((1,1,1,8),(1,1,1,8),(1,1,2,8),(1,1,2),(1,1,2))
works = [DecodeWork.of_bf16(0, (ids[i % 4],), None, "", False, raw, dims, True) for i in range(64)]
done = lambda r: None
reqs = [(w, done, None) for w in works]
for mode in ("python", "native", "python", "native"):
    s = Scheduler(backend, table, SchedulerConfig(max_queue_rows=100000))
    if mode == "python": s._make_items = None
    times = []
    for _ in range(2000):
        t = time.perf_counter(); s.submit_decodes(reqs); times.append(time.perf_counter() - t)
        s._pending.clear(); s._pending_rows = 0
    print(mode, f"{statistics.median(times)/64*1e9:.0f} ns per request")
