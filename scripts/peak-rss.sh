#!/usr/bin/env bash
# Peak resident memory per rank of one pipeline under several strategies, run one after another
# (alternating, REPEAT times), beside each rank's training state and the plan's whole-process
# estimate: the numbers of docs/fsdp.md's "Memory" section.
#
#   scripts/peak-rss.sh PIPELINE [REPEAT] [-- --set KEY=VALUE ...]
#
# Strategies: STRATEGIES="ddp fsdp fsdp2" by default (fsdp2: FSDP with ZeRO-2). RUNNER: the binary
# (default target/debug/runner). Runs go to a temporary directory, deleted afterwards.
set -euo pipefail
pipeline=$1; shift
repeat=1
if [[ $# -gt 0 && $1 != -- ]]; then repeat=$1; shift; fi
[[ $# -gt 0 && $1 == -- ]] && shift
runner=${RUNNER:-target/debug/runner}
python=${PYTHON:-.deps/reference/bin/python}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
uptime
for r in $(seq 1 "$repeat"); do
  for s in ${STRATEGIES:-ddp fsdp fsdp2}; do
    case $s in
      ddp) sets=(--set 'wrap.strategy="ddp"') ;;
      fsdp) sets=(--set 'wrap.strategy="fsdp"') ;;
      fsdp2) sets=(--set 'wrap.strategy="fsdp"' --set 'wrap.fsdp.reshard_after_forward=false') ;;
    esac
    # Measured, not limited: the pipeline's run.memory_per_rank_mb would refuse DDP.
    sets+=(--set 'run.memory_per_rank_mb=1000000')
    estimate=$("$runner" validate "$pipeline" "${sets[@]}" "$@" | grep -o 'about [0-9.]* [GM]iB per rank\|[0-9.]* [GM]iB per rank' | head -1 || true)
    "$runner" run "$pipeline" --out "$out/$s-$r" "${sets[@]}" "$@" >/dev/null
    "$python" - "$out/$s-$r/trace.parquet" "$s" "$estimate" <<'PY'
import sys, pandas as pd
t = pd.read_parquet(sys.argv[1])
mib = lambda b: b / 2**20
g = t.groupby("rank")
state = g.apply(lambda d: (d.param_bytes + d.grad_bytes + d.optim_bytes).max())
rss = g.peak_rss_bytes.max()
print(f"{sys.argv[2]:6} estimate {sys.argv[3] or '?':>18}  state MiB/rank {' '.join(f'{mib(v):.0f}' for v in state)}"
      f"  peak RSS MiB/rank {' '.join(f'{mib(v):.0f}' for v in rss)}")
PY
  done
done
uptime
