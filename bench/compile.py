"""What a CUDA server's start spends on its kernels, compiled, then loaded from the kernel cache.

`gdn-server --compile-kernels` runs twice with one fresh kernel-cache folder: the first finds it
empty and compiles every kernel a CUDA server of the model launches (its warm-up's, and the
shared-memory ones), the second loads what the first kept. No GPU needed: without one the
kernels are compiled for CUTE_DSL_ARCH (sm_90a unless set); with one, for that GPU.

    python bench/compile.py                              # qwen3-next, bf16 state
    python bench/compile.py --state-dtype float32

Prints one table and writes bench/out/compile-<UTC time>.json.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import common

# gdn-server --compile-kernels' line: "N kernels for ARCH in DIR: C compiled, F there already (S s)"
SAID = re.compile(r"(\d+) kernels for (\S+) in .*: (\d+) compiled, (\d+) there already \(([\d.]+) s\)")


def run(folder: str, preset: str, state_dtype: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(common.REPO), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gdn_server", "--preset", preset, "--state-dtype", state_dtype,
                           "--compile-kernels", "--kernel-cache", folder], capture_output=True, text=True, env=env,
                          timeout=1800, check=True)
    kernels, arch, compiled, found, seconds = SAID.search(done.stdout).groups()
    return {"kernels": int(kernels), "arch": arch, "compiled": int(compiled), "found": int(found),
            "kernels_s": float(seconds), "process_s": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-next")
    p.add_argument("--state-dtype", default="bfloat16")
    p.add_argument("--out", default=None, help="folder of the result file (default bench/out)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "kernels")
        rows = [{"start": name, **run(folder, args.preset, args.state_dtype)} for name in ("empty cache", "kept")]
    print(common.markdown_table(
        ["start", "arch", "kernels", "compiled", "loaded", "kernels s", "whole process s"],
        [(r["start"], r["arch"], r["kernels"], r["compiled"], r["found"], f"{r['kernels_s']:.2f}",
          f"{r['process_s']:.1f}") for r in rows]))
    path = common.write_json(common.out_path("compile", args.out), {"args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
