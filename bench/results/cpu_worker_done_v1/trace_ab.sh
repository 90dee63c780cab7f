#!/usr/bin/env bash
# worker path A/B on the CPU box: base (/tmp/abb = HEAD) and this tree, alternating, --frontends 1, CPU engine
for r in $(seq ${ROUNDS:-3}); do
  for side in base new; do
    dir=/work/main; [[ $side == base ]] && dir=/tmp/abb
    (cd $dir && PYTHONPATH=$dir timeout 300 /work/main/.venv/bin/python bench/trace_step.py --device cpu \
      --model "--layers 4 --q-heads 2 --v-heads 4" --server-flags "--frontends 1" --steps 1500 --out /tmp/trab_${side}_$r 2>&1) \
      | grep -E "in -> sent|flushed -> reply in|reply in -> reply|round -> submitted|round trip" | tr -s ' ' | sed "s/^/$side $r /"
  done
done
