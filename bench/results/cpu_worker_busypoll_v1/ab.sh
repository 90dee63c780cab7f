#!/usr/bin/env bash
# CPU box: --frontends workers' busy polling off/on, alternating, via bench/serve.py (part a only)
cd /work/main
export PATH=/work/main/.venv/bin:$PATH
out=bench/results/cpu_worker_busypoll_v1
mkdir -p $out
for round in 1 2; do
  for fe_cl in "1:1" "2:8,32"; do
    fe=${fe_cl%%:*}; cl=${fe_cl#*:}
    for busy in 0 1000; do
      timeout 280 python bench/serve.py --device cpu --model "--layers 3 --q-heads 2 --v-heads 4" --frontends $fe \
        --clients $cl --skip b,c --duration 4 --load-processes 1 --server-flags "--busy-poll-us $busy" \
        --out $out/f${fe}_busy${busy}_$round 2>&1 | grep '^| a_' | sed "s/^/[busy $busy] $round /"
    done
  done
done
