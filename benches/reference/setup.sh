#!/usr/bin/env bash
# Installs the PyTorch reference's environment on demand: a virtualenv with torch==2.13.0 (the
# same version as the runner's libtorch, so both run the same kernels) from PyPI, about 5 GB with
# its CUDA wheels, into .deps/reference (git-ignored). Called by `runner bench`; never by the
# tests or the quick start. Prints the environment's python on stdout. Idempotent.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv="${RUNNER_REFERENCE_VENV:-$root/.deps/reference}"
torch_version=2.13.0

if [ -x "$venv/bin/python" ] && [ -x "$venv/bin/torchrun" ] && [ -f "$venv/.complete" ]; then
  echo "$venv/bin/python"
  exit 0
fi
command -v python3 >/dev/null || { echo "bench: python3 is needed for the PyTorch reference" >&2; exit 1; }
echo "bench: installing the PyTorch reference (torch==$torch_version, about 5 GB, once) into $venv" >&2
rm -rf "$venv"
python3 -m venv "$venv" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir "torch==$torch_version" numpy >&2 \
  || { echo "bench: pip could not install torch==$torch_version from PyPI (see above)" >&2; exit 1; }
touch "$venv/.complete"
echo "$venv/bin/python"
