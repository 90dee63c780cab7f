#!/bin/sh
# Maps GDN_* environment variables to gdn-server flags: GDN_MAX_SESSIONS=512 -> --max-sessions 512.
# Unset or empty variables are left out. Arguments to this script come after the mapped flags,
# so they win (argparse keeps the last value). `gdn-entrypoint gdn-loadtest ...` (or any other
# command starting with something other than a flag) runs that command instead.
set -eu

case "${1:-}" in
    ""|-*) ;;
    *) exec "$@" ;;
esac

for name in HOST PORT DEVICE DEVICES PRESET LAYERS Q_HEADS V_HEADS HEAD_DIM WEIGHTS SEED SCALE STATE_DTYPE \
            MAX_SESSIONS MAX_BATCH_ROWS MAX_QUEUE_DELAY_US MAX_QUEUE_ROWS \
            STATE_DIR SESSION_IDLE_TIMEOUT_S SPECULATIVE_TIMEOUT_S METRICS_PORT SHUTDOWN_DELAY_S DRAIN_TIMEOUT_S \
            MAX_CALLS MAX_CALLS_PER_CLIENT MESSAGE_TIMEOUT_S MAX_STREAMS_PER_CONNECTION MAX_CONNECTIONS IDLE_CONNECTION_TIMEOUT_S \
            SHARED_MEMORY_IDLE_S PROCESSES PROCESS_INDEX PROCESS_PORTS KERNEL_CACHE \
            TLS_CERT TLS_KEY TLS_CLIENT_CA AUTH_TOKEN_FILE MAX_SESSIONS_PER_CLIENT LOG_LEVEL; do
    eval "value=\${GDN_${name}:-}"
    if [ -n "$value" ]; then
        flag="--$(printf '%s' "$name" | tr 'A-Z_' 'a-z-')"
        set -- "$flag" "$value" "$@"
    fi
done

exec gdn-server "$@"
