#!/usr/bin/env bash
# The maintained benchmarks on a GPU host, one part per call (each fits in ten minutes).
# From the repo root of the host's copy of the tree:
#   source .devbundle/p2/activate.sh && bash bench/gpu_session.sh kernel|ring|serve|scale|profile|compile
# Results go to $OUT when it is set (the folder the host hands back), else bench/out.
# A copy without .git cannot name its commit: set BENCH_COMMIT=<commit> to record it.
# Knobs (all optional): CLIENTS, DURATION, ROUNDS, LOAD_PROCS, SERVER_FLAGS, LOAD_FLAGS;
# PROCESSES (scale: the K values); SPY_ON (profile: server or load); PY_SPY (profile: the py-spy
# binary, else the one on PATH).
set -uo pipefail
out=${OUT:-bench/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi -L
case "${1:-}" in
  kernel)
    timeout 560 python3 bench/kernel.py --skip-baselines --out "$out" 2>&1 | tail -60
    ;;
  ring)
    timeout 300 python3 bench/ring.py --out "$out" 2>&1 | tail -60
    ;;
  serve)
    timeout 560 python3 bench/serve.py --clients "${CLIENTS:-1,64,256}" --duration "${DURATION:-4}" \
      --rounds "${ROUNDS:-1}" --load-processes "${LOAD_PROCS:-4}" --server-flags="${SERVER_FLAGS:-}" \
      --load-flags="${LOAD_FLAGS:-}" --out "$out" 2>&1 | tail -30
    ;;
  scale)
    timeout 560 python3 bench/scale.py --processes "${PROCESSES:-1,4,8}" --clients "${CLIENTS:-64,256}" \
      --duration "${DURATION:-6}" --load-processes "${LOAD_PROCS:-8}" --server-flags="${SERVER_FLAGS:-}" \
      --load-flags="${LOAD_FLAGS:-}" --out "$out" 2>&1 | tail -20
    ;;
  profile)
    timeout 400 python3 bench/profile_server.py --clients "${CLIENTS:-1,64}" --duration "${DURATION:-6}" \
      --spy-on "${SPY_ON:-server}" --load-processes "${LOAD_PROCS:-1}" --server-flags="${SERVER_FLAGS:-}" \
      --out "$out" 2>&1 | tail -60
    ;;
  compile)
    timeout 300 python3 bench/compile.py --out "$out" 2>&1 | tail -8
    ;;
  *) echo "usage: $0 kernel|ring|serve|scale|profile|compile" >&2; exit 2 ;;
esac
