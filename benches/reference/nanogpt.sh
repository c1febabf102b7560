#!/usr/bin/env bash
# The runner against karpathy/nanoGPT's own train.py, side by side on the same files and recipe:
# nanoGPT's baby-GPT CPU recipe (pipelines/shakespeare_char.toml, key for key), alternating
# nanoGPT and the runner at each world size, the same threads. nanoGPT is a fetched copy
# outside this repository (git clone https://github.com/karpathy/nanoGPT), run as it is.
#
#   scripts/shakespeare.sh                                   # data/shakespeare_char
#   benches/reference/nanogpt.sh NANOGPT_DIR [ITERS=2000] [WORLD_SIZES="1 2"]   # "1 1 2": world size 1 twice
#   VARIANTS=native benches/reference/nanogpt.sh ...     # the runner's native run only
#
# nanoGPT's train.py runs from a copy made in the work folder with three lines changed, because
# under DDP it assumes CUDA: `device = f'cuda:{ddp_local_rank}'` becomes `device = 'cpu'`,
# `torch.cuda.set_device(device)` goes, and `DDP(model, device_ids=[ddp_local_rank])` becomes
# `DDP(model)` (device_ids is for GPU modules only). Without DDP none of the three lines runs, so at
# world size 1 the copy is train.py as it is. model.py and the configs are nanoGPT's own, linked.
#
# The runner runs twice: as it runs by default (run.numerics = "native": MKL's kernels for this CPU,
# as nanoGPT computes) and with run.numerics = "portable" (the same bits on any x86-64 CPU:
# docs/reproducibility.md), so that the cost of portability shows beside the comparison.
#
# nanoGPT runs with --always_save_checkpoint=True (its checkpoint after the last evaluation, so
# both final models can be compared) and, at world size W > 1, under torchrun with
# --backend=gloo --gradient_accumulation_steps=W (train.py divides the accumulation by the world
# size: 12 windows per rank per step, as the runner's batch_size = 12 per rank). Prints per run:
# wall time, training tokens per second end to end (steps × tokens per step / wall time), and the
# final validation loss each reports (nanoGPT: 20 fresh random batches; the runner: its 20 fixed
# batches); then both final models on the same 200 validation batches through nanoGPT's model.py
# (nanogpt_eval.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
NANOGPT=$(realpath "$1")
ITERS=${2:-2000}
WORLDS=${3:-"1 2"}
PY=${PYTHON:-$PWD/.deps/reference/bin/python}
RUNNER=${RUNNER:-target/release/runner}
[ -x "$RUNNER" ] || RUNNER=target/debug/runner
CORES=$(nproc)
DATA=$(realpath data/shakespeare_char)
[ -f "$DATA/train.bin" ] || { echo "no $DATA/train.bin: run scripts/shakespeare.sh first" >&2; exit 1; }

work=$(mktemp -d)
mkdir -p "$work/data/shakespeare_char"
ln -s "$DATA/train.bin" "$DATA/val.bin" "$work/data/shakespeare_char/"
ln -s "$NANOGPT/config" "$NANOGPT/configurator.py" "$NANOGPT/model.py" "$work/"
sed -e "s/device = f'cuda:{ddp_local_rank}'/device = 'cpu'/" -e '/torch.cuda.set_device(device)/d' \
    -e 's/DDP(model, device_ids=\[ddp_local_rank\])/DDP(model)/' "$NANOGPT/train.py" > "$work/train.py"
[ "$(diff "$NANOGPT/train.py" "$work/train.py" | grep -c '^<')" = 3 ] \
    || { echo "nanoGPT's train.py changed: the three CPU-DDP edits did not all apply" >&2; exit 1; }
"$PY" -c "import json, pickle, sys; m = json.load(open(sys.argv[1])); m['itos'] = {int(k): v for k, v in m['itos'].items()}; pickle.dump(m, open(sys.argv[2], 'wb'))" \
    "$DATA/meta.json" "$work/data/shakespeare_char/meta.pkl"
echo "nanoGPT $(git -C "$NANOGPT" rev-parse --short HEAD 2>/dev/null || echo '(no git)'), torch $("$PY" -c 'import torch; print(torch.__version__)'), runner $RUNNER, $CORES cores, $ITERS steps"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"

# A short run (ITERS below 250) evaluates and saves at its end: eval_interval = ITERS on both sides.
# and warms up over a tenth of its steps (the recipe's 100 from 1000 steps on).
every=$(( ITERS < 250 ? ITERS : 250 ))
warmup=$(( ITERS < 1000 ? ITERS / 10 : 100 ))
recipe="--eval_interval=$every --warmup_iters=$warmup --device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4
 --n_head=4 --n_embd=128 --max_iters=$ITERS --lr_decay_iters=$ITERS --dropout=0.0 --always_save_checkpoint=True"

n=0
for w in $WORLDS; do
    # A world size may repeat ("1 1 2"): each run has its own folders.
    n=$((n + 1))
    threads=$(( CORES / w > 0 ? CORES / w : 1 ))
    tokens=$(( ITERS * 12 * 64 * w ))
    # nanoGPT
    start=$(date +%s.%N)
    if [ "$w" = 1 ]; then
        (cd "$work" && env -u MKL_CBWR OMP_NUM_THREADS=$threads "$PY" train.py config/train_shakespeare_char.py $recipe \
            --out_dir="$work/nanogpt-$n") > "$work/nanogpt-$n.log" 2>&1
    else
        (cd "$work" && env -u MKL_CBWR OMP_NUM_THREADS=$threads "$PY" -m torch.distributed.run --standalone --nproc_per_node="$w" \
            train.py config/train_shakespeare_char.py $recipe --backend=gloo \
            --gradient_accumulation_steps="$w" --out_dir="$work/nanogpt-$n") > "$work/nanogpt-$n.log" 2>&1
    fi
    nano_s=$(echo "$(date +%s.%N) - $start" | bc)
    nano_val=$(grep -o "step $ITERS: train loss [0-9.]*, val loss [0-9.]*" "$work/nanogpt-$n.log" | grep -o "[0-9.]*$")
    echo "world size $w ($threads thread(s) per rank, $(( 12 * 64 * w )) tokens per step):"
    printf "  nanoGPT            wall %6.1f s  %6.0f tokens/s  val loss %s (20 random batches)\n" "$nano_s" "$(echo "$tokens / $nano_s" | bc -l)" "$nano_val"
    # the runner with MKL's kernels for this CPU (its default numerics), then portable
    for variant in ${VARIANTS:-native portable}; do
        out="$work/runner-$variant-$n"
        start=$(date +%s.%N)
        env -u MKL_CBWR "$RUNNER" run pipelines/shakespeare_char.toml --out "$out" --set run.numerics="\"$variant\"" --set run.world_size="$w" \
            --set run.threads_per_rank="$threads" --set train.steps="$ITERS" --set train.schedule.decay_end="$ITERS" \
            --set validate.every_steps="$every" --set train.schedule.warmup_steps="$warmup" > "$out.log" 2>&1
        runner_s=$(echo "$(date +%s.%N) - $start" | bc)
        runner_val=$("$PY" -c "import pyarrow.parquet as pq, sys; t = pq.read_table(sys.argv[1]).to_pandas(); print(f\"{t[t['rank'] == 0]['val_loss'].dropna().iloc[-1]:.4f}\")" "$out/trace.parquet" 2>/dev/null \
            || grep -o "val loss [0-9.]*" "$out.log" | tail -1 | grep -o "[0-9.]*$")
        printf "  runner (%-8s)  wall %6.1f s  %6.0f tokens/s  val loss %s (20 fixed batches)\n" "$variant" "$runner_s" "$(echo "$tokens / $runner_s" | bc -l)" "$runner_val"
        printf "  runner (%s) / nanoGPT: %.2fx tokens/s, %.2fx wall time\n" "$variant" "$(echo "$nano_s / $runner_s" | bc -l)" "$(echo "$runner_s / $nano_s" | bc -l)"
        "$PY" benches/reference/nanogpt_eval.py "$NANOGPT" "$DATA/val.bin" "$work/nanogpt-$n/ckpt.pt" \
            "$out/model.safetensors" | grep -v "^number of parameters" | sed "s/^runner/runner ($variant)/; s/^/  same 200 batches: /"
    done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "logs: $work"
