"""What a CUDA server's start spends on its kernels, compiled, then loaded from the kernel cache.

Two fresh processes each get every kernel a CUDA backend of the model launches
(`backends.cuda.compile_kernels`, what its warm-up runs) with one kernel-cache folder
(`gdn-server --kernel-cache`): the first finds it empty and compiles, the second loads what the
first kept. No GPU needed: without one the kernels are compiled for CUTE_DSL_ARCH (sm_90a unless
set); with one, for that GPU.

    python bench/compile.py                              # qwen3-next, bf16 state
    python bench/compile.py --state-dtype float32

Prints one table and writes bench/out/compile-<UTC time>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import common

CHILD = """
import dataclasses, json, sys, time
start = time.perf_counter()
from gdn_server.backends.cuda import compile_kernels
from gdn_server.config import PRESETS
from gdn_server.kernels import _compiled
imported = time.perf_counter()
_compiled.use_disk_cache(sys.argv[1])
shape = dataclasses.replace(PRESETS[sys.argv[2]], state_dtype=sys.argv[3])
count = compile_kernels(shape)
print(json.dumps({"kernels": count, "import_s": imported - start, "kernels_s": time.perf_counter() - imported}))
"""


def gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()


def run(folder: str, preset: str, state_dtype: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(common.REPO), os.environ.get("PYTHONPATH", "")])}
    if not gpu_present():
        env.setdefault("CUTE_DSL_ARCH", "sm_90a")  # what the DSL compiles for where it finds no GPU to ask
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, folder, preset, state_dtype], capture_output=True, text=True,
                          env=env, timeout=1800, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - start
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-next")
    p.add_argument("--state-dtype", default="bfloat16")
    p.add_argument("--out", default=None, help="folder of the result file (default bench/out)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "kernels")
        rows = [{"start": name, **run(folder, args.preset, args.state_dtype)} for name in ("empty cache", "kept")]
        rows[-1]["files"] = len(os.listdir(folder))
    print(common.markdown_table(
        ["start", "kernels", "imports s", "kernels s", "whole process s"],
        [(r["start"], r["kernels"], f"{r['import_s']:.1f}", f"{r['kernels_s']:.2f}", f"{r['process_s']:.1f}")
         for r in rows]))
    path = common.write_json(common.out_path("compile", args.out), {"args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
