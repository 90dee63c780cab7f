#!/usr/bin/env bash
# fake-device server (loop scheduler), 64 clients: gRPC defaults vs -event_engine_listener, rows per launch
cd /work/main
for r in $(seq ${ROUNDS:-2}); do
  for ge in "" "-event_engine_listener"; do
    GRPC_EXPERIMENTS="$ge" timeout 300 .venv/bin/python bench/frontend.py --clients ${CLIENTS:-64} --runs-on loop $EXTRA 2>&1 \
      | grep -E "^ *gdn " | sed "s/^/[$ge] $r /"
  done
done
