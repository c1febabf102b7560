#!/usr/bin/env bash
# Fetches what building `runner` needs, from the package registries only, into .deps/ (git-ignored):
#   - libtorch 2.13.0: torch/lib + torch/include from PyPI's torch==2.13.0 wheel, CPU libraries only
#     (with libtorch_cuda.so present, tch would link CUDA and the binary would not load without a GPU);
#   - libcudart.so.13 and libcupti.so.13, which libtorch_cpu.so needs at load time even on CPU;
#   - gloo headers (Debian's libgloo-dev, unpacked, not installed): c10d's ProcessGroupGloo.hpp includes them.
# Idempotent: when everything is present it only checks a few files.
# A LIBTORCH already set by the user is honoured (it must contain lib/libtorch_cpu.so).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
deps="$root/.deps"
torch_version=2.13.0
cudart="nvidia-cuda-runtime==13.0.96"
cupti="nvidia-cuda-cupti==13.0.85"

die() {
  printf 'setup: %s\n' "$1" >&2
  shift
  for line in "$@"; do printf '       %s\n' "$line" >&2; done
  exit 1
}

libtorch_ok() { [ -f "$1/lib/libtorch_cpu.so" ] && [ -f "$1/lib/libcudart.so.13" ] && [ -d "$1/include/torch" ]; }

need_pip() {
  python3 -m pip --version >/dev/null 2>&1 || die "python3 with pip is needed to fetch libtorch from PyPI." \
    "Install it (Debian: apt-get install python3-pip), or download libtorch $torch_version yourself" \
    "and point LIBTORCH at it (the folder holding lib/libtorch_cpu.so and include/)."
}

# A wheel is a zip: take the members under $2 (a prefix), flattened into $3, skipping names matching $4.
unzip_prefix() {
  python3 - "$@" <<'PY'
import os, re, shutil, sys, zipfile
wheel, prefix, dest, skip = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
skip_re = re.compile(skip) if skip else None
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        name = info.filename
        if not name.startswith(prefix) or name.endswith('/'):
            continue
        rel = name[len(prefix):]
        if skip_re and skip_re.search(rel):
            continue
        out = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with z.open(info) as src, open(out + '.part', 'wb') as dst:
            shutil.copyfileobj(src, dst)
        os.chmod(out + '.part', 0o755 if rel.endswith('.so') or '.so.' in rel else 0o644)
        os.replace(out + '.part', out)
PY
}

fetch_libtorch() {
  local dest="$deps/libtorch" wheels="$deps/wheels"
  need_pip
  mkdir -p "$wheels"
  echo "setup: downloading torch==$torch_version (about 530 MB, once) and the CUDA runtime wheels from PyPI"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$wheels" \
    "torch==$torch_version" "$cudart" "$cupti" \
    || die "pip could not download torch==$torch_version from PyPI (see the message above)." \
      "Check that PyPI is reachable, or set LIBTORCH to an existing libtorch $torch_version."
  rm -rf "$dest.tmp"
  mkdir -p "$dest.tmp/lib" "$dest.tmp/include"
  local torch_wheel
  torch_wheel=$(ls "$wheels"/torch-"$torch_version"-*.whl | head -n 1)
  echo "setup: unpacking libtorch (CPU libraries and headers)"
  unzip_prefix "$torch_wheel" torch/lib/ "$dest.tmp/lib" '(cuda|nvrtc|nvshmem|python|/)'
  unzip_prefix "$torch_wheel" torch/include/ "$dest.tmp/include" ''
  unzip_prefix "$(ls "$wheels"/nvidia_cuda_runtime-*.whl | head -n 1)" nvidia/cu13/lib/ "$dest.tmp/lib" '^(?!libcudart\.so\.13$)'
  unzip_prefix "$(ls "$wheels"/nvidia_cuda_cupti-*.whl | head -n 1)" nvidia/cu13/lib/ "$dest.tmp/lib" '^(?!libcupti\.so\.13$)'
  echo "$torch_version" >"$dest.tmp/build-version"
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
  rm -rf "$wheels"
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
