"""The runner's DDP pipeline written in plain PyTorch: the reference `runner bench` measures against.

Launched by `runner bench` as
    torchrun --standalone --nproc_per_node=W ddp_torch.py DATA.npz --init INIT.npz --batch B
        --epochs E --lr LR --threads T --out RESULT.json

DATA.npz is written by the runner: the training rows (the runner's synthetic data) and one row
permutation per epoch (the runner's shuffle, so both walk the rows in the same order). INIT.npz
holds the initial weights (`layer{i}.weight`, `layer{i}.bias`) the runner loads too. Everything
else is what a PyTorch user writes: DistributedSampler semantics (the permutation padded by
repeating its start, rank r taking positions r, r+W, ...), min-max normalisation fitted on the
rank's first-epoch rows, an MLP with ReLU, DDP on gloo, torch.optim.Adam (fused), a DataLoader.
Metrics accumulate on tensors and are read once per epoch, as the runner does.
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
    def __init__(self, widths):
        super().__init__()
        self.layers = len(widths) - 1
        for i in range(self.layers):
            setattr(self, f"layer{i}", nn.Linear(widths[i], widths[i + 1]))

    def forward(self, x):
        h = self.layer0(x)
        for i in range(1, self.layers):
            h = getattr(self, f"layer{i}")(torch.relu(h))
        return h


def main():
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--init", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    a = p.parse_args()
    bf16 = a.precision == "bf16"

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    data = np.load(a.data)
    x = torch.from_numpy(data["train_x"])
    y = torch.from_numpy(data["train_y"])
    permutations = data["permutations"]
    init = np.load(a.init)
    layers = sorted({k.split(".")[0] for k in init.files}, key=lambda k: int(k[len("layer") :]))
    widths = [init[f"{layers[0]}.weight"].shape[1]] + [init[f"{name}.weight"].shape[0] for name in layers]

    dataset = TensorDataset(x, y)
    sampler = PermutationSampler(dataset, permutations)
    # Min-max statistics of this rank's first-epoch rows (padding left out), applied to every row.
    real = range(rank, min(sampler.total_size, len(x)), world)
    rows = x[permutations[0][list(real)]]
    low = rows.amin(0)
    scale = (rows.amax(0) - low).clamp_min(np.finfo(np.float64).eps)
    dataset = TensorDataset((x - low) / scale, y)
    loader = DataLoader(dataset, batch_size=a.batch, sampler=sampler)

    model = Mlp(widths)
    model.load_state_dict({k: torch.from_numpy(init[k]) for k in init.files})
    model = DDP(model)
    # fused=True: the fastest Adam torch has on CPU, and the kernel the runner runs.
    optimizer = torch.optim.Adam(model.parameters(), lr=a.lr, fused=True)

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
            per_sample = F.cross_entropy(logits, yb, reduction="none")
            per_sample.mean().backward()
            optimizer.step()
            with torch.no_grad():
                loss_sum += per_sample.sum(dtype=torch.float64)
                correct += (logits.argmax(-1) == yb).sum(dtype=torch.float64)
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
