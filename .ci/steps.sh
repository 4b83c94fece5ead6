# Timed steps for .ci/run (sourced): `step NAME COMMAND...` runs COMMAND in this shell (a venv it
# activates stays active), records its wall time and the machine's peak memory while it ran (MemTotal -
# MemAvailable, sampled twice a second: what every process together held, background jobs included)
# and the disk the run had taken by then on the temporary folder's file system (its used space less what
# was used when the run began: the venvs, caches and every test's files), and `steps_table` prints them
# with the total. The free space at the start is printed first: a run that fills the disk says so. A
# command that fails stops the run (set -e): the EXIT trap names the step and its exit code, then prints
# the table of the steps so far.

_STEPS=()
_STEP=""
_T0=$(date +%s)

_used_mb() {
    awk '/^MemTotal:/ {t = $2} /^MemAvailable:/ {a = $2} END {print int((t - a) / 1024)}' /proc/meminfo
}

_disk_mb() {  # used MB on the file system of the temporary folder
    df -Pk "${TMPDIR:-/tmp}" 2>/dev/null | awk 'NR == 2 {print int($3 / 1024)}' || echo 0
}
_DISK0=$(_disk_mb)
echo "disk: $(df -Ph "${TMPDIR:-/tmp}" 2>/dev/null | awk 'NR == 2 {print $4}' || true) free on the temporary folder's file system"

_sample() {  # the highest _used_mb and _disk_mb seen, written to $1 until killed
    local peak=0 disk=0 used taken
    while :; do
        used=$(_used_mb)
        taken=$(($(_disk_mb || echo "$_DISK0") - _DISK0))
        if ((used > peak || taken > disk)); then
            peak=$((used > peak ? used : peak))
            disk=$((taken > disk ? taken : disk))
            echo "$peak $disk" > "$1"
        fi
        sleep 0.5
    done
}

_clock() {
    printf '%d:%02d' $(($1 / 60)) $(($1 % 60))
}

step() {
    _STEP=$1
    shift
    echo "=== $_STEP: $*"
    local start peakfile sampler
    start=$(date +%s)
    peakfile=$(mktemp)
    echo "$(_used_mb) 0" > "$peakfile"
    _sample "$peakfile" &
    sampler=$!
    "$@"
    kill "$sampler" 2>/dev/null || true
    wait "$sampler" 2>/dev/null || true
    _STEPS+=("$_STEP $(($(date +%s) - start)) $(cat "$peakfile")")
    rm -f "$peakfile"
    _STEP=""
}

steps_table() {
    local name seconds peak disk
    echo
    printf '%-24s %8s %12s %12s\n' "step" "wall" "peak memory" "disk taken"
    for entry in "${_STEPS[@]}"; do
        read -r name seconds peak disk <<< "$entry"
        printf '%-24s %8s %9s GB %9s GB\n' "$name" "$(_clock "$seconds")" \
            "$(awk -v m="$peak" 'BEGIN {printf "%.1f", m / 1024}')" "$(awk -v m="$disk" 'BEGIN {printf "%.1f", m / 1024}')"
    done
    printf '%-24s %8s\n' "total" "$(_clock $(($(date +%s) - _T0)))"
}

_on_exit() {
    local rc=$?
    jobs -p | xargs -r kill 2>/dev/null || true
    if ((rc != 0)); then
        echo
        echo "step ${_STEP:-?} failed: exit code $rc"
    fi
    steps_table
    exit "$rc"
}
trap _on_exit EXIT
