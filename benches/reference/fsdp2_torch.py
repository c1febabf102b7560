"""The runner's transformer language model under PyTorch's own FSDP2: the side-by-side peer of
`wrap.strategy = "fsdp"` (the runner's sharded data parallelism).

    torchrun --standalone --nproc_per_node=W fsdp2_torch.py FILE --rows R
        --vocab 256 --d-model 64 --heads 4 --layers 2 --seq-len 64 [--tied] [--no-bias]
        --batch B (--steps N | --epochs E) [--row-every K]
        --optimizer adamw --lr LR [--betas B1 B2] [--eps EPS] [--weight-decay WD] [--decay-on matrices]
        [--clip C] [--schedule cosine --warmup-steps W --min-lr M [--decay-end D]]
        [--reshard-after-forward true|false] [--precision bf16] --seed S --threads T
        (--init INIT | --init-out INIT.npz) [--out RESULT.json]

FILE is a token stream as the runner reads it (src/data/tokens.rs): a text file read as bytes
(`load.source = "text"`), a 1-D .npy array of integer ids or a .bin file of little-endian uint16
ids (nanoGPT's, `load.source = "tokens"`), memory-mapped, never loaded. Window i starts at token
i * seq_len and holds seq_len + 1 tokens; the first R windows are the training rows (the runner's
training windows: its `load.rows` less the windows `validate.rows` holds out at the end). A batch
reads its windows where they lie, as nanoGPT's get_batch.

The data order is the runner's: DistributedSampler semantics over the training windows (the
runner's per-epoch permutation, from its SplitMix64 generator in transformer_torch.py, padded by
repeating its start, rank r taking positions r, r+W, ...), each rank's epoch cut into batches of B
(the last one short), one optimizer step per batch; `--steps N` runs on across epochs as the
runner's `train.steps` does. The model is transformer_torch.py's (the twin checked against the
runner's on its own), its initial weights read from INIT (.npz or .safetensors under the runner's
names: the file the runner reads as `wrap.init`) or drawn from torch.manual_seed(seed) and written
to INIT.npz by rank 0. The optimizer recipe is the runner's: torch.optim.AdamW / Adam (fused,
as the runner's) or SGD, weight decay on every parameter or only on matrices (a second param
group, as nanoGPT), the gradients clipped to a global L2 norm, and the learning rate of step s
(0-based) set before it from the runner's schedule (src/plan/schedule.rs).

Sharding is what torchtitan's apply_fsdp does: `fully_shard` on each block, then on the root,
whose unit holds the token and position embeddings, the final norm and the head (one unit, as
torchtitan's). Every rank keeps a padded dim-0 shard of each parameter, gradient and Adam moment;
a unit's parameters are all-gathered before its forward and its backward, its gradients
reduce-scattered (averaged) when its backward ends. `--reshard-after-forward true` (ZeRO-3, the
default) frees a block's gathered parameters after its forward, except the last block's, whose
backward comes at once, and the root's (FSDP2's and torchtitan's defaults); `false` (ZeRO-2)
keeps every unit's from forward to backward. `--precision bf16` is FSDP2's mixed precision
(torchtitan's): parameters gathered and computed in bfloat16, float32 shards, gradients reduced
in float32; the loss in float32. On CPU the collectives are gloo's: its reduce-scatter is an
all-reduce followed by a slice.

A row ends every K optimizer steps (default: every epoch) and after the last, as the runner's
trace rows: `row R step S epoch E loss L tokens/s T s SECONDS` with the mean per-window training loss
over every rank's real (not padding) windows of the interval, and tokens per second of all
ranks over the slowest rank's interval time. At the end each rank's peak resident memory
(VmHWM) is printed as `rank R peak resident MiB M`. RESULT.json holds the same: the rows (with
samples and seconds), `peak_rss_bytes` per rank, the world size, threads and units.

tp_torch.py (DTensor's tensor parallelism) takes the same command line and trains through the same
`train`, with its own Layout: which ranks read which shard of the data, and how gradients are clipped.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from transformer_torch import Transformer, decay_groups, per_sample_loss, permutation


def token_stream(path, source):
    """The file's token ids, memory-mapped, as the runner reads `load.source` (text or tokens)."""
    if source == "text":
        return np.memmap(path, dtype=np.uint8, mode="r")
    if path.endswith(".npy"):
        ids = np.load(path, mmap_mode="r")
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise SystemExit(f"fsdp2_torch.py: {path} holds {ids.dtype} of shape {ids.shape}, not 1-D integer ids")
        return ids
    if path.endswith(".bin"):
        return np.memmap(path, dtype="<u2", mode="r")
    raise SystemExit(f"fsdp2_torch.py: {path}: token ids are read from .npy or .bin (uint16) files")


def windows(stream, starts, t):
    """Inputs and targets (int64, n x t) of the windows starting at window indices `starts`."""
    rows = np.stack([stream[i * t : i * t + t + 1] for i in starts]).astype(np.int64)
    rows = torch.from_numpy(rows)
    return rows[:, :t], rows[:, 1:]


def read_init(path):
    """Every parameter of an initial-weights file (.npz or .safetensors), as float32 tensors."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return {k: v.float() for k, v in load_file(path).items()}
    init = np.load(path)
    return {k: torch.from_numpy(init[k]).float() for k in init.files}


def learning_rate(a, step, total):
    """The runner's schedule (src/plan/schedule.rs): the rate of optimizer step `step` (0-based)."""
    if step < a.warmup_steps:
        return a.lr * (step + 1) / a.warmup_steps
    after = step - a.warmup_steps
    decay_end = total if a.decay_end is None else a.decay_end
    t = min(after / max(decay_end - a.warmup_steps, 1), 1.0)
    if a.schedule == "linear":
        return a.min_lr + (a.lr - a.min_lr) * (1.0 - t)
    if a.schedule == "cosine":
        return a.min_lr + (a.lr - a.min_lr) * 0.5 * (1.0 + np.cos(np.pi * t))
    return a.lr


def peak_resident_bytes():
    """This process's peak resident set (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def shard(model, reshard_after_forward, bf16):
    """torchtitan's apply_fsdp: one unit per block, then the root (embeddings, final norm, head)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy()
    if bf16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        # The last block's backward comes at once: torchtitan keeps it gathered.
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward and i < last, mp_policy=mp)
    # The root keeps its parameters from forward to backward (FSDP2's default for a root).
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    return [f"blocks.{i}" for i in range(last + 1)] + ["root (tok, pos, ln_f, head)"]


def by_mesh(params):
    """`params` in lists of one kind each: plain tensors, or DTensors of one device mesh. A fused
    optimizer kernel takes one kind per call, and takes a param group in one call (tensor
    parallelism leaves the replicated parameters plain)."""
    lists = {}
    for p in params:
        lists.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return list(lists.values())


def arguments():
    """The command line every twin of the runner's language model takes (this script's)."""
    p = argparse.ArgumentParser()
    p.add_argument("file")
    p.add_argument("--source", choices=["text", "tokens"], help="default: tokens for .npy and .bin, else text")
    p.add_argument("--rows", type=int, required=True, help="training windows: the stream's first R")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--d-model", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--tied", action="store_true")
    p.add_argument("--no-bias", action="store_true")
    p.add_argument("--batch", type=int, required=True)
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=int)
    length.add_argument("--epochs", type=int)
    p.add_argument("--row-every", type=int, help="optimizer steps per row; default: an epoch's")
    p.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="adamw")
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.999])
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--decay-on", choices=["all", "matrices"], default="all")
    p.add_argument("--clip", type=float, help="clip the gradients to this global L2 norm")
    p.add_argument("--schedule", choices=["constant", "linear", "cosine"], default="constant")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--min-lr", type=float, default=0.0)
    p.add_argument("--decay-end", type=int)
    p.add_argument("--reshard-after-forward", choices=["true", "false"], default="true")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    init = p.add_mutually_exclusive_group(required=True)
    init.add_argument("--init", help="initial weights under the runner's names (.npz or .safetensors)")
    init.add_argument("--init-out", help="draw the initial weights from --seed and write them here (.npz)")
    p.add_argument("--out", help="RESULT.json")
    return p


class Layout:
    """How a twin spreads the model over its ranks: its units (for the result), which data shard
    this rank reads (`data_rank` of `data_world`), whether its losses count in the rows (one rank
    of each group that computes the same loss), and how the gradients are clipped to a global norm."""

    def __init__(self, units, data_rank, data_world, counts=True, clip=torch.nn.utils.clip_grad_norm_, extra=None):
        self.units, self.data_rank, self.data_world, self.counts, self.clip = units, data_rank, data_world, counts, clip
        self.extra = extra or {}


def main():
    a = arguments().parse_args()
    train(a, lambda model: fsdp2(model, a), "fsdp2_torch.py")


def fsdp2(model, a):
    """FSDP2 over every rank: each rank reads its own shard of the data."""
    units = shard(model, a.reshard_after_forward == "true", a.precision == "bf16")
    extra = {"reshard_after_forward": a.reshard_after_forward == "true", "precision": a.precision}
    return Layout(units, dist.get_rank(), dist.get_world_size(), extra=extra)


def train(a, parallelize, script):
    """Trains the runner's language model as the runner does (the module docstring), the model
    spread over the ranks by `parallelize(model)` (a Layout), from its initial weights."""
    source = a.source or ("tokens" if a.file.endswith((".npy", ".bin")) else "text")

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    t = a.seq_len
    stream = token_stream(a.file, source)
    if len(stream) < a.rows * t + 1:
        raise SystemExit(f"{script}: {a.file} holds {len(stream)} tokens, fewer than {a.rows} windows of {t} + 1")

    torch.manual_seed(a.seed)
    model = Transformer(a.vocab, a.d_model, a.heads, a.layers, t, a.tied, bias=not a.no_bias)
    if a.init:
        model.load_state_dict(read_init(a.init), strict=True)
    elif rank == 0:
        np.savez(a.init_out, **{k: v.detach().numpy() for k, v in model.named_parameters()})
    layout = parallelize(model)
    data_rank, data_world = layout.data_rank, layout.data_world

    params = list(model.parameters())
    groups = [
        dict(group, params=same)
        for group in decay_groups(model, a.decay_on, a.weight_decay)
        for same in by_mesh(group["params"])
    ]
    if a.optimizer == "sgd":
        opt = torch.optim.SGD(groups, lr=a.lr)
    else:
        # fused=True: the fastest Adam torch has on CPU (it takes FSDP2's DTensor shards), and the
        # kernel the runner runs.
        kind = torch.optim.AdamW if a.optimizer == "adamw" else torch.optim.Adam
        opt = kind(groups, lr=a.lr, betas=tuple(a.betas), eps=a.eps, fused=True)

    # The runner's clock (src/stages/train.rs): batches of an epoch's shard, one step each.
    per_rank = -(-a.rows // data_world)
    steps_per_epoch = -(-per_rank // a.batch)
    total = a.steps if a.steps is not None else a.epochs * steps_per_epoch
    row_every = a.row_every or steps_per_epoch

    rows = []
    shard_of = None
    loss_sum = torch.zeros((), dtype=torch.float64)
    samples = torch.zeros((), dtype=torch.float64)
    start = time.perf_counter()
    for step in range(total):
        epoch = step // steps_per_epoch + 1
        if shard_of is None or shard_of[0] != epoch:
            perm = permutation(a.seed, epoch, a.rows)
            padded = perm + perm[: per_rank * data_world - a.rows]
            real = [data_rank + i * data_world < a.rows for i in range(per_rank)]
            weight = torch.tensor([1.0 if r and layout.counts else 0.0 for r in real])
            shard_of = (epoch, padded[data_rank::data_world], weight)
        _, mine, weight = shard_of
        s = (step % steps_per_epoch) * a.batch
        xb, yb = windows(stream, mine[s : s + a.batch], t)
        wb = weight[s : s + a.batch]

        for group in opt.param_groups:
            group["lr"] = learning_rate(a, step, total)
        opt.zero_grad()
        per_sample = per_sample_loss(model(xb).float(), yb)
        per_sample.mean().backward()
        if a.clip is not None:
            layout.clip(params, a.clip)
        opt.step()
        with torch.no_grad():
            loss_sum += (per_sample.double() * wb.double()).sum()
            samples += wb.double().sum()

        done = step + 1
        if done % row_every == 0 or done == total:
            seconds = time.perf_counter() - start
            totals = torch.stack([loss_sum, samples])
            dist.all_reduce(totals)
            slowest = torch.tensor(seconds, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            loss, n = totals.tolist()
            row = {"step": done, "epoch": epoch, "loss": loss / n, "samples": n, "seconds": slowest.item()}
            row["tokens_per_s"] = n * t / row["seconds"]
            rows.append(row)
            if rank == 0:
                print(
                    f"row {len(rows)} step {done} epoch {epoch} loss {row['loss']:.10f} "
                    f"tokens/s {row['tokens_per_s']:.0f} s {row['seconds']:.3f}",
                    flush=True,
                )
            loss_sum.zero_()
            samples.zero_()
            start = time.perf_counter()

    peaks = torch.zeros(world, dtype=torch.float64)
    peaks[rank] = peak_resident_bytes()
    dist.all_reduce(peaks)
    if rank == 0:
        for r, b in enumerate(peaks.tolist()):
            print(f"rank {r} peak resident MiB {b / 2**20:.1f}", flush=True)
        if a.out:
            result = {
                "world_size": world,
                "threads": a.threads,
                "units": layout.units,
                **layout.extra,
                "rows": rows,
                "peak_rss_bytes": [int(b) for b in peaks.tolist()],
            }
            with open(a.out + ".part", "w") as f:
                json.dump(result, f)
            os.replace(a.out + ".part", a.out)
    dist.barrier()
    # Leave without tearing gloo down: its teardown now and then aborts a rank ("terminate called
    # without an active exception"), as ddp_torch.py.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
