#!/usr/bin/env bash
# base (/tmp/abb, HEAD) vs new (this tree): bench/frontend.py fake-device server, loop scheduler, with the echo
for r in $(seq ${ROUNDS:-3}); do
  for side in base new; do
    dir=/work/main; [[ $side == base ]] && dir=/tmp/abb
    (cd $dir && env -u GRPC_EXPERIMENTS PYTHONPATH=$dir timeout 300 /work/main/.venv/bin/python bench/frontend.py --clients ${CLIENTS:-1,8,32} --runs-on loop --load=--echo 2>&1) \
      | grep -E "^ *(gdn|echo) " | awk -v s="$side $r" '{print s, $1, "N", $3, "steps/s", $7, "p50", $10, ($1=="echo" ? "pct " $15 : "")}'
  done
done
