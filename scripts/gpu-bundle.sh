#!/usr/bin/env bash
# Builds the bundle that runs on a lent GPU machine as it is (docs/gpus.md): the runner with
# `--features cuda`, against libtorch 2.11.0, the version of that machine's torch
# (2.11.0+cu130). What it builds against comes from PyPI:
#   - the torch==2.11.0 wheel (the +cu130 build, as the machine's), unpacked as pip lays it out
#     into $RUNNER_GPU_DEPS/torch (default .deps/torch-2.11/torch): its headers and the libraries
#     the link names (libtorch_cpu, libtorch_cuda, libc10, libc10_cuda);
#   - the CUDA and NCCL headers of the nvidia-* versions torch 2.11.0 requires (cuda-toolkit 13.0.2,
#     nvidia-nccl-cu13 2.28.9: ProcessGroupNCCL's layout follows NCCL's version macros), headers only.
# The bundle (target/gpu-bundle: runner, BUILD) loads libtorch from the folder that
# LD_LIBRARY_PATH names; scripts/gpu-check.sh finds it from `python3 -c "import torch"` there, so
# the machine's own libtorch_cuda.so and CUDA libraries run it. Nothing of CUDA is bundled.
#
# scripts/gpu-bundle.sh --tests also proves the CPU half here: the same build (same libtorch, same
# features, same release profile) runs the DDP, FSDP and pipeline oracles (tests/integration's
# dist::, fsdp::, pipeline::) and scripts/gpu-check.sh --cpu on this machine's CPU. Loading libtorch_cuda.so needs CUDA's
# libraries even on a CPU: those of the reference environment (scripts/setup.sh --tests) are linked
# in beside torch as pip lays them out ($RUNNER_GPU_DEPS/nvidia); see docs/gpus.md.
#
# Environment: RUNNER_GPU_DEPS (where the 2.11 libtorch and headers go), RUNNER_WHEELS (where the
# torch wheel is kept, shared with scripts/setup.sh), CARGO_TARGET_DIR (default target/gpu).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
deps="$root/.deps"
wheels="${RUNNER_WHEELS:-$deps/wheels}"
gpu="${RUNNER_GPU_DEPS:-$deps/torch-2.11}"
target="${CARGO_TARGET_DIR:-$root/target/gpu}"
bundle="$root/target/gpu-bundle"
torch_version=2.11.0
# torch 2.11.0's Requires-Dist: cuda-toolkit 13.0.2 (its cublas 13.1.0.3; the rest as 13.0.3's),
# nvidia-nccl-cu13 2.28.9.
cuda_headers=(
  "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-crt==13.0.88" "nvidia-cuda-cccl==13.0.85"
  "nvidia-cublas==13.1.0.3" "nvidia-cusparse==12.6.3.3" "nvidia-cusolver==12.0.4.66"
  "nvidia-nccl-cu13==2.28.9"
)
# The oracles of the CPU half: DDP (and the collectives under it), FSDP, the pipeline.
cpu_half=(dist fsdp pipeline)

me=gpu-bundle
# shellcheck source=scripts/deps.sh
source "$root/scripts/deps.sh"

tests=0
for arg in "$@"; do
  case "$arg" in
    --tests) tests=1 ;;
    -h | --help)
      echo "usage: scripts/gpu-bundle.sh [--tests]"
      echo "  builds target/gpu-bundle (the runner and the GPU tests with --features cuda, against"
      echo "  libtorch $torch_version, for the machine's own torch); with --tests, also runs the DDP, FSDP"
      echo "  and pipeline oracles of the same build on this machine's CPU"
      exit 0
      ;;
    *)
      printf 'gpu-bundle: unknown argument %s (usage: scripts/gpu-bundle.sh [--tests])\n' "$arg" >&2
      exit 2
      ;;
  esac
done

say() { echo "gpu-bundle: $*"; }

# --- libtorch 2.11.0 ---------------------------------------------------------------------------
# The wheel's torch/ package less its bin/ (test programs), laid out as pip does: importable by a
# Python that has torch's own dependencies (the check's --cpu mode uses that), and a libtorch for
# tch and build.rs (lib/, include/, and the build-version file they read).
if [ "$(cat "$gpu/torch/build-version" 2>/dev/null)" != "$torch_version" ]; then
  say "downloading torch==$torch_version (about 530 MB, once; kept in ${wheels#"$root"/})"
  download "torch==$torch_version"
  say "unpacking torch $torch_version into ${gpu#"$root"/}/torch (about 1 GB)"
  rm -rf "$gpu/torch.tmp"
  mkdir -p "$gpu/torch.tmp"
  unzip_prefix "$(wheel "torch-$torch_version")" torch/ "$gpu/torch.tmp" '^bin/'
  echo "$torch_version" >"$gpu/torch.tmp/build-version"
  rm -rf "$gpu/torch"
  mv "$gpu/torch.tmp" "$gpu/torch"
fi
fetch_cuda_headers "$gpu/cuda" "$torch_version ${cuda_headers[*]}" "${cuda_headers[@]}"

# tch 0.26 expects libtorch 2.13.0 and checks build-version (bypassed). Its C++ wrappers were
# generated from 2.13's operators: the 15 that call operators 2.11 lacks (or declares otherwise)
# raise "not in this libtorch" in a patched copy of torch-sys (scripts/torch-sys-for.py), used
# through a [patch] on the command line. The runner calls none of them. Cargo.lock is restored
# after the build: the patch is this build's alone.
export LIBTORCH="$gpu/torch" LIBTORCH_BYPASS_VERSION_CHECK=1 CUDA_INCLUDE="$gpu/cuda/include"
export CARGO_TARGET_DIR="$target"
torch_sys=$(cargo metadata --format-version 1 --locked | python3 -c 'import json, os, sys
print(next(os.path.dirname(p["manifest_path"]) for p in json.load(sys.stdin)["packages"] if p["name"] == "torch-sys"))')
patched="$target/torch-sys-$torch_version"
if [ "$(cat "$patched/STUBBED" 2>/dev/null | head -n 1)" != "$torch_sys" ]; then
  mkdir -p "$target"
  stubbed=$(python3 "$root/scripts/torch-sys-for.py" "$torch_sys" "$gpu/torch/include" "$patched")
  printf '%s\n%s\n' "$torch_sys" "$stubbed" >"$patched/STUBBED"
fi
say "torch-sys for libtorch $torch_version: wrappers that raise: $(tail -n 1 "$patched/STUBBED")"
cp "$root/Cargo.lock" "$target/Cargo.lock.kept"
trap 'cp "$target/Cargo.lock.kept" "$root/Cargo.lock"' EXIT
cargo_args=(--release --features cuda --config "patch.crates-io.torch-sys.path=\"$patched\"")

# --- the bundle --------------------------------------------------------------------------------
start=$SECONDS
say "building the runner (release, --features cuda) in ${target#"$root"/}"
cargo build "${cargo_args[@]}" --bin runner
rm -rf "$bundle.tmp"
mkdir -p "$bundle.tmp"
strip -o "$bundle.tmp/runner" "$target/release/runner"
{
  echo "libtorch $torch_version (built against PyPI's torch==$torch_version wheel: $(basename "$(wheel "torch-$torch_version")"))"
  echo "headers ${cuda_headers[*]}"
  echo "commit $(git -C "$root" rev-parse HEAD)$(git -C "$root" diff --quiet HEAD -- src csrc build.rs Cargo.toml Cargo.lock || echo ' (with uncommitted changes)')"
  echo "built $(date -u +%Y-%m-%dT%H:%MZ) on $(uname -n)"
  (cd "$bundle.tmp" && sha256sum runner)
} >"$bundle.tmp/BUILD"
rm -rf "$bundle"
mv "$bundle.tmp" "$bundle"
say "built in $((SECONDS - start)) s: ${bundle#"$root"/} ($(du -sh "$bundle" | cut -f1), for a limit of 64 MiB)"
ls -l "$bundle"

[ "$tests" = 1 ] || exit 0

# --- the CPU half ------------------------------------------------------------------------------
# libtorch_cuda.so loads CUDA's libraries (cuBLAS, cuDNN, NCCL, ...) through its RPATH,
# $ORIGIN/../../nvidia/*/lib, even where no GPU is: the reference environment's, linked in. They
# are torch 2.13.0's (same sonames; NCCL 2.29 and cuDNN 9.20 where 2.11 has 2.28 and 9.19): they
# are loaded, never called, on a CPU. The GPU machine uses its own, beside its torch.
if [ ! -e "$gpu/nvidia" ]; then
  site=$(ls -d "$deps"/reference/lib/python3*/site-packages 2>/dev/null | head -n 1)
  [ -n "$site" ] && [ -d "$site/nvidia/cu13/lib" ] \
    || die "the CPU half needs CUDA's libraries to load libtorch_cuda.so; the reference environment has them." \
      "Run ./scripts/setup.sh --tests once, then this again."
  ln -s "$site/nvidia" "$gpu/nvidia"
fi
start=$SECONDS
say "the CPU half: the ${cpu_half[*]} oracles of tests/integration, the same build, on this machine's CPU"
cargo test "${cargo_args[@]}" --test integration -- "${cpu_half[@]/%/::}"
say "the CPU half: scripts/gpu-check.sh --cpu with the bundle"
OUT="$target/gpu-check-cpu" "$root/scripts/gpu-check.sh" --cpu
say "the CPU half passed in $((SECONDS - start)) s"
