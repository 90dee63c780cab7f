#!/usr/bin/env bash
# usage: ab.sh "<server flags>" "<clients>" rounds  -- default grpc vs -event_engine_listener, alternating
cd "$(git rev-parse --show-toplevel)"
flags=$1; clients=$2; rounds=${3:-2}
port=51234
for r in $(seq $rounds); do
  for side in default legacy; do
    if [[ $side == legacy ]]; then ge="-event_engine_listener"; else ge=""; fi
    GRPC_EXPERIMENTS="$ge" .venv/bin/python -m gdn_server --device cpu --port $port --layers 3 --q-heads 2 --v-heads 4 --log-level WARNING $flags > /tmp/gab/srv.log 2>&1 &
    pid=$!
    for i in $(seq 100); do .venv/bin/python - <<PY 2>/dev/null && break
import socket; s=socket.create_connection(("127.0.0.1",$port),0.2)
PY
      sleep 0.3; done
    sleep 1
    .venv/bin/python -m gdn_client.loadtest --target 127.0.0.1:$port --clients $clients --duration 4 --no-progress --json /tmp/gab/$side.json 2>&1 | grep -E "^ *gdn" | sed "s/^/$side $r /"
    kill $pid; wait $pid 2>/dev/null
  done
done
