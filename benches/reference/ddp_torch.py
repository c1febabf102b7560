"""The runner's DDP pipeline written in plain PyTorch: the reference `runner bench` measures against.

Launched by `runner bench` as
    torchrun --standalone --nproc_per_node=W ddp_torch.py DATA.npz --model MODEL.json --init INIT.npz
        --batch B --epochs E --optimizer adam --lr LR [--weight-decay WD] --threads T --out RESULT.json
        [--precision bf16]

DATA.npz is written by the runner: the training samples (the runner's synthetic rows, images or
token windows) and one sample permutation per epoch (the runner's shuffle, so both walk the samples
in the same order). MODEL.json is the runner's [wrap.model] table (kind "mlp", "cnn" or
"transformer"), the sample's input shape, the outputs and the normalisation. The CNN and the
transformer are the modules of the twins cnn_torch.py and transformer_torch.py (checked against the
runner's on their own), the MLP the one below. INIT.npz holds the initial weights under the runner's
names (batch norm's running statistics included), which the runner loads too. Everything else is
what a PyTorch user writes: DistributedSampler semantics (the permutation padded by repeating its
start, rank r taking positions r, r+W, ...), for the MLP min-max normalisation fitted on the rank's
first-epoch rows, DDP on gloo, torch.optim.Adam or AdamW (fused), a DataLoader. A language model's
sample is a window: its loss is the mean over its positions. Metrics accumulate on tensors and are
read once per epoch, as the runner does.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from cnn_torch import ACT, Cnn
from transformer_torch import Transformer
from transformer_torch import per_sample_loss as window_loss


class PermutationSampler(DistributedSampler):
    """DistributedSampler over a given permutation per epoch (set_epoch takes the 1-based epoch)."""

    def __init__(self, dataset, permutations):
        super().__init__(dataset, shuffle=False)
        self.permutations = permutations

    def __iter__(self):
        indices = self.permutations[self.epoch - 1].tolist()
        indices += indices[: self.total_size - len(indices)]
        return iter(indices[self.rank : self.total_size : self.num_replicas])


class Mlp(nn.Module):
    def __init__(self, widths, activation):
        super().__init__()
        self.layers = len(widths) - 1
        self.act = ACT[activation]
        for i in range(self.layers):
            setattr(self, f"layer{i}", nn.Linear(widths[i], widths[i + 1]))

    def forward(self, x):
        h = self.layer0(x)
        for i in range(1, self.layers):
            h = getattr(self, f"layer{i}")(self.act(h))
        return h


def build(spec):
    """The model of MODEL.json (dropout is not reproduced: the bench's models have none)."""
    m = spec["model"]
    assert m.get("dropout", 0.0) == 0.0 and all(b.get("dropout", 0.0) == 0.0 for b in m.get("conv", []))
    if m["kind"] == "mlp":
        return Mlp([int(np.prod(spec["input"]))] + m["hidden"] + [spec["outputs"]], m["activation"])
    if m["kind"] == "cnn":
        return Cnn(m, spec["input"], spec["outputs"])
    if m["kind"] == "transformer":
        return Transformer(m["vocab"], m["d_model"], m["heads"], m["layers"], m["seq_len"], m["tied"])
    raise SystemExit(f"ddp_torch.py: no model of kind {m['kind']!r}")


def per_sample_loss(logits, y):
    """Cross-entropy per sample; a window's is the mean over its positions."""
    return F.cross_entropy(logits, y, reduction="none") if y.dim() == 1 else window_loss(logits, y)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--model", required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--optimizer", choices=["adam", "adamw"], default="adam")
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    a = p.parse_args()
    bf16 = a.precision == "bf16"

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    with open(a.model) as f:
        spec = json.load(f)
    data = np.load(a.data)
    x = torch.from_numpy(data["train_x"])
    y = torch.from_numpy(data["train_y"])
    permutations = data["permutations"]
    init = np.load(a.init)

    dataset = TensorDataset(x, y)
    sampler = PermutationSampler(dataset, permutations)
    if spec["normalize"] == "minmax":
        # Min-max statistics of this rank's first-epoch rows (padding left out), applied to every row.
        real = range(rank, min(sampler.total_size, len(x)), world)
        rows = x[permutations[0][list(real)]]
        low = rows.amin(0)
        scale = (rows.amax(0) - low).clamp_min(np.finfo(np.float64).eps)
        dataset = TensorDataset((x - low) / scale, y)
    loader = DataLoader(dataset, batch_size=a.batch, sampler=sampler)

    model = build(spec)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(init[k]) for k in init.files}, strict=False)
    # The runner keeps no count of batch norm's batches (nothing here reads it).
    assert not unexpected and all(k.endswith("num_batches_tracked") for k in missing), (missing, unexpected)
    model = DDP(model)
    # fused=True: the fastest Adam torch has on CPU, and the kernel the runner runs.
    kind = torch.optim.Adam if a.optimizer == "adam" else torch.optim.AdamW
    optimizer = kind(model.parameters(), lr=a.lr, weight_decay=a.weight_decay, fused=True)

    epochs = []
    for epoch in range(1, a.epochs + 1):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64)
        correct = torch.zeros((), dtype=torch.float64)
        samples = 0
        for xb, yb in loader:
            optimizer.zero_grad()
            # The forward pass autocast to bfloat16, the loss in float32 (as the runner does).
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(xb)
            logits = logits.float()
            per_sample = per_sample_loss(logits, yb)
            per_sample.mean().backward()
            optimizer.step()
            with torch.no_grad():
                loss_sum += per_sample.sum(dtype=torch.float64)
                right = logits.argmax(-1) == yb
                correct += right.sum(dtype=torch.float64) if right.dim() == 1 else right.double().mean(-1).sum()
            samples += len(yb)
        epoch_s = time.perf_counter() - start
        totals = torch.stack([loss_sum, correct, torch.tensor(float(samples), dtype=torch.float64)])
        dist.all_reduce(totals)
        slowest = torch.tensor(epoch_s, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        loss, acc, n = totals.tolist()
        epochs.append({"epoch": epoch, "loss": loss / n, "acc": acc / n, "samples": n, "epoch_s": slowest.item()})

    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"world_size": world, "threads": a.threads, "epochs": epochs}, f)
    dist.barrier()
    # Leave without tearing gloo down: its teardown now and then aborts a rank ("terminate called
    # without an active exception"), and the runner skips its static destructors too.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
