#!/usr/bin/env bash
# The GPU check (docs/gpus.md): runs the bundle that scripts/gpu-bundle.sh built on a GPU machine
# as it is, and writes a report: scripts/gpu_check.py says what each section runs and compares.
#
#   scripts/gpu-check.sh [--cpu] [--only env,ddp,...]
#
# On the GPU machine (no Rust, no network): the runner in target/gpu-bundle loads the machine's own
# libtorch (torch 2.11.0+cu130, found from `python3 -c "import torch"`) and CUDA libraries beside
# it. The report goes to $OUT (the device tool's folder), else target/gpu-check.
# --cpu runs every step on this machine's CPU instead, with the same bundle against the libtorch it
# was built with, and the reference environment's Python: the check itself, tested where no GPU is.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
runner="${RUNNER:-$root/target/gpu-bundle/runner}"
out="${OUT:-$root/target/gpu-check}"
args=()
cpu=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) cpu=1 args+=(--cpu) ;;
    --only) args+=(--only "$2"); shift ;;
    -h | --help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-check: unknown argument $1 (usage: scripts/gpu-check.sh [--cpu] [--only SECTIONS])" >&2; exit 2 ;;
  esac
  shift
done
[ -x "$runner" ] || { echo "gpu-check: no bundle at $runner: run scripts/gpu-bundle.sh first" >&2; exit 1; }

if [ "$cpu" = 1 ]; then
  # The bundle's own libtorch (its RUNPATH), and the Python of scripts/setup.sh --tests.
  python="${PYTHON:-$root/.deps/reference/bin/python}"
else
  python="${PYTHON:-python3}"
  # The machine's torch: its lib folder first on the search path, before the runner's RUNPATH
  # (the build machine's folder, absent here). Its CUDA libraries are found through its own RPATH.
  lib=$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
mkdir -p "$out"
PYTHONUNBUFFERED=1 exec "$python" "$root/scripts/gpu_check.py" --runner "$runner" --out "$out" "${args[@]}"
