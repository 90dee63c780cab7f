#!/usr/bin/env bash
cd /work/main
for r in $(seq ${ROUNDS:-2}); do
  for f in ${FRACS:-0 0.5}; do
    GDN_GATHER_FRAC=$f GDN_GATHER_MAX_US=${MAXUS:-1000} timeout 300 .venv/bin/python bench/frontend.py --clients ${CLIENTS:-1,64} --runs-on loop 2>&1 \
      | grep -E "^ *gdn " | sed "s/^/[gather $f] $r /"
  done
done
