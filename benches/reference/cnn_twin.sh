#!/usr/bin/env bash
# The CNN's PyTorch twin: from the same data file and initial weights, the runner and plain
# PyTorch DDP (cnn_torch.py) train PIPELINE (default pipelines/cnn_ddp.toml) at world sizes 1 and
# 2; prints both per-epoch losses and their largest relative difference.
#   bash benches/reference/cnn_twin.sh [PIPELINE] [RUNNER]
# Needs the reference install (benches/reference/setup.sh) and python3 with polars (to read the
# runner's trace.parquet).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
pipeline=${1:-$root/pipelines/cnn_ddp.toml}
runner=${2:-$root/target/debug/runner}
python=$(bash "$root/benches/reference/setup.sh")
torchrun=$(dirname "$python")/torchrun
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$python" "$root/benches/reference/cnn_torch.py" prepare "$pipeline" "$dir"
for w in ${TWIN_WORLD_SIZES:-1 2}; do
  "$runner" run "$dir/pipeline.toml" --out "$dir/runner-$w" --set run.world_size=$w --set run.threads_per_rank=1 >/dev/null
  OMP_NUM_THREADS=1 "$torchrun" --standalone --nproc_per_node=$w "$root/benches/reference/cnn_torch.py" train "$dir" \
    --out "$dir/torch-$w.json" --threads 1 2>/dev/null
done
python3 - "$dir" <<'PY'
import json, os, sys
import polars as pl
d = sys.argv[1]
for w in [int(w) for w in os.environ.get("TWIN_WORLD_SIZES", "1 2").split()]:
    t = pl.read_parquet(f"{d}/runner-{w}/trace.parquet").filter(pl.col("rank") == 0).sort("epoch")
    ours = t["global_train_loss"].to_list()
    theirs = [e["loss"] for e in json.load(open(f"{d}/torch-{w}.json"))["epochs"]]
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    print(f"world size {w}")
    for e, (a, b) in enumerate(zip(ours, theirs), 1):
        print(f"  epoch {e}: runner {a:.10f}  torch {b:.10f}  relative difference {abs(a - b) / abs(b):.1e}")
    print(f"  largest relative difference {worst:.1e} ({'within' if worst <= 1e-5 else 'NOT within'} 1e-5)")
    # Training throughput over all ranks, from the median epoch (rank 0's clock; 1 thread per rank).
    med = lambda v: sorted(v)[len(v) // 2]
    ours_s = med(t["epoch_s"].to_list())
    theirs_s = med([e["epoch_s"] for e in json.load(open(f"{d}/torch-{w}.json"))["epochs"]])
    n = json.load(open(f"{d}/torch-{w}.json"))["epochs"][0]["samples"]
    print(f"  images/s: runner {n / ours_s:.0f}, torch {n / theirs_s:.0f} ({theirs_s / ours_s:.2f}x)")
PY
