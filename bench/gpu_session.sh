#!/usr/bin/env bash
# Everything the H200 host runs for the issue-3/4/7/8 figures, in one place (see bench/NOTES.md).
# Usage on the device host, from the repo root, after `source .devbundle/p2/activate.sh`:
#   bash bench/gpu_session.sh tests|frontends|checks|serve|scale|scalecpu|profile|trace|echowork|tracebig|backendstep|tracebigab|tracebigthreads|probe|cpusplit|loops|ab|abserve|variants|schedround|delay|copythreads|speculative|launchvariants|lanefloor|ablive|enginespy|workerspy|h2floor|launchpairs   (each part fits in one 10-minute call)
#   bash bench/gpu_session.sh pack   (last in a call: everything under $OUT as one results.tgz; the device
#                                     tool brings back at most 8 files, and a few parts write more)
# FRONTENDS=0,4 (serve) / 0,8 (scale): the --frontends values compared side by side; RUNS_ON=loop,thread
# (serve): the --scheduler-runs-on values too; ROUNDS (serve, ab): each load point that many times, alternating;
# LOAD_PROCS (serve, profile): load processes per run (gdn-loadtest --processes); SKIP (serve): parts to skip, e.g. b,c;
# CLIENTS (serve, profile): the clients values; SERVER_FLAGS (serve, abserve, delay, cpusplit): more server
# flags; SHARED_CONN=1 (serve): each load process's clients on one connection (gdn-loadtest
# --shared-connection; the default is a connection per client).
# Logs and results go to $OUT (or bench/results).
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
# Runtime packages the image lacks, as cp312 wheels in .whl/ (git-ignored; carry it): grpcio-health-checking
# and grpcio-reflection 1.84.0, uvloop 0.23.0 (without it the server runs on asyncio's loop and says so
# in its log). Fetch them here with: python3 -m pip download --no-deps --only-binary=:all: --python-version
# 3.12 --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl NAME==VERSION
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1
# gdn_server._native for this host's python3 (the repo runs from PYTHONPATH here, no pip install);
# without it the server runs its Python parse and checks (about half the throughput)
build_native() {  # $1: a checkout's root (its own _native*.c)
  local so
  so="$1/gdn_server/_native$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
  # built every call: a warm machine keeps ignored files, and an older build of another _native.c
  # would otherwise stay in place (2 s)
  gcc -O3 -shared -fPIC -I"$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
    "$1"/gdn_server/_native*.c -o "$so" -ldl || echo "$1: gdn_server._native not built: the Python parse and checks run"
}
build_native .
# py-spy (profile, enginespy) comes in .tools/, or gzipped in .spygz/ where the working tree and the
# bundle leave too little of a call's 64 MiB for it (3 MiB instead of 8)
if [[ ! -x .tools/py-spy && -f .spygz/py-spy.gz ]]; then
  mkdir -p .tools && gunzip -c .spygz/py-spy.gz > .tools/py-spy && chmod +x .tools/py-spy
fi
# A variant of VARIANTS / TRACE_VARIANTS may start with environment settings (GDN_MAPPED_STAGING=1
# --busy-poll-us 0): split_variant puts them in $variant_env and the server flags in $variant_flags
split_variant() {
  variant_env=(); variant_flags=()
  local word
  for word in $1; do
    if [[ ${#variant_flags[@]} -eq 0 && $word =~ ^[A-Z_][A-Z0-9_]*= ]]; then variant_env+=("$word"); else variant_flags+=("$word"); fi
  done
}
python3 -c "from gdn_server import protowire; print('native decode path:', protowire.native is not None)"
# libnghttp2 for --frontend-transport native and h2floor: the image's, else one carried in .h2lib/
# (git-ignored; a copy of the CPU box's /lib/x86_64-linux-gnu/libnghttp2.so.14, which needs only libc)
if ! python3 -c "import ctypes; ctypes.CDLL('libnghttp2.so.14')" 2>/dev/null && [[ -f .h2lib/libnghttp2.so.14 ]]; then
  export GDN_LIBNGHTTP2=$PWD/.h2lib/libnghttp2.so.14 LD_LIBRARY_PATH=$PWD/.h2lib:${LD_LIBRARY_PATH:-}
fi
python3 -c "from gdn_server.frontend_native import check_transport as c; from gdn_server.security import SecurityConfig as S; \
print('native transport:', c('native', S()) or 'ready', '(GDN_LIBNGHTTP2=' + '${GDN_LIBNGHTTP2:-}' + ')')"
python3 -c "from gdn_server.event_loop import loop_name; print('event loop (--event-loop auto):', loop_name('auto'))"
case "${1:-}" in
  tests)
    nvidia-smi -L
    timeout 270 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_backend.py tests/gpu/test_multi_gpu.py \
      tests/gpu/test_kernel.py tests/gpu/test_mapped.py 2>&1 | tee "$out/gpu_tests.log" | tail -25
    ;;
  frontends)  # the --frontends tests against CUDA servers (two GPUs: one engine process per GPU)
    GDN_TEST_SERVER_FLAGS="--device cuda" GDN_TEST_SERVER_TIMEOUT=300 timeout 560 python3 -m pytest -q \
      -p no:cacheprovider tests/test_frontends.py tests/test_replicas.py -k "${TESTS:-exactly or places or dies or migrat}" \
      2>&1 | tee "$out/gpu_frontends.log" | tail -15
    ;;
  checks)
    timeout 60 python3 bench/backend_step.py --out "$out" 2>&1 | tee "$out/backend_step.log" | tail -6
    timeout 270 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_backend.py 2>&1 | tail -3
    ;;
  serve)
    timeout 540 python3 bench/serve.py --device cuda --duration 3 --frontends "${FRONTENDS:-0,4}" --rounds "${ROUNDS:-1}" \
      --runs-on "${RUNS_ON:-auto}" --load-processes "${LOAD_PROCS:-1}" --skip "${SKIP:-}" --clients "${CLIENTS:-1,8,64,256}" \
      ${SHARED_CONN:+--shared-connection} --server-flags "${SERVER_FLAGS:-}" --load-flags="${LOAD_FLAGS:-}" --out "$out" 2>&1 \
      | tee "$out/serve.log" | tail -30
    ;;
  scale)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_multi_gpu.py 2>&1 | tail -3
    timeout 480 python3 bench/scale.py --device cuda --duration 3 --frontends "${FRONTENDS:-0,8}" --out "$out" 2>&1 \
      | tee "$out/scale.log" | tail -20
    ;;
  scalecpu)  # where the CPU goes at the scale-out point (no echo floor; per-process cores)
    timeout 300 python3 bench/scale.py --device cuda --duration 4 --frontends "${FRONTENDS:-8}" --device-sets "0,1;0" \
      --clients 512 --no-echo --out "$out/scalecpu" 2>&1 | tail -12
    ;;
  profile)  # py-spy of a CUDA server at N=1 and N=64 (py-spy carried in .tools/; SPY_ON=load: of the load)
    PY_SPY=${PY_SPY:-.tools/py-spy} timeout 300 python3 bench/profile_server.py --device cuda --clients "${CLIENTS:-1,64}" \
      --duration "${DURATION:-6}" --server-flags "${SERVER_FLAGS:-}" --spy-flags="${SPY_FLAGS:---nonblocking}" \
      --spy-on "${SPY_ON:-server}" --load-processes "${LOAD_PROCS:-1}" --out "$out/profile" 2>&1 | tail -60
    ;;
  trace)  # one step's latency, stage by stage, at N=1 (ours and the echo), per --scheduler-runs-on value,
          # or per server-flag set of TRACE_VARIANTS (separated by ';')
    if [[ -n ${TRACE_VARIANTS:-} ]]; then
      IFS=';' read -ra variants <<< "$TRACE_VARIANTS"
    else
      variants=(); for mode in ${RUNS_ON:-loop thread}; do variants+=("--scheduler-runs-on $mode"); done
    fi
    # TRACE_BASE=DIR (a base checkout, e.g. .ab_base; carry it): each variant on the base and on this
    # tree in turn, ROUNDS (default 1) times, so a change's effect on each stage is seen in one call
    out_abs=$(cd "$out" && pwd)
    for round in $(seq 1 "${ROUNDS:-1}"); do
      for i in "${!variants[@]}"; do
        for side in ${TRACE_BASE:+base} new; do
          echo "[$side $round: ${variants[$i]}]"
          tree=.
          [[ $side == base ]] && tree=$TRACE_BASE && build_native "$tree"
          split_variant "${variants[$i]}"
          (cd "$tree" && PYTHONPATH="$PWD:$PYTHONPATH" env "${variant_env[@]}" timeout 200 python3 bench/trace_step.py \
            --device cuda --steps 3000 --server-flags "${variant_flags[*]}" --out "$out_abs/trace_${side}_${round}_$i" \
            2>&1 | tail -14)
        done
      done
    done
    ;;
  echowork)  # does a server's own work per step lengthen its transport legs? The echo at N=1 with WORK_US of work
    for kind in spin touch; do
      timeout 120 python3 bench/trace_step.py --echo-only --echo-work-us "${WORK_US:-200}" --echo-work-kind $kind \
        --steps 3000 --out "$out/echowork_$kind" 2>&1 | tail -7
    done
    ;;
  tracebig)  # the same for issue 4 (c): one unary request of B=256 sessions at a time
    timeout 300 python3 bench/trace_step.py --device cuda --batch 256 --mode unary --steps 300 --warmup 30 \
      --out "$out/trace_big" 2>&1 | tail -14
    ;;
  tracebigab)  # (c) with big copies/checks on one thread, on torch's pool, and on its pool with passive OpenMP waits
    timeout 150 python3 bench/trace_step.py --device cuda --batch 256 --mode unary --steps 200 --warmup 20 \
      --serial-copies --out "$out/trace_big_serial" 2>&1 | tail -14
    timeout 150 python3 bench/trace_step.py --device cuda --batch 256 --mode unary --steps 200 --warmup 20 \
      --out "$out/trace_big_pool" 2>&1 | tail -14
    OMP_WAIT_POLICY=PASSIVE timeout 150 python3 bench/trace_step.py --device cuda --batch 256 --mode unary --steps 200 \
      --warmup 20 --out "$out/trace_big_passive" 2>&1 | tail -14
    ;;
  probe)  # issue 4 (c)'s copy/check paths for a big request, and N=64 with workers in front of a loop-scheduler engine
    timeout 120 python3 bench/h2d_paths.py --out "$out/h2d_paths" 2>&1 | tail -8
    timeout 420 python3 bench/serve.py --device cuda --duration 3 --clients "${CLIENTS:-1,64}" --skip c \
      --frontends "${FRONTENDS:-0,8}" --out "$out/serve_probe" 2>&1 | tee "$out/serve_probe.log" | tail -24
    ;;
  tracebigthreads)  # (c) with torch's pool at OMP_NUM_THREADS=${THREADS:-4 8} (the host default is one per core)
    for n in ${THREADS:-4 8}; do
      OMP_NUM_THREADS=$n timeout 150 python3 bench/trace_step.py --device cuda --batch 256 --mode unary --steps 200 \
        --warmup 20 --out "$out/trace_big_t$n" 2>&1 | grep -E "in -> queued|round -> submitted|finish -> answered|round trip"
    done
    ;;
  loops)  # N=64 on uvloop (the default), on asyncio's loop, and the echo floor on uvloop too (cpu_split each)
    for case in "uvloop::" "asyncio:--event-loop asyncio:" "uvloop_echo_uvloop::1"; do
      IFS=: read -r name flags echo_uvloop <<< "$case"
      mkdir -p "$out/loops_$name"
      GDN_ECHO_UVLOOP=$echo_uvloop timeout 200 python3 bench/cpu_split.py --device cuda --clients "${CLIENTS:-64}" \
        --duration 4 --server-flags "$flags" --out "$out/loops_$name" 2>&1 | tail -3 | sed "s/^/$name /"
    done
    ;;
  ab)  # N=64 cpu_split of a base checkout (BASE, default .ab_base: its gdn_server, gdn_client, bench; carry it)
        # and of this tree, alternately (ROUNDS, default 2), in one call: an A/B on one host
    base=${BASE:-.ab_base}
    [[ -d $base/gdn_server ]] || { echo "ab: no base checkout at $base" >&2; exit 2; }
    build_native "$base"  # the base's own C module, not this tree's
    out_abs=$(cd "$out" && pwd)
    for round in $(seq 1 "${ROUNDS:-2}"); do
      for side in base new; do
        mkdir -p "$out/ab_${side}_$round"
        if [[ $side == base ]]; then
          (cd "$base" && PYTHONPATH="$PWD:$PYTHONPATH" timeout 200 python3 bench/cpu_split.py --device cuda \
            --clients "${CLIENTS:-64}" --duration 4 --server-flags "${SERVER_FLAGS:-}" --out "$out_abs/ab_${side}_$round" 2>&1)
        else
          timeout 200 python3 bench/cpu_split.py --device cuda --clients "${CLIENTS:-64}" --duration 4 \
            --server-flags "${SERVER_FLAGS:-}" --out "$out/ab_${side}_$round" 2>&1
        fi | tail -2 | sed "s/^/$side $round /"
      done
    done
    ;;
  abserve)  # serve.py part (a) of a base checkout (BASE, default .ab_base; carry it) and of this tree, alternately
            # (ROUNDS, default 2), each with its echo right after it: CLIENTS (64), FRONTENDS (one value, 0),
            # LOAD_PROCS (4), SERVER_FLAGS
    base=${BASE:-.ab_base}
    [[ -d $base/gdn_server ]] || { echo "abserve: no base checkout at $base" >&2; exit 2; }
    build_native "$base"
    out_abs=$(cd "$out" && pwd)
    for round in $(seq 1 "${ROUNDS:-2}"); do
      for side in base new; do
        flags=(--device cuda --duration 3 --clients "${CLIENTS:-64}" --skip b,c --frontends "${FRONTENDS:-0}"
               --load-processes "${LOAD_PROCS:-4}" --server-flags "${SERVER_FLAGS:-}" --out "$out_abs/abserve_${side}_$round")
        if [[ $side == base ]]; then
          (cd "$base" && PYTHONPATH="$PWD:$PYTHONPATH" timeout 240 python3 bench/serve.py "${flags[@]}" 2>&1)
        else
          timeout 240 python3 bench/serve.py "${flags[@]}" 2>&1
        fi | grep '^| a_' | sed "s/^/$side $round /"
      done
    done
    ;;
  variants)  # serve.py part (a) of this tree under each server-flag set of VARIANTS (separated by ';'; a set may start
             # with environment settings, e.g. "GDN_MAPPED_STAGING=0;GDN_MAPPED_STAGING=1"), alternately
             # (ROUNDS, default 1), each with its echo right after it: CLIENTS (64), FRONTENDS (one value, 0), LOAD_PROCS (4)
    IFS=';' read -ra variants <<< "${VARIANTS:?variants: set VARIANTS, e.g. \"--device-wait auto;--device-wait poll\"}"
    for round in $(seq 1 "${ROUNDS:-1}"); do
      for i in "${!variants[@]}"; do
        split_variant "${variants[$i]}"
        env "${variant_env[@]}" timeout 240 python3 bench/serve.py --device cuda --duration 3 --clients "${CLIENTS:-64}" \
          --skip b,c --frontends "${FRONTENDS:-0}" --load-processes "${LOAD_PROCS:-4}" \
          --server-flags "${variant_flags[*]}" --out "$out/variant_${i}_$round" 2>&1 | grep '^| a_' \
          | sed "s/^/[${variants[$i]}] $round /"
      done
    done
    ;;
  schedround)  # bench/scheduler_round.py (the scheduler's CPU per request, no device) of the base and this tree, alternately
    base=${BASE:-.ab_base}
    [[ -d $base/gdn_server ]] || { echo "schedround: no base checkout at $base" >&2; exit 2; }
    build_native "$base"
    out_abs=$(cd "$out" && pwd)
    for round in $(seq 1 "${ROUNDS:-3}"); do
      (cd "$base" && PYTHONPATH="$PWD:${PYTHONPATH:-}" timeout 120 python3 bench/scheduler_round.py --per-round 8,64 \
        --json "$out_abs/schedround_base_$round.json" 2>&1) | tail -2 | sed "s/^/base $round /"
      timeout 120 python3 bench/scheduler_round.py --per-round 8,64 --json "$out/schedround_new_$round.json" 2>&1 \
        | tail -2 | sed "s/^/new $round /"
    done
    ;;
  delay)  # N=64 (part a only) at each --max-queue-delay-us of DELAYS: rows per launch against throughput
        # (FRONTENDS: one --frontends value, default 0; LOAD_PROCS: load processes; SERVER_FLAGS: more flags)
    for d in ${DELAYS:-0 50 150}; do
      timeout 150 python3 bench/serve.py --device cuda --duration 3 --clients "${CLIENTS:-64}" --skip b,c \
        --frontends "${FRONTENDS:-0}" --load-processes "${LOAD_PROCS:-1}" \
        --server-flags "--max-queue-delay-us $d ${SERVER_FLAGS:-}" --out "$out/delay_$d" 2>&1 | tail -2 | sed "s/^/delay $d us /"
    done
    ;;
  launchpairs)  # bench/launch_pairs.py: rows launch by launch at CLIENTS (8,64,256), each on a fresh server with
                # SERVER_FLAGS (8 native workers) and LOAD_FLAGS (native clients over 8 processes); NAME: the
                # results' folder under $OUT; TAKE_DELAYS (default 0): its --take-delay-us list
    timeout 540 python3 bench/launch_pairs.py --clients "${CLIENTS:-8,64,256}" --duration "${DURATION:-8}" \
      --take-delay-us "${TAKE_DELAYS:-0}" \
      --server-flags "${SERVER_FLAGS:---frontends 8 --frontend-transport native}" \
      --load-flags "${LOAD_FLAGS:---client-transport native --processes 8}" --out "$out/${NAME:-launch_pairs}" 2>&1 | tail -8
    ;;
  copythreads)  # the native module's threaded copies: thread hand-off, a B=256 request's inputs, a 2 MiB reply
    timeout 120 python3 bench/copy_threads.py --json "$out/copy_threads.json" 2>&1 | tee "$out/copy_threads.md"
    ;;
  backendstep)  # bench/backend_step.py (submit's host time and the wait, warm caches) under each GDN_MAPPED_STAGING
                # value of MAPPED (default "0 1"), ROUNDS times, alternating
    for round in $(seq 1 "${ROUNDS:-2}"); do
      for m in ${MAPPED:-0 1}; do
        GDN_MAPPED_STAGING=$m timeout 90 python3 bench/backend_step.py --rows "${ROWS:-1,8,16,28,64,128}" --calls 200 \
          --out "$out/backend_step_mapped${m}_$round" 2>&1 | grep '^| [0-9]' | sed "s/^/mapped=$m $round /"
      done
    done
    ;;
  ablive)  # bench/ab_live.py: every side's server up at once, the load alternating between them (ABBA), no echo runs;
           # SIDES (';'-separated LABEL|ROOT|ENV|FLAGS; default: base = BASE (.ab_base) and new = this tree, both
           # with SERVER_FLAGS), CLIENTS (64), ROUNDS (8), DURATION (3), LOAD_PROCS (4); MODEL, MAX_SESSIONS (ab_live's defaults);
           # CPU_WINDOW=s: the cores of each role (engine and workers from the servers' /metrics, the engine's busiest
           # thread, the load, the host's busy cores) over s seconds of each run, from CPU_AFTER (1) s after its first steps;
           # LOAD_FLAGS: more gdn-loadtest flags (e.g. --client-transport native);
           # LOAD=link: bench/link_load.py's steps on the engines' decode links instead of gRPC (sides need --frontends)
    base=${BASE:-.ab_base}
    [[ -d $base/gdn_server ]] && build_native "$base"
    IFS=';' read -ra sides <<< "${SIDES:-base|$base||${SERVER_FLAGS:-};new|.||${SERVER_FLAGS:-}}"
    side_args=()
    for side in "${sides[@]}"; do side_args+=(--side "$side"); done
    timeout 560 python3 bench/ab_live.py "${side_args[@]}" --clients "${CLIENTS:-64}" --rounds "${ROUNDS:-8}" \
      ${MODEL:+--model "$MODEL"} ${MAX_SESSIONS:+--max-sessions "$MAX_SESSIONS"} --duration "${DURATION:-3}" --load-processes "${LOAD_PROCS:-4}" \
      --cpu-window "${CPU_WINDOW:-0}" --cpu-after "${CPU_AFTER:-1}" --load "${LOAD:-grpc}" ${LOAD_FLAGS:+--load-flags="$LOAD_FLAGS"} \
      --out "$out/ablive" 2>&1 | tee "$out/ablive.log" | tail -30
    ;;
  enginespy)  # py-spy of the engine under bench/link_load.py (no gRPC in front), CLIENTS (64) over LOAD_PROCS (8)
               # link connections, SERVER_FLAGS; folded stacks per thread, Python frames and native ones, in enginespy_*.txt
    tmp=$(mktemp -d /tmp/spy-XXXX)
    TMPDIR=$tmp python3 -m gdn_server --host 127.0.0.1 --port 0 --device "${DEVICE:-cuda}" ${MODEL:---preset qwen3-next --devices 0} \
      --max-sessions 512 --frontends 1 --log-level WARNING ${SERVER_FLAGS:-} > "$out/enginespy_server.log" 2>&1 &
    srv=$!
    for _ in $(seq 240); do grep -q "listening on" "$out/enginespy_server.log" && break; sleep 0.5; done
    target=$(grep -o "listening on [0-9.:]*" "$out/enginespy_server.log" | awk '{print $3}')
    epid=$(pgrep -f gdn_server.engine | head -1)
    timeout 120 python3 bench/link_load.py --target "$target" --link "$(ls "$tmp"/gdn-engine-*/link-0.sock)" \
      --clients "${CLIENTS:-64}" --processes "${LOAD_PROCS:-8}" --duration "${DURATION:-32}" --json "$out/enginespy_load.json" &
    load=$!
    sleep "${SPY_AFTER:-12}"
    for kind in python native; do  # Python frames only, then with the C frames under them
      .tools/py-spy record --pid "$epid" --duration "${SPY_S:-6}" --rate "${RATE:-400}" --threads \
        $([[ $kind == native ]] && echo --native) --format raw -o "$out/enginespy_$kind.txt" > "$out/enginespy_$kind.log" 2>&1
      tail -2 "$out/enginespy_$kind.log"
    done
    wait $load
    kill $srv; wait $srv
    ;;
  workerspy)  # py-spy of one front-end worker under gdn-loadtest: CLIENTS (64) streaming over LOAD_PROCS (12)
               # processes, --frontends FRONTENDS (8) and SERVER_FLAGS (e.g. --frontend-transport native);
               # folded stacks, Python frames and native ones, in workerspy_*.txt
    python3 -m gdn_server --host 127.0.0.1 --port 0 --device "${DEVICE:-cuda}" ${MODEL:---preset qwen3-next --devices 0} \
      --max-sessions 512 --frontends "${FRONTENDS:-8}" --log-level WARNING ${SERVER_FLAGS:-} > "$out/workerspy_server.log" 2>&1 &
    srv=$!
    for _ in $(seq 240); do grep -q "listening on" "$out/workerspy_server.log" && break; sleep 0.5; done
    target=$(grep -o "listening on [0-9.:]*" "$out/workerspy_server.log" | awk '{print $3}')
    wpid=$(pgrep -f gdn_server.frontend | head -1)
    timeout 120 python3 -m gdn_client.loadtest --target "$target" --clients "${CLIENTS:-64}" --processes "${LOAD_PROCS:-12}" \
      --duration "${DURATION:-30}" --no-progress --json "$out/workerspy_load.json" > "$out/workerspy_load.log" 2>&1 &
    load=$!
    sleep "${SPY_AFTER:-10}"
    for kind in python native; do
      .tools/py-spy record --pid "$wpid" --duration "${SPY_S:-6}" --rate "${RATE:-400}" --threads \
        $([[ $kind == native ]] && echo --native) --format raw -o "$out/workerspy_$kind.txt" > "$out/workerspy_$kind.log" 2>&1
      tail -2 "$out/workerspy_$kind.log"
    done
    lpid=$(pgrep -f "gdn_client.loadtest" | tail -1)  # one of the load's processes, Python frames
    .tools/py-spy record --pid "$lpid" --duration "${SPY_S:-6}" --rate "${RATE:-400}" --threads --format raw \
      -o "$out/workerspy_loadproc.txt" > "$out/workerspy_loadproc.log" 2>&1
    tail -2 "$out/workerspy_loadproc.log"
    wait $load
    tail -6 "$out/workerspy_load.log"
    kill $srv; wait $srv
    ;;
  h2floor)  # bench/h2_floor.py: the bytes echo in C, in C with Python per message (the workers' H2Transport), and in grpc.aio: server CPU per step
             # (CLIENTS 8,64; LOAD_PROCS 4; needs libnghttp2.so on the host: carry one if the image has none)
    timeout 500 python3 bench/h2_floor.py --clients "${CLIENTS:-8,64}" --rounds "${ROUNDS:-2}" \
      --load-processes "${LOAD_PROCS:-4}" --json "$out/h2_floor.json" 2>&1 | tee "$out/h2_floor.log" | tail -8
    ;;
  lanefloor)  # bench/lane_floor.c: the CPU floor of a native lane's per-request work on this host (seconds)
    gcc -O2 -pthread bench/lane_floor.c -o /tmp/lane_floor && /tmp/lane_floor ${PER_ROUND:-1 8 24 64 128} \
      | tee "$out/lane_floor.md"
    ;;
  launchvariants)  # CudaBackend.submit's host time from cold caches: padded graph launches or direct ones, fill on one thread or the pool
    timeout 300 python3 bench/backend_step.py --variants --rows "${ROWS:-12,16,27,48,64,100}" --calls 80 --out "$out" 2>&1 \
      | tee "$out/backend_variants.log" | tail -9
    ;;
  pack)  # the device tool returns at most 8 files from $OUT: one archive instead (tar xzf results.tgz here)
    tar czf /tmp/gdn_results.tgz -C "$out" . && find "$out" -mindepth 1 -delete && mv /tmp/gdn_results.tgz "$out/results.tgz"
    ls -la "$out"
    ;;
  cpusplit)  # CPU per step, thread by thread, of the server and the load process: ours and the echo
    timeout 400 python3 bench/cpu_split.py --device cuda --clients "${CLIENTS:-1,64}" --duration 4 \
      --server-flags "${SERVER_FLAGS:-}" --out "$out" 2>&1 | tail -8
    ;;
  speculative)
    timeout 300 python3 bench/speculative.py --out "$out" 2>&1 | tee "$out/speculative.log" | tail -8
    ;;
  *) echo "usage: $0 tests|frontends|checks|serve|scale|scalecpu|profile|trace|echowork|tracebig|backendstep|tracebigab|tracebigthreads|probe|cpusplit|loops|ab|abserve|variants|schedround|delay|copythreads|speculative|launchvariants|pack" >&2; exit 2 ;;
esac
