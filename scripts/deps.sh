# Helpers for the scripts that fetch what building `runner` needs from PyPI (scripts/setup.sh,
# scripts/gpu-bundle.sh). Sourced, not run. The sourcing script sets:
#   me             the name its messages start with;
#   root           the repository;
#   deps           the folder of the shared dependencies (.deps: the reference environment);
#   wheels         where downloaded wheels are kept;
#   torch_version  the libtorch it fetches (named in messages).

die() {
  printf '%s: %s\n' "$me" "$1" >&2
  shift
  for line in "$@"; do printf '       %s\n' "$line" >&2; done
  exit 1
}

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

# pip download with three tries: a connection dropped in the middle of a large wheel is not retried
# by pip itself (it ends in a traceback).
download_to() {
  local dir=$1 try
  shift
  for try in 1 2 3; do
    python3 -m pip download --quiet --no-cache-dir --no-deps --only-binary=:all: --retries 10 --timeout 60 \
      --dest "$dir" "$@" && return 0
    echo "$me: pip download failed (try $try of 3; $(df -h --output=avail "$dir" | tail -n 1 | tr -d ' ') free on disk)" >&2
    sleep $((try * 5))
  done
  return 1
}

# Downloads the wheels named into $wheels (pip skips those already there) and prints nothing else.
download() {
  need_pip
  mkdir -p "$wheels"
  download_to "$wheels" "$@" \
    || die "pip could not download $* from PyPI (see the message above)." \
      "Check that PyPI is reachable, or set LIBTORCH to an existing libtorch $torch_version."
}

# The wheel file of a package (its name as a wheel spells it, e.g. nvidia_cuda_runtime).
wheel() { ls "$wheels"/"$1"-*.whl | head -n 1; }

# The CUDA and NCCL headers of the nvidia-* wheels named ("nvidia-nccl-cu13==2.29.7", ...) into
# $1/include, unless $1/versions already holds $2. The headers of the wheels that the reference
# environment (setup.sh --tests) already installed at these versions are copied from it, files as
# its RECORD lists them; only the others are downloaded (into a folder beside $1, deleted once the
# headers are out: these wheels weigh about 1 GB for 24 MB of headers).
fetch_cuda_headers() {
  local dest=$1 stamp=$2 tmp site
  shift 2
  [ "$(cat "$dest/versions" 2>/dev/null)" != "$stamp" ] || return 0
  rm -rf "$dest.tmp"
  mkdir -p "$dest.tmp/include"
  site=$(ls -d "$deps"/reference/lib/python3*/site-packages 2>/dev/null | head -n 1)
  local missing=("$@")
  if [ -n "$site" ]; then
    mapfile -t missing < <(python3 - "$site" "$dest.tmp/include" "$@" <<'PY'
import os, re, shutil, sys
site, dest, wanted = sys.argv[1], sys.argv[2], sys.argv[3:]
for spec in wanted:
    name, version = spec.split("==")
    record = os.path.join(site, f"{re.sub('[-.]', '_', name)}-{version}.dist-info", "RECORD")
    if not os.path.isfile(record):
        print(spec)  # not installed there, or another version: download it
        continue
    for line in open(record):
        path = line.rsplit(",", 2)[0]
        for prefix in ("nvidia/cu13/include/", "nvidia/nccl/include/"):
            if path.startswith(prefix) and not path.endswith("/"):
                out = os.path.join(dest, path[len(prefix):])
                os.makedirs(os.path.dirname(out), exist_ok=True)
                shutil.copyfile(os.path.join(site, path), out)
PY
    )
  fi
  if [ "${#missing[@]}" -gt 0 ]; then
    need_pip
    tmp=$(mktemp -d "$dest.wheels.XXXXXX")
    echo "$me: downloading the header wheels ${missing[*]} (headers only are kept)"
    download_to "$tmp" "${missing[@]}" \
      || { rm -rf "$tmp" "$dest.tmp"; die "pip could not download the CUDA header wheels (see the message above)."; }
    for w in "$tmp"/nvidia_cu*.whl; do [ -e "$w" ] && unzip_prefix "$w" nvidia/cu13/include/ "$dest.tmp/include" ''; done
    for w in "$tmp"/nvidia_nccl_cu13-*.whl; do [ -e "$w" ] && unzip_prefix "$w" nvidia/nccl/include/ "$dest.tmp/include" ''; done
    rm -rf "$tmp"
  fi
  echo "$stamp" >"$dest.tmp/versions"
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
}
