#!/usr/bin/env bash
# Runs the tests that touch timing (hosts, restarts, interrupts, the panel, the debugger) N
# times in a row and counts the runs that failed, so a race that fails one run in N shows.
# Run it while the machine is loaded, for example with `--load` (one busy loop per core for
# the whole run), as the issue on flaky tests asks:
#
#     tests/stress.sh 5 --load
#
# Each run's pytest output goes to $STRESS_DIR/run-K.log (default: a new temporary folder);
# the summary line of every run is printed, and the exit status is the number of failed runs.
set -uo pipefail
cd "$(dirname "$0")/.."

N="${1:?usage: tests/stress.sh N [--load] [extra pytest arguments]}"
shift
LOAD=0
if [[ "${1:-}" == "--load" ]]; then
    LOAD=1
    shift
fi
PY="${PYTHON:-.venv/bin/python}"
DIR="${STRESS_DIR:-$(mktemp -d -t mk-stress-XXXXXX)}"
mkdir -p "$DIR"
MODULES=(
    tests/job/test_hosts.py tests/system/test_hosts_kernel.py      # remote hosts: agents, cut links
    tests/runtime/test_lifecycle.py tests/runtime/test_liveness.py # restarts, deaths, interrupts
    tests/kernel/test_kernel.py tests/spmd/test_spmd_kernel.py     # interrupts through a kernel
    tests/kernel/test_panel.py                                     # the panel's live state
    tests/debug/test_debug.py tests/debug/test_debug_tunnel.py     # the debugger
)

loaders=()
stop_load() {
    for pid in "${loaders[@]}"; do kill "$pid" 2>/dev/null; done
    wait 2>/dev/null
}
trap stop_load EXIT
if (( LOAD )); then
    for _ in $(seq "$(nproc)"); do
        ( while :; do :; done ) &
        loaders+=($!)
    done
    echo "stress: ${#loaders[@]} busy loops keep every core busy"
fi

failed=0
for k in $(seq "$N"); do
    log="$DIR/run-$k.log"
    "$PY" -m pytest -q -p no:cacheprovider "${MODULES[@]}" "$@" > "$log" 2>&1
    rc=$?
    summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed)|no tests ran|error' "$log" | tail -1)"
    if (( rc != 0 )); then
        failed=$((failed + 1))
        echo "stress: run $k of $N FAILED (exit $rc): $summary"
        grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /'
    else
        echo "stress: run $k of $N passed: $summary"
    fi
done
echo "stress: $failed of $N runs failed; logs in $DIR"
exit "$failed"
