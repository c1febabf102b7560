#!/usr/bin/env bash
# Issue 54's target: on a Llama of about 100M parameters (made by scripts/tiny_llama.py, random
# weights, nothing downloaded), LoRA of rank 8 on q_proj and v_proj against full fine-tuning, the
# same data, batch and steps at one rank: each one's peak resident memory and training tokens/s
# (the trace's peak_rss_bytes and tokens_per_s, the first interval left out), the CPU seconds each
# whole run took (user + system: on a machine shared with other work, wall-clock rates drift with
# the load, CPU time much less; THREADS=1, the default, keeps OpenMP's spinning threads out of
# it), and their ratios.
# Results: docs/benchmarks.md.
#
#   benches/reference/lora_target.sh [WORK_DIR]    # from the repository's root
#
# RUNNER (default target/release/runner) and PYTHON (default .deps/reference/bin/python, with
# torch, transformers and pandas) name the tools.
set -euo pipefail
runner=${RUNNER:-target/release/runner}
python=${PYTHON:-.deps/reference/bin/python}
work=${1:-/tmp/lora-target}
mkdir -p "$work"
[ -d "$work/data" ] ||
  "$runner" prepare text pipelines/data/tempest.txt --out "$work/data" --tokenizer bpe --vocab 512
[ -d "$work/llama-100m" ] ||
  "$python" scripts/tiny_llama.py make --vocab 512 --d-model 1024 --heads 16 --kv-heads 16 \
    --hidden 2816 --layers 8 --positions 256 --out "$work/llama-100m"
cat > "$work/full.toml" <<TOML
[run]
name = "full"
world_size = 1
threads_per_rank = ${THREADS:-1}

[load]
source = "tokens"
path = "data/train.bin"
validation_path = "data/val.bin"
sampling = "random"

[normalize]
method = "none"

[wrap]
strategy = "none"
init = "llama-100m"

[wrap.model]
kind = "transformer"
seq_len = 128

[train]
steps = ${STEPS:-12}
batch_size = 4
optimizer = "adamw"
lr = 1e-4

[validate]
every_steps = ${EVERY:-4}
batches = 1
TOML
cat > "$work/lora.toml" <<TOML
extends = "full.toml"

[run]
name = "lora"

[wrap.lora]
rank = 8
alpha = 16
targets = ["q_proj", "v_proj"]
TOML
for kind in full lora; do
  rm -rf "${work:?}/$kind"
  /usr/bin/time -f "%U %S" -o "$work/$kind.time" "$runner" run "$work/$kind.toml" --out "$work/$kind" > "$work/$kind.log" 2>&1
done
"$python" - "$work" <<'PY'
import sys
import pandas as pd
work = sys.argv[1]
got = {}
for kind in ["full", "lora"]:
    t = pd.read_parquet(f"{work}/{kind}/trace.parquet")
    t = t[t["rank"] == 0]
    cpu = sum(float(x) for x in open(f"{work}/{kind}.time").read().split()[-2:])
    got[kind] = (t["peak_rss_bytes"].max() / 2**20, t["tokens_per_s"].iloc[1:].mean(), cpu)
    print(f"{kind}: peak {got[kind][0]:.0f} MiB, {got[kind][1]:.0f} tokens/s, {cpu:.1f} CPU s")
full, lora = got["full"], got["lora"]
print(f"lora / full: peak memory {lora[0] / full[0]:.2f}x, tokens/s {lora[1] / full[1]:.2f}x, "
      f"CPU time {lora[2] / full[2]:.2f}x (tokens per CPU second {full[2] / lora[2]:.2f}x)")
PY
