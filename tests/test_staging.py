"""Host staging of a launch (gdn_server.backends.staging): what the CUDA backend copies to the
device, filled here into an ordinary buffer (no GPU needed), for every way a request's inputs
reach it: small bf16 requests (slice copies), big ones (torch's parallel copy), f32 requests
(casting copies), in one batch."""
from __future__ import annotations

import numpy as np
import torch

from gdn_server.backends.staging import PARALLEL_COPY_BYTES, carve, fill, make_plan
from gdn_server.config import ModelShape
from gdn_server.work import DecodeWork, StepBatch

SHAPE = ModelShape(num_layers=3, num_q_heads=2, num_v_heads=4)  # K = V = 128
INPUTS = ("q", "k", "v", "a", "b")


def _work(rows: int, dtype: torch.dtype, seed: int) -> DecodeWork:
    g = torch.Generator().manual_seed(seed)
    H, HV, K, V = SHAPE.num_q_heads, SHAPE.num_v_heads, SHAPE.head_dim_k, SHAPE.head_dim_v
    shapes = {"q": (rows, 1, H, K), "k": (rows, 1, H, K), "v": (rows, 1, HV, V), "a": (rows, 1, HV), "b": (rows, 1, HV)}
    tensors = {n: torch.randn(*s, generator=g).to(dtype) for n, s in shapes.items()}
    ids = tuple(f"s{seed}-{i}" for i in range(rows))
    if dtype == torch.bfloat16:  # as validation makes them: raw bytes, tensors built on demand
        raw = tuple(tensors[n].view(torch.int16).numpy().tobytes() for n in INPUTS)
        return DecodeWork(1, ids, bf16_bytes=raw, input_dims=tuple(shapes[n] for n in INPUTS))
    return DecodeWork(1, ids, **tensors)


def test_fill_places_small_big_and_f32_requests_row_by_row():
    big_rows = PARALLEL_COPY_BYTES // (SHAPE.num_v_heads * SHAPE.head_dim_v * 2) + 1  # its v takes the big path
    works = [_work(3, torch.bfloat16, 1), _work(big_rows, torch.bfloat16, 2), _work(2, torch.float32, 3)]
    batch = StepBatch(1)
    slot = 0
    for w in works:
        slots = list(range(slot, slot + w.rows))
        batch.add(w, slots)
        slot += w.rows
    plan = make_plan(SHAPE, batch.rows, 1)
    buf = torch.full((plan.total,), 0xAB, dtype=torch.uint8)
    host_bytes = buf.numpy()
    views = {name: carve(buf, e) for name, e in plan.entries.items()}
    assert len(works[1].bf16_bytes[2]) >= PARALLEL_COPY_BYTES

    fill(batch, plan, memoryview(host_bytes), host_bytes, views)

    for name in INPUTS:
        want = torch.cat([getattr(w, name).to(torch.bfloat16) for w in works])
        assert torch.equal(views[name].view(torch.int16), want.view(torch.int16)), name
    assert views["slots"].tolist() == list(range(batch.rows))
    assert views["layers"].tolist() == [1] * batch.rows
    assert np.all(host_bytes[plan.entries["out_slots"][0]:][:4] == 0xAB)  # in place: out_slots left alone


def test_launches_pad_to_the_next_graph_bucket():
    """The CUDA backend's padded launches (gdn_server.backends.cuda.padded_rows): small ones as
    they are (each has its own graph), bigger ones up to the largest bucket to the next bucket,
    bigger still as they are."""
    from gdn_server.backends.cuda import GRAPH_BUCKETS, GRAPH_MAX_ROWS, padded_rows

    assert [padded_rows(r) for r in range(1, GRAPH_MAX_ROWS + 1)] == list(range(1, GRAPH_MAX_ROWS + 1))
    last = 0
    for rows in range(GRAPH_MAX_ROWS + 1, GRAPH_BUCKETS[-1] + 1):
        padded = padded_rows(rows)
        assert padded in GRAPH_BUCKETS and padded >= rows and padded >= last
        assert padded == min(b for b in GRAPH_BUCKETS if b >= rows)
        last = padded
    assert padded_rows(GRAPH_BUCKETS[-1] + 1) == GRAPH_BUCKETS[-1] + 1


def test_mapped_launch_rows_come_from_the_environment():
    """GDN_MAPPED_MAX_ROWS caps the rows of a launch that runs on the mapped staging (the GPU test
    tests/gpu/test_cuda_backend.py runs the capture itself); unset, only a one-row launch does."""
    import os
    import subprocess
    import sys

    read = "from gdn_server.backends import cuda; print(cuda.MAPPED_MAX_ROWS, cuda.GRAPH_MAX_ROWS)"
    env = {k: v for k, v in os.environ.items() if k != "GDN_MAPPED_MAX_ROWS"}
    default = subprocess.run([sys.executable, "-c", read], env=env, capture_output=True, text=True, timeout=120)
    capped = subprocess.run([sys.executable, "-c", read], env={**env, "GDN_MAPPED_MAX_ROWS": "4"},
                            capture_output=True, text=True, timeout=120)
    assert default.returncode == 0 and capped.returncode == 0, default.stderr + capped.stderr
    mapped_max, graph_max = map(int, default.stdout.split())
    assert mapped_max == 1 < graph_max
    assert capped.stdout.split()[0] == "4"
    wrong = subprocess.run([sys.executable, "-c", read], env={**env, "GDN_MAPPED_MAX_ROWS": "eight"},
                           capture_output=True, text=True, timeout=120)
    assert wrong.returncode != 0 and "GDN_MAPPED_MAX_ROWS must be a number of rows, got 'eight'" in wrong.stderr
