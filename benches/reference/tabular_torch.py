"""The PyTorch twin of a runner run on a csv file: the same rows for training and validation
(the run directory's split.json), the same columns and class ids (preprocessing.json), the same
MLP with the runner's initial distribution (tch's default: weights uniform in ±√(6 / in), biases
in ±1 / √in; `--init torch` for PyTorch's nn.Linear default, ±1 / √in for both), optimizer,
learning rate, epochs and global batch, trained in one process by plain PyTorch (its own random
draws and shuffling), with min-max or standard scaling fitted on the
training rows (scale 1 for constant columns, as scikit-learn's scalers do).

    .deps/reference/bin/python benches/reference/tabular_torch.py RUN_DIR [--seeds 5]

Prints the final validation metrics per seed and their mean: what the same model reaches in
PyTorch, to compare with the run's trace (docs/guide/your-data.md, docs/benchmarks.md).
"""
import argparse
import csv
import json
import math
import os

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--init", choices=["runner", "torch"], default="runner")
    args = ap.parse_args()
    plan = json.load(open(os.path.join(args.run_dir, "plan.json")))
    pre = json.load(open(os.path.join(args.run_dir, "preprocessing.json")))
    split = json.load(open(os.path.join(args.run_dir, "split.json")))
    cfg = plan["config"]
    cols = pre["columns"]
    names = [f["name"] for f in cols["features"]]
    assert all(f["kind"] == "numeric" for f in cols["features"]), "numeric features only"
    with open(split["file"], newline="") as f:
        rows = list(csv.DictReader(f, delimiter=chr(plan["data"]["file"]["delimiter"])))
    x = torch.tensor([[float(r[n]) for n in names] for r in rows], dtype=torch.float32)
    labels = cols["labels"]
    target = cols["target"]
    if labels["kind"] == "classes":
        ids = {n: i for i, n in enumerate(labels["names"])}
        y = torch.tensor([ids[r[target]] for r in rows])
    else:
        y = torch.tensor([float(r[target]) for r in rows], dtype=torch.float32)
    tr, va = torch.tensor(split["train"]), torch.tensor(split["validation"])
    xt, yt, xv, yv = x[tr], y[tr], x[va], y[va]
    method = cfg["normalize"]["method"]
    if method == "minmax":
        off, scale = xt.amin(0), xt.amax(0) - xt.amin(0)
    elif method == "standard":
        off, scale = xt.mean(0), xt.std(0, unbiased=False)
    else:
        off, scale = torch.zeros(x.shape[1]), torch.ones(x.shape[1])
    mag = xt.abs().amax(0)
    scale = torch.where(scale > 10 * torch.finfo(torch.float32).eps * mag, scale, torch.ones_like(scale))
    xt, xv = (xt - off) / scale, (xv - off) / scale
    regression = labels["kind"] == "values"
    if regression:
        mean, std = labels["mean"], labels["std"]
        yt_n = (yt - mean) / std
    model_cfg = cfg["wrap"]["model"]
    train = cfg["train"]
    world = cfg["run"]["world_size"]
    batch = train["batch_size"] * world
    outputs = 1 if regression else len(labels["names"])
    results = []
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        layers, width = [], x.shape[1]
        for h in model_cfg["hidden"]:
            layers += [torch.nn.Linear(width, h), {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh, "gelu": torch.nn.GELU}[model_cfg["activation"]]()]
            width = h
        layers.append(torch.nn.Linear(width, outputs))
        net = torch.nn.Sequential(*layers)
        if args.init == "runner":
            with torch.no_grad():
                for m in net:
                    if isinstance(m, torch.nn.Linear):
                        fan_in = m.weight.shape[1]
                        m.weight.uniform_(-math.sqrt(6 / fan_in), math.sqrt(6 / fan_in))
                        m.bias.uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        opt = {"sgd": lambda p: torch.optim.SGD(p, lr=train["lr"], momentum=train["momentum"], weight_decay=train["weight_decay"]),
               "adam": lambda p: torch.optim.Adam(p, lr=train["lr"], weight_decay=train["weight_decay"]),
               "adamw": lambda p: torch.optim.AdamW(p, lr=train["lr"], weight_decay=train["weight_decay"])}[train["optimizer"]](net.parameters())
        for _ in range(train["epochs"]):
            perm = torch.randperm(len(xt))
            for i in range(0, len(xt), batch):
                idx = perm[i:i + batch]
                out = net(xt[idx])
                loss = torch.nn.functional.mse_loss(out.squeeze(-1), yt_n[idx]) if regression else torch.nn.functional.cross_entropy(out, yt[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        with torch.no_grad():
            out = net(xv)
            if regression:
                err = out.squeeze(-1).double() * std + mean - yv.double()
                rmse = math.sqrt((err ** 2).mean().item())
                r2 = 1 - (err ** 2).mean().item() / ((yv.double() - yv.double().mean()) ** 2).mean().item()
                results.append((rmse, r2))
                print(f"seed {seed}: val rmse {rmse:.4f}  r2 {r2:.4f}")
            else:
                acc = (out.argmax(-1) == yv).double().mean().item()
                results.append((acc,))
                print(f"seed {seed}: val acc {acc:.4f}")
    means = [sum(r[i] for r in results) / len(results) for i in range(len(results[0]))]
    sds = [math.sqrt(sum((r[i] - m) ** 2 for r in results) / max(len(results) - 1, 1)) for i, m in enumerate(means)]
    print("mean: " + "  ".join(f"{m:.4f}" for m in means) + "  sd: " + "  ".join(f"{v:.4f}" for v in sds))


if __name__ == "__main__":
    main()
