#!/usr/bin/env bash
# Fetches what building `runner` needs, from the package registries only, into .deps/ (git-ignored):
#   - libtorch 2.13.0: torch/lib + torch/include from PyPI's torch==2.13.0 wheel, CPU libraries only
#     (with libtorch_cuda.so present, tch would link CUDA and the binary would not load without a GPU);
#   - libcudart.so.13 and libcupti.so.13, which libtorch_cpu.so needs at load time even on CPU;
#   - gloo headers (Debian's libgloo-dev, unpacked, not installed): c10d's ProcessGroupGloo.hpp includes them.
# Idempotent: when everything is present it only checks a few files.
# A LIBTORCH already set by the user is honoured (it must contain lib/libtorch_cpu.so).
#
# scripts/setup.sh --tests also installs what the test suite runs beside the runner (see the end of
# this file): the Python reference environment (.deps/reference: torch 2.13.0, the same libtorch)
# with the packages of scripts/test-requirements.txt (torchvision, TensorBoard's reader, MLflow),
# and, through scripts/setup-slurm.sh, Debian's slurm-wlm and munge for the Slurm tests (as root).
#
# scripts/setup.sh --cuda also fetches what `cargo build --features cuda` compiles and links against
# (see the end of this file): the CUDA libtorch in .deps/libtorch-cuda, and the CUDA and NCCL headers
# in .deps/cuda/include. The torch wheel is kept in .deps/wheels (or $RUNNER_WHEELS) so that the two
# setups download it once. --cuda-runtime adds the CUDA libraries the CUDA build loads when it runs.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
deps="$root/.deps"
wheels="${RUNNER_WHEELS:-$deps/wheels}"
torch_version=2.13.0
cudart="nvidia-cuda-runtime==13.0.96"
cupti="nvidia-cuda-cupti==13.0.85"

cuda=0 runtime=0 tests=0
for arg in "$@"; do
  case "$arg" in
    --tests) tests=1 ;;
    --cuda) cuda=1 ;;
    --cuda-runtime) cuda=1 runtime=1 ;;
    -h | --help)
      echo "usage: scripts/setup.sh [--tests] [--cuda | --cuda-runtime]"
      echo "  with --tests, also the test suite's Python environment (.deps/reference) and tools"
      echo "  fetches libtorch $torch_version and the gloo headers into .deps/; with --cuda, also the CUDA"
      echo "  libtorch and the CUDA and NCCL headers that 'cargo build --features cuda' needs; with"
      echo "  --cuda-runtime, also the CUDA libraries that the CUDA build loads when it runs (about 2 GB)"
      exit 0
      ;;
    *)
      printf 'setup: unknown argument %s (usage: scripts/setup.sh [--tests] [--cuda | --cuda-runtime])\n' "$arg" >&2
      exit 2
      ;;
  esac
done

# die, need_pip, unzip_prefix, download_to, download, wheel, fetch_cuda_headers.
me=setup
# shellcheck source=scripts/deps.sh
source "$root/scripts/deps.sh"

libtorch_ok() { [ -f "$1/lib/libtorch_cpu.so" ] && [ -f "$1/lib/libcudart.so.13" ] && [ -d "$1/include/torch" ]; }

# libtorch from the torch wheel into $1: with $2 = cpu, without the CUDA libraries (with
# libtorch_cuda.so present, tch would link CUDA and the binary would not load without a GPU);
# with $2 = cuda, with them (less the Python bindings).
unpack_libtorch() {
  local dest=$1 kind=$2 skip='(python|/)'
  [ "$kind" = cpu ] && skip='(cuda|nvrtc|nvshmem|python|/)'
  rm -rf "$dest.tmp"
  mkdir -p "$dest.tmp/lib" "$dest.tmp/include"
  echo "setup: unpacking libtorch ($kind libraries and headers) into ${dest#"$root"/}"
  unzip_prefix "$(wheel "torch-$torch_version")" torch/lib/ "$dest.tmp/lib" "$skip"
  unzip_prefix "$(wheel "torch-$torch_version")" torch/include/ "$dest.tmp/include" ''
  unzip_prefix "$(wheel nvidia_cuda_runtime)" nvidia/cu13/lib/ "$dest.tmp/lib" '^(?!libcudart\.so\.13$)'
  unzip_prefix "$(wheel nvidia_cuda_cupti)" nvidia/cu13/lib/ "$dest.tmp/lib" '^(?!libcupti\.so\.13$)'
  echo "$torch_version" >"$dest.tmp/build-version"
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
}

fetch_libtorch() {
  echo "setup: downloading torch==$torch_version (about 530 MB, once) and the CUDA runtime wheels from PyPI"
  download "torch==$torch_version" "$cudart" "$cupti"
  unpack_libtorch "$deps/libtorch" cpu
}

fetch_gloo_headers() {
  local dest="$deps/gloo"
  command -v apt-get >/dev/null && command -v dpkg >/dev/null \
    || die "apt-get and dpkg are needed to fetch the gloo headers (Debian package libgloo-dev)." \
      "On another system, install gloo's headers so that /usr/include/gloo/config.h exists."
  local work
  work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  if ! (cd "$work" && apt-get download libgloo-dev >/dev/null 2>&1); then
    [ "$(id -u)" = 0 ] || die "the package list does not know libgloo-dev, and refreshing it needs root." \
      "Run as root, or run 'sudo apt-get update' once and then this script again," \
      "or install the headers yourself: sudo apt-get install libgloo-dev"
    echo "setup: refreshing the apt package lists"
    apt-get update -qq >/dev/null || die "apt-get update failed (see above)."
    (cd "$work" && apt-get download libgloo-dev >/dev/null 2>&1) \
      || die "apt-get could not download libgloo-dev." "Install it by hand: apt-get install libgloo-dev"
  fi
  rm -rf "$dest.tmp"
  dpkg -x "$work"/libgloo-dev_*.deb "$dest.tmp"
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
}

if [ -n "${LIBTORCH:-}" ]; then
  [ -f "$LIBTORCH/lib/libtorch_cpu.so" ] || die "LIBTORCH=$LIBTORCH has no lib/libtorch_cpu.so." \
    "Unset LIBTORCH to let this script fetch libtorch $torch_version into .deps/, or fix the path."
elif ! libtorch_ok "$deps/libtorch"; then
  fetch_libtorch
fi

if [ ! -f "$deps/gloo/usr/include/gloo/config.h" ] && [ ! -f /usr/include/gloo/config.h ]; then
  fetch_gloo_headers
fi

# --- scripts/setup.sh --tests ------------------------------------------------------------------
# The reference environment (torch 2.13.0 from PyPI, as `runner bench` uses it) plus the test-only
# packages pinned in scripts/test-requirements.txt. A stamp of that file skips pip when nothing changed.
if [ "$tests" = 1 ]; then
  python=$("$root/benches/reference/setup.sh")
  reqs="$root/scripts/test-requirements.txt"
  stamp="$(dirname "$(dirname "$python")")/.test-requirements"
  if ! cmp -s "$reqs" "$stamp"; then
    echo "setup: installing the test packages of scripts/test-requirements.txt into ${python%/bin/python}"
    "$python" -m pip install --quiet --disable-pip-version-check --no-cache-dir -r "$reqs" \
      || die "pip could not install scripts/test-requirements.txt (see the message above)."
    cp "$reqs" "$stamp"
  fi
  "$root/scripts/setup-slurm.sh"
fi

[ "$cuda" = 1 ] || exit 0

# --- scripts/setup.sh --cuda -------------------------------------------------------------------
# What `cargo build --features cuda` compiles and links against, with versions from torch 2.13.0's
# Requires-Dist (cuda-toolkit 13.0.3, nvidia-nccl-cu13 2.29.7):
#   .deps/libtorch-cuda  the torch wheel's lib (libtorch_cuda.so, libc10_cuda.so, ...) and include;
#   .deps/cuda/include   the CUDA runtime headers and those that c10d's ProcessGroupNCCL.hpp pulls in
#                        through ATen/cuda/CUDAContext.h (cuBLAS, cuSPARSE, cuSOLVER, CCCL's nv/target),
#                        and nccl.h.
# Only headers are taken from the nvidia-* wheels, whose wheels are then deleted: the link does not
# need CUDA's libraries (build.rs links with --allow-shlib-undefined). A machine that RUNS the CUDA
# build needs them, as torch does: see docs/gpus.md.
cuda_headers=(
  "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-crt==13.0.88" "nvidia-cuda-cccl==13.0.85"
  "nvidia-cublas==13.1.1.3" "nvidia-cusparse==12.6.3.3" "nvidia-cusolver==12.0.4.66"
  "nvidia-nccl-cu13==2.29.7"
)
cuda_stamp="$torch_version ${cuda_headers[*]}"

if [ -n "${LIBTORCH:-}" ] && [ -f "$LIBTORCH/lib/libtorch_cuda.so" ]; then
  :
elif [ ! -f "$deps/libtorch-cuda/lib/libtorch_cuda.so" ] || [ ! -f "$deps/libtorch-cuda/lib/libcudart.so.13" ]; then
  echo "setup: downloading torch==$torch_version (kept in ${wheels#"$root"/}: skipped when already there)"
  download "torch==$torch_version" "$cudart" "$cupti"
  unpack_libtorch "$deps/libtorch-cuda" cuda
fi

fetch_cuda_headers "$deps/cuda" "$cuda_stamp" "${cuda_headers[@]}"

[ "$runtime" = 1 ] || exit 0

# --- scripts/setup.sh --cuda-runtime ------------------------------------------------------------
# The libraries libtorch_cuda.so loads, from the nvidia-* wheels torch 2.13.0 requires, unpacked as
# pip lays them out beside torch: libtorch_cuda.so's own RPATH ($ORIGIN/../../nvidia/*/lib) finds
# them in .deps/nvidia from .deps/libtorch-cuda/lib. What pip install torch would bring, less
# Python; the NVIDIA driver (libcuda.so.1) is the machine's.
cuda_runtime=(
  "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cupti==13.0.85" "nvidia-cuda-nvrtc==13.0.88"
  "nvidia-cublas==13.1.1.3" "nvidia-cufft==12.0.0.61" "nvidia-cufile==1.15.1.6" "nvidia-curand==10.4.0.35"
  "nvidia-cusolver==12.0.4.66" "nvidia-cusparse==12.6.3.3" "nvidia-nvjitlink==13.0.88"
  "nvidia-cudnn-cu13==9.20.0.48" "nvidia-cusparselt-cu13==0.8.1" "nvidia-nccl-cu13==2.29.7"
  "nvidia-nvshmem-cu13==3.4.5"
)
if [ "$(cat "$deps/nvidia/versions" 2>/dev/null)" != "${cuda_runtime[*]}" ]; then
  dest="$deps/nvidia"
  tmp=$(mktemp -d "$deps/cuda-runtime-wheels.XXXXXX")
  echo "setup: downloading the CUDA libraries torch $torch_version loads (about 2 GB, 2.7 GB unpacked)"
  download_to "$tmp" "${cuda_runtime[@]}" \
    || { rm -rf "$tmp"; die "pip could not download the CUDA library wheels (see the message above)."; }
  rm -rf "$dest.tmp"
  mkdir -p "$dest.tmp"
  for w in "$tmp"/*.whl; do unzip_prefix "$w" nvidia/ "$dest.tmp" '(^|/)(include|bin)/|\.a$|__init__'; done
  rm -rf "$tmp"
  echo "${cuda_runtime[*]}" >"$dest.tmp/versions"
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
fi
