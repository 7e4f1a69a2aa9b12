#!/usr/bin/env bash
# One device call that runs the GPU checks in order of importance, each under its own
# time limit, and archives data/measured into $OUT after each one, so a step that
# fails or runs out of time keeps what the steps before it measured:
#
#   1. setup (device-setup.sh): versions of everything;
#   2. e2e.py under iadeep: `iadeep up` with NVML, every job through `iadeep run`;
#   3. e2e.py exclusive, then packing, on the same stream (the baselines);
#   4. measure_interference.py on a few job types, with whatever time is left.
#
# Usage (on the device machine, carrying target/gpu-carry.tar.xz):
#   SESSION_BUDGET_S=520 scripts/gpu/device-session.sh
# Environment: SESSION_BUDGET_S (default 520: keep it under the call's timeout),
# E2E_STEPS (policies and their limits, default "iadeep:200 exclusive:150 packing:90"),
# E2E_ARGS (the stream; default below), INTERFERENCE_JOBS (measure_interference --jobs).
# Every step's output also goes to $OUT/session.log.
set -uo pipefail
cd "$(dirname "$0")/../.."

budget=${SESSION_BUDGET_S:-520}
deadline=$(( $(date +%s) + budget ))
out=${OUT:-target/device-session}
mkdir -p "$out"
exec > >(tee -a "$out/session.log") 2>&1

# The stream of the end-to-end run: short enough that all three policies fit one call.
read -r -a e2e_args <<< "${E2E_ARGS:---jobs 8 --mean-gap-s 4 --steps-scale 0.6}"
interference_jobs=${INTERFERENCE_JOBS:-resnet50:32,lm-small:16,efficientnet_b0:64}

archive() {
    [ -d data/measured ] && tar -C data -czf "$out/measured.tar.gz" measured
}

# step NAME LIMIT_S COMMAND...: runs COMMAND for at most LIMIT_S (and never past the
# deadline), with SIGINT first so that e2e.py stops its cluster and jobs cleanly.
step() {
    local name=$1 limit=$2
    shift 2
    local left=$(( deadline - $(date +%s) ))
    if [ "$left" -lt 30 ]; then
        echo "== $name: skipped, ${left} s left of the session's ${budget} s"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name: at most ${limit} s ($(date -u +%H:%M:%S))"
    local start
    start=$(date +%s)
    timeout -s INT -k 30 "$limit" "$@"
    local code=$?
    echo "== $name: exit ${code} after $(( $(date +%s) - start )) s"
    archive
}

if ! timeout 180 scripts/gpu/device-setup.sh; then
    echo "== setup failed: nothing measured"
    exit 1
fi
. target/gpu-carry/env.sh
export PYTHONUNBUFFERED=1

# POLICY:SECONDS, in order; each policy's run is stopped 10 s before its step's limit
# (the limit cut to the time left first, so that the policy stops itself cleanly).
for item in ${E2E_STEPS:-iadeep:200 exclusive:150 packing:90}; do
    policy=${item%%:*}
    limit=${item##*:}
    left=$(( deadline - $(date +%s) ))
    [ "$limit" -gt "$left" ] && limit=$left
    step "e2e $policy" "$limit" python3 scripts/gpu/e2e.py --policies "$policy" \
        --policy-timeout-s "$(( limit > 20 ? limit - 10 : 10 ))" "${e2e_args[@]}"
done
left=$(( deadline - $(date +%s) - 20 ))
# An interference run of this kind already begun is continued, never refused.
resume=()
for raw in data/measured/*/interference/interference-raw.jsonl; do
    [ -f "$raw" ] && resume=(--resume)
done
step "interference" "$left" python3 scripts/gpu/measure_interference.py "${resume[@]}" \
    --budget-s "$(( left > 40 ? left - 30 : 10 ))" \
    --jobs "$interference_jobs" --warmup-s 2 --measure-s 4 --triples 0
echo "== done: $(ls "$out")"
