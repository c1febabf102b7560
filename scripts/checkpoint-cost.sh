#!/usr/bin/env bash
# What checkpoints cost the training step: runs PIPELINE with no checkpoints, with synchronous ones
# and with asynchronous ones (checkpoint.async) every EVERY optimizer steps, alternating, REPS
# times, and prints for each run rank 0's training time per optimizer step (from trace.parquet: the
# checkpoints written inside an interval count in it, and so does the writer thread's competition
# for the cores) and its wall time end to end. Each run directory is removed once read.
#
#   scripts/checkpoint-cost.sh PIPELINE [EVERY] [REPS] [--set KEY=VALUE ...]
#   scripts/checkpoint-cost.sh pipelines/shakespeare_char.toml 10 2 --set train.steps=100 --set validate.every_steps=100
#   scripts/checkpoint-cost.sh pipelines/large_model_fsdp.toml 10 2 --set train.epochs=1
#
# MODES (default "none sync async") picks the runs, e.g. MODES=async RUNNER=/tmp/other-runner to
# time another build's asynchronous checkpoints beside these.
#
# Each run also records every step's phases (trace.step_every = 1), and the script prints the
# run's time per step over its median step's: a ratio within one run, which a machine whose speed
# drifts from run to run leaves alone. What checkpoints cost is then a run's ratio over the
# ratio without them.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNNER=${RUNNER:-target/release/runner}
PYTHON=${PYTHON:-.deps/reference/bin/python}
pipeline=$1
every=${2:-10}
reps=${3:-2}
shift $(($# < 3 ? $# : 3))
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "$(uptime)"
for rep in $(seq "$reps"); do
    for mode in ${MODES:-none sync async}; do
        case $mode in
            none) sets=() ;;
            sync) sets=(--set "checkpoint.every_steps=$every") ;;
            async) sets=(--set "checkpoint.every_steps=$every" --set checkpoint.async=true) ;;
        esac
        dir="$out/$mode-$rep"
        start=$(date +%s.%N)
        "$RUNNER" run "$pipeline" "${sets[@]}" --set trace.step_every=1 "$@" --out "$dir" >"$dir.log" 2>&1 ||
            { cat "$dir.log" >&2; exit 1; }
        end=$(date +%s.%N)
        "$PYTHON" - "$dir" "$mode" "$start" "$end" <<'PY'
import sys
import pyarrow.parquet as pq
d, mode, start, end = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
t = pq.read_table(f"{d}/trace.parquet").to_pandas()
r0 = t[t["rank"] == 0]
steps = int(r0["step"].max())
per_step = 1000 * r0["epoch_s"].sum() / steps
s = pq.read_table(f"{d}/steps.parquet").to_pandas()
s = s[s["rank"] == 0]
phases = ["batch_s", "forward_s", "loss_s", "backward_s", "sync_s", "update_s"]
median = 1000 * s[phases].sum(axis=1).median()
print(f"{mode:5}  {per_step:8.1f} ms per step  {end - start:7.1f} s end to end  ({steps} steps)  "
      f"median step {median:7.1f} ms  per step ÷ median {per_step / median:.3f}", flush=True)
PY
        rm -rf "$dir"
    done
done
echo "$(uptime)"
