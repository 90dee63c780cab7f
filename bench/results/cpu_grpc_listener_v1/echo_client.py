import asyncio, sys, time
import numpy as np
sys.path.insert(0, "bench")
from trace_step import _echo_client, ECHO_ONLY_REQUEST_BYTES as RQ, ECHO_ONLY_REPLY_BYTES as RP
addr = sys.argv[1]
t = asyncio.run(_echo_client(addr, RQ, RP, 300, 2000, "stream"))
d = np.array([b - a for a, b in t]) / 1e3
print(f"p50 {np.percentile(d, 50):.1f} us  p90 {np.percentile(d, 90):.1f}")
