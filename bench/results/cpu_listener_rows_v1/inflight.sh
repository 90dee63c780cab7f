#!/usr/bin/env bash
# fake-device server, loop scheduler, 64 clients: LOOP_MAX_IN_FLIGHT values (patched in place, restored after)
cd /work/main
for r in $(seq ${ROUNDS:-2}); do
  for n in ${VALUES:-4 1 2}; do
    sed -i "s/^LOOP_MAX_IN_FLIGHT = .*/LOOP_MAX_IN_FLIGHT = $n/" gdn_server/scheduler.py
    timeout 300 .venv/bin/python bench/frontend.py --clients ${CLIENTS:-64} --runs-on loop 2>&1 \
      | grep -E "^ *gdn " | sed "s/^/[inflight $n] $r /"
  done
done
sed -i "s/^LOOP_MAX_IN_FLIGHT = .*/LOOP_MAX_IN_FLIGHT = 4/" gdn_server/scheduler.py
git diff --stat gdn_server/scheduler.py
