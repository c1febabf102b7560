"""The runner's `kind = "cnn"` written in plain PyTorch: the twin its per-epoch losses are checked
against (benches/reference/cnn_twin.sh runs both and compares).

    python cnn_torch.py prepare PIPELINE.toml DIR
        reads the pipeline's [wrap.model], [train] and the image shape / classes / rows of [load];
        writes DIR/data.npz (x: N × C × H × W float32, y: int64 labels), DIR/init.npz (the initial
        weights of torch's default initialisation under torch.manual_seed(seed), batch norm's
        running statistics included) and DIR/pipeline.toml: the same model and training over those
        files, for the runner (file order, no normalisation).
    torchrun --standalone --nproc_per_node=W cnn_torch.py train DIR --out RESULT.json [--threads T]
        trains the same model from init.npz on data.npz: DistributedSampler without shuffling,
        DDP on gloo, torch.optim.SGD or Adam as [train] says; writes the per-epoch mean loss.

Blocks are conv{i} (+ bn{i}), linear layers fc{j}, registered in that order, so the module's
parameters (DDP's buckets) and state_dict names are the runner's.
"""

import argparse
import json
import os
import sys
import time
import tomllib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BLOCK = {"channels": 16, "kernel": 3, "stride": 1, "padding": 1, "batch_norm": False, "pool": "none",
         "pool_size": 2, "dropout": 0.0}
ACT = {"relu": torch.relu, "tanh": torch.tanh, "gelu": F.gelu}


class Cnn(nn.Module):
    def __init__(self, model, image, classes):
        super().__init__()
        self.blocks = [dict(BLOCK, **b) for b in model.get("conv", [])]
        self.act = ACT[model.get("activation", "relu")]
        c, h, w = image
        for i, b in enumerate(self.blocks):
            setattr(self, f"conv{i}", nn.Conv2d(c, b["channels"], b["kernel"], b["stride"], b["padding"],
                                                bias=not b["batch_norm"]))
            if b["batch_norm"]:
                setattr(self, f"bn{i}", nn.BatchNorm2d(b["channels"]))
            c = b["channels"]
            h = (h + 2 * b["padding"] - b["kernel"]) // b["stride"] + 1
            w = (w + 2 * b["padding"] - b["kernel"]) // b["stride"] + 1
            if b["pool"] != "none":
                h, w = h // b["pool_size"], w // b["pool_size"]
        widths = [c * h * w] + list(model.get("hidden", [64])) + [classes]
        self.linear = len(widths) - 1
        for j in range(self.linear):
            setattr(self, f"fc{j}", nn.Linear(widths[j], widths[j + 1]))

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            x = getattr(self, f"conv{i}")(x)
            if b["batch_norm"]:
                x = getattr(self, f"bn{i}")(x)
            x = self.act(x)
            if b["pool"] == "max":
                x = F.max_pool2d(x, b["pool_size"])
            elif b["pool"] == "avg":
                x = F.avg_pool2d(x, b["pool_size"])
        x = self.fc0(x.flatten(1))
        for j in range(1, self.linear):
            x = getattr(self, f"fc{j}")(self.act(x))
        return x


def images(n, image, classes, seed, noise):
    """Class templates (random smooth patterns) shifted a little, plus noise."""
    rng = np.random.default_rng(seed)
    c, h, w = image
    yy, xx = np.mgrid[0:h, 0:w]
    templates = np.zeros((classes, c, h, w))
    for k in range(classes):
        for ch in range(c):
            for _ in range(3):
                cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), (0.15 + 0.2 * rng.uniform()) * max(h, w)
                templates[k, ch] += rng.choice([-1.5, 1.5]) * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r))
    y = rng.integers(0, classes, n)
    x = templates[y]
    for i in range(n):
        x[i] = np.roll(x[i], (rng.integers(-(h // 8), h // 8 + 1), rng.integers(-(w // 8), w // 8 + 1)), (1, 2))
    x = x + noise * rng.standard_normal(x.shape)
    return x.astype(np.float32), y.astype(np.int64)


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def prepare(a):
    with open(a.pipeline, "rb") as f:
        p = tomllib.load(f)
    load, model, train, run = p.get("load", {}), p["wrap"]["model"], p.get("train", {}), p.get("run", {})
    image, classes = load["image"], load.get("classes", 2)
    rows, val = load.get("rows", 10000), load.get("validation_rows", 1000)
    seed = run.get("seed", 0)
    os.makedirs(a.dir, exist_ok=True)
    x, y = images(rows + val, image, classes, seed, load.get("noise", 0.5))
    # The training rows and the validation rows in two files (load.validation_path), so both sides
    # train on the same rows in the same order.
    np.savez(os.path.join(a.dir, "data.npz"), x=x[:rows], y=y[:rows])
    np.savez(os.path.join(a.dir, "val.npz"), x=x[rows:], y=y[rows:])
    torch.manual_seed(seed)
    net = Cnn(model, image, classes)
    state = {k: v.numpy() for k, v in net.state_dict().items() if not k.endswith("num_batches_tracked")}
    np.savez(os.path.join(a.dir, "init.npz"), **state)
    out = {
        "run": {"name": "cnn_twin", "seed": seed, "world_size": 1},
        "load": {"source": "tensors", "path": "data.npz", "validation_path": "val.npz"},
        "shard": {"shuffle": False},
        "normalize": {"method": "none"},
        "wrap": {"init": "init.npz"},
        "train": train,
    }
    with open(os.path.join(a.dir, "pipeline.toml"), "w") as f:
        for section, values in out.items():
            f.write(f"[{section}]\n")
            f.writelines(f"{k} = {toml_value(v)}\n" for k, v in values.items())
            f.write("\n")
        f.write("[wrap.model]\n")
        f.writelines(f"{k} = {toml_value(v)}\n" for k, v in model.items())
    with open(os.path.join(a.dir, "twin.json"), "w") as f:
        json.dump({"model": model, "image": image, "classes": classes, "validation_rows": val, "train": train}, f)


def train(a):
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(a.dir, "twin.json")) as f:
        spec = json.load(f)
    t = spec["train"]
    data = np.load(os.path.join(a.dir, "data.npz"))
    x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, batch_size=t.get("batch_size", 32), sampler=sampler)
    model = Cnn(spec["model"], spec["image"], spec["classes"])
    init = np.load(os.path.join(a.dir, "init.npz"))
    model.load_state_dict({k: torch.from_numpy(init[k]) for k in init.files}, strict=False)
    model = model if os.environ.get("TWIN_NO_DDP") else DDP(model)
    lr, opt = t.get("lr", 0.1), t.get("optimizer", "sgd")
    if opt == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=t.get("momentum", 0.0),
                                    weight_decay=t.get("weight_decay", 0.0))
    else:
        # fused=True: the kernel the runner runs (libtorch's _fused_adam_).
        kind = torch.optim.Adam if opt == "adam" else torch.optim.AdamW
        optimizer = kind(model.parameters(), lr=lr, weight_decay=t.get("weight_decay", 0.0), fused=True)
    epochs = []
    for epoch in range(1, t.get("epochs", 5) + 1):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64)
        samples = 0
        for xb, yb in loader:
            optimizer.zero_grad()
            per_sample = F.cross_entropy(model(xb), yb, reduction="none")
            per_sample.mean().backward()
            optimizer.step()
            with torch.no_grad():
                loss_sum += per_sample.sum(dtype=torch.float64)
            samples += len(yb)
        epoch_s = time.perf_counter() - start
        totals = torch.stack([loss_sum, torch.tensor(float(samples), dtype=torch.float64)])
        dist.all_reduce(totals)
        loss, count = totals.tolist()
        epochs.append({"epoch": epoch, "loss": loss / count, "samples": count, "epoch_s": epoch_s})
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"world_size": world, "epochs": epochs}, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("prepare")
    pr.add_argument("pipeline")
    pr.add_argument("dir")
    tr = sub.add_parser("train")
    tr.add_argument("dir")
    tr.add_argument("--out", required=True)
    tr.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    prepare(a) if a.command == "prepare" else train(a)


if __name__ == "__main__":
    main()
