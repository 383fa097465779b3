#!/usr/bin/env bash
# Run a command beside two CPU-burning processes, as on a busy 2-core machine; the burners die with it.
#   scripts/under-load.sh CMD ARGS...     (scripts/test.sh --under-load runs the suite this way)
# The command sees the burners' pids in GYMRPC_BURNERS; its exit code is this script's.
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: $0 CMD ARGS..." >&2; exit 2; }
BURNERS=()
stop_burners() {
  [ ${#BURNERS[@]} -eq 0 ] && return
  kill "${BURNERS[@]}" 2>/dev/null
  wait "${BURNERS[@]}" 2>/dev/null
}
trap stop_burners EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for _ in 1 2; do
  (trap - INT TERM; while :; do :; done) &
  BURNERS+=("$!")
done
export GYMRPC_BURNERS="${BURNERS[*]}"
echo "under load: CPU burners ${GYMRPC_BURNERS} run until the command ends" >&2
"$@"
