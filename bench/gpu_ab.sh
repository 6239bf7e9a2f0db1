#!/usr/bin/env bash
# An A/B of two versions of meshtron in one call of the lent GPU machine, on that one machine.
#
# Lent machines differ by 10-20% from call to call (bench/README.md "session 15": the same
# block measured 17.1 and 18.3-18.7 ms on two H200s), so a change is judged only against the code
# before it run on the same machine, alternately. This script does that:
#
#   bench/gpu_ab.sh prepare REV         # HERE: REV's tree -> .ab/base (git-ignored); also run
#                                       # `bench/gpu_session.sh fetch` once for the wheels
#   GPU_AB_COMMANDS=$'python3 bench/moe_layer.py --device cuda --dtype bf16 --peer\npython3 bench/throughput.py ...' \
#       bash bench/gpu_ab.sh run        # THERE, via the device tool, carry [".whl", ".ab"]
#
# `run` installs the wheels and the working tree as gpu_session.sh's `env` step does, then runs
# every command (one shell line each, newline-separated) in both trees, GPU_AB_ROUNDS rounds
# (default 2), base first in odd rounds and head first in even ones, each under `timeout`
# (GPU_AB_TIMEOUT seconds, default 120) within GPU_AB_BUDGET seconds in all (default 480). A
# command runs in its tree's root with that tree first on PYTHONPATH, so `python3 bench/...`
# is that version's script and package. $OUT/ab.jsonl gets one line per run: label ("base" or
# "head"), base_rev, round, command, exit, seconds, and result (the last stdout line that is
# JSON, or null); $OUT/log.txt every stderr. `run` exits 1 when a run failed. GPU_AB_DIR moves
# .ab. Without CUDA it runs the same way on the CPU (give CPU-sized commands): the rehearsal.
set -uo pipefail
cd "$(dirname "$0")/.."

prepare() {
    local rev=${1:?usage: bench/gpu_ab.sh prepare REV} dir=${GPU_AB_DIR:-.ab}
    local hash
    hash=$(git rev-parse --verify --quiet "$rev^{commit}") || { echo "gpu_ab: $rev is not a commit here" >&2; return 2; }
    rm -rf "$dir/base" && mkdir -p "$dir/base" || return 1
    git archive "$hash" | tar -x -C "$dir/base" || return 1
    echo "$hash" >"$dir/base/.ab_rev"
    echo "base $hash in $dir/base; head is the working tree. Carry [\".whl\", \"$dir\"] to the device."
}

run() {
    local out="${OUT:?set OUT to the folder that receives the results}" dir=${GPU_AB_DIR:-.ab}
    local rounds=${GPU_AB_ROUNDS:-2} budget=${GPU_AB_BUDGET:-480} per=${GPU_AB_TIMEOUT:-120}
    local commands="${GPU_AB_COMMANDS:?set GPU_AB_COMMANDS to the command lines to compare, one per line}"
    [ -f "$dir/base/.ab_rev" ] || { echo "gpu_ab: no $dir/base: run 'bench/gpu_ab.sh prepare REV' first" >&2; return 2; }
    mkdir -p "$out"
    local start=$SECONDS log="$out/log.txt" results="$out/ab.jsonl" failed=0
    local site="${GPU_SESSION_SITE:-/tmp/site}" base head base_rev
    base=$(cd "$dir/base" && pwd) head=$PWD base_rev=$(cat "$dir/base/.ab_rev")
    GPU_SESSION_BUDGET=120 GPU_SESSION_STEPS=env bash bench/gpu_session.sh run >/dev/null 2>&1 \
        || { echo "gpu_ab: install failed (see log.txt)" | tee -a "$log"; return 1; }
    export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
    unset TRITON_INTERPRET
    local lines=()
    mapfile -t lines <<<"$commands"
    local round cmd label tree left t0 rc
    for ((round = 1; round <= rounds; round++)); do
        local order=(base head)
        ((round % 2 == 0)) && order=(head base)
        for cmd in "${lines[@]}"; do
            [ -n "${cmd// /}" ] || continue
            for label in "${order[@]}"; do
                left=$((budget - (SECONDS - start)))
                if [ "$left" -lt 15 ]; then echo "gpu_ab: $label round $round skipped, ${left}s left: $cmd" | tee -a "$log"; continue; fi
                [ "$label" = base ] && tree=$base || tree=$head
                t0=$SECONDS
                echo "== $label round $round: $cmd" >>"$log"
                (cd "$tree" && PYTHONPATH="$tree:$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH" \
                    timeout --kill-after=5 "$((left < per ? left : per))" bash -c "$cmd") >"$out/.stdout" 2>>"$log"
                rc=$?
                [ "$rc" = 0 ] || failed=1
                python3 - "$label" "$base_rev" "$round" "$cmd" "$rc" "$((SECONDS - t0))" "$out/.stdout" >>"$results" <<'EOF'
import json, sys
label, rev, rnd, cmd, rc, secs, stdout = sys.argv[1:]
result = None
for line in reversed(open(stdout).read().splitlines()):
    try:
        result = json.loads(line)
        break
    except ValueError:
        continue
print(json.dumps({"label": label, "base_rev": rev, "round": int(rnd), "command": cmd, "exit": int(rc),
                  "seconds": int(secs), "result": result}))
EOF
                echo "$label round $round: exit $rc after $((SECONDS - t0))s" | tee -a "$log"
            done
        done
    done
    rm -f "$out/.stdout"
    echo "total $((SECONDS - start))s of ${budget}s" | tee -a "$log"
    [ "$failed" = 0 ]
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    run) run ;;
    *) echo "usage: bench/gpu_ab.sh prepare REV | run   (see the comment at the top)" >&2; exit 2 ;;
esac
