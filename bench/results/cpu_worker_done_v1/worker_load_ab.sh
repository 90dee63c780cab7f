#!/usr/bin/env bash
# base (/tmp/abb) vs this tree: --device cpu --frontends 2 (small model), gdn-loadtest 8 and 32 clients, alternating
port=51277
for r in $(seq ${ROUNDS:-2}); do
  for side in base new; do
    dir=/work/main; [[ $side == base ]] && dir=/tmp/abb
    (cd $dir && PYTHONPATH=$dir timeout 120 /work/main/.venv/bin/python -m gdn_server --device cpu --port $port --layers 3 \
      --q-heads 2 --v-heads 4 --frontends 2 --log-level WARNING > /tmp/wl_srv.log 2>&1 &)
    for i in $(seq 100); do /work/main/.venv/bin/python -c "import socket; socket.create_connection(('127.0.0.1',$port),0.2)" 2>/dev/null && break; sleep 0.3; done
    sleep 2
    /work/main/.venv/bin/python -m gdn_client.loadtest --target 127.0.0.1:$port --clients 1,8,32 --duration 4 --no-progress 2>&1 \
      | grep -E "^ *gdn" | awk -v s="$side $r" '{print s, "N", $3, "steps/s", $7, "p50", $10}'
    pkill -f "gdn_server --device cpu --port $port"; sleep 2
  done
done
