"""The runner's transformer language model written in plain PyTorch: the oracle for
`kind = "transformer"` (src/model/transformer.rs) and `load.source = "text"`.

    torchrun --standalone --nproc_per_node=W transformer_torch.py FILE --rows R --val V
        --vocab 256 --d-model 64 --heads 4 --layers 2 --seq-len 64 [--tied]
        --batch B --epochs E --optimizer adamw --lr LR [--weight-decay WD] --seed S --threads T
        [--no-bias] [--betas B1 B2] [--eps EPS] [--decay-on all|matrices] --init-out INIT.npz

Everything a PyTorch user would write: FILE read as bytes, cut into windows of seq_len + 1
(window i starts at byte i * seq_len; the last V of the first R + V windows are held out),
DistributedSampler semantics over the training windows (the runner's per-epoch permutation,
reproduced here from its SplitMix64 generator, padded by repeating its start, rank r taking
positions r, r+W, ...), the model (pre-norm blocks, F.scaled_dot_product_attention with
is_causal=True, GELU MLP of width 4 * d_model, final LayerNorm, a head tied to the token
embedding or not, with or without biases in its linear layers and layer norms), DDP on gloo,
torch.optim.AdamW / SGD (weight decay on every parameter, or only on those of two or more
dimensions in a second param group, as nanoGPT's configure_optimizers). Rank 0 writes its initial weights
(GPT-2's normal(0, 0.02), drawn from torch.manual_seed(seed)) to INIT.npz under the runner's names before training, so the
runner can start from them with `--set wrap.init=INIT.npz`. Prints one line per epoch:
`epoch E loss L` with the mean per-sample (per-window) training loss over all ranks.
"""

import argparse
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

M64 = (1 << 64) - 1


class Rng:
    """The runner's generator (src/rng.rs): SplitMix64."""

    def __init__(self, seed, stream):
        self.x = (seed ^ ((stream * 0x9E3779B97F4A7C15) & M64)) & M64
        self.next()

    def next(self):
        self.x = (self.x + 0x9E3779B97F4A7C15) & M64
        z = self.x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)

    def below(self, n):
        return (self.next() * n) >> 64

    def permutation(self, n):
        p = list(range(n))
        for i in range(n - 1, 0, -1):
            j = self.below(i + 1)
            p[i], p[j] = p[j], p[i]
        return p


def permutation(seed, epoch, rows):
    """The runner's shuffle of epoch `epoch` (1-based): src/data/shard.rs."""
    return Rng((seed + epoch) & M64, 0x5348415244).permutation(rows)


class Block(nn.Module):
    def __init__(self, d, heads, bias):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d, bias=bias)
        self.qkv = nn.Linear(d, 3 * d, bias=bias)
        self.proj = nn.Linear(d, d, bias=bias)
        self.ln2 = nn.LayerNorm(d, bias=bias)
        self.fc = nn.Linear(d, 4 * d, bias=bias)
        self.out = nn.Linear(4 * d, d, bias=bias)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, -1)
        split = lambda h: h.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab, d, heads, layers, seq_len, tied, bias=True):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads, bias) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, bias=bias)
        self.head = None if tied else nn.Linear(d, vocab, bias=False)
        # GPT-2's initialisation, as the runner's (from torch's generator here).
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x):
        h = self.tok(x) + self.pos.weight[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        h = self.ln_f(h)
        return F.linear(h, self.tok.weight) if self.head is None else self.head(h)


def per_sample_loss(logits, y):
    b, t = y.shape
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none").view(b, t).mean(-1)


def decay_groups(model, decay_on, weight_decay):
    """The optimizer's parameter groups: weight decay on every parameter, or (decay_on ==
    "matrices", nanoGPT's rule) on those of two or more dimensions only."""
    params = list(model.parameters())
    if decay_on != "matrices":
        return [{"params": params, "weight_decay": weight_decay}]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("file")
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--val", type=int, required=True)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--d-model", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--tied", action="store_true")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="adamw")
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--no-bias", action="store_true")
    p.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.999])
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--decay-on", choices=["all", "matrices"], default="all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--init-out", required=True)
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    stream = np.frombuffer(open(a.file, "rb").read(), dtype=np.uint8).astype(np.int64)
    t, n = a.seq_len, a.rows + a.val
    stream = torch.from_numpy(stream[: n * t + 1].copy())
    x_all = stream[: n * t].view(n, t)
    y_all = stream[1 : n * t + 1].view(n, t)
    x, y = x_all[: a.rows], y_all[: a.rows]

    torch.manual_seed(a.seed)
    model = Transformer(a.vocab, a.d_model, a.heads, a.layers, t, a.tied, bias=not a.no_bias)
    if rank == 0:
        np.savez(a.init_out, **{k: v.detach().numpy() for k, v in model.named_parameters()})
    dist.barrier()
    ddp = DDP(model) if world > 1 else model
    groups = decay_groups(model, a.decay_on, a.weight_decay)
    if a.optimizer == "adamw":
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=tuple(a.betas), eps=a.eps)
    else:
        opt = torch.optim.SGD(groups, lr=a.lr)

    per_rank = -(-a.rows // world)
    for epoch in range(1, a.epochs + 1):
        perm = permutation(a.seed, epoch, a.rows)
        padded = perm + perm[: per_rank * world - a.rows]
        mine = padded[rank :: world]
        weight = torch.tensor([1.0 if rank + i * world < a.rows else 0.0 for i in range(per_rank)])
        idx = torch.tensor(mine)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for s in range(0, per_rank, a.batch):
            xb, yb = x[idx[s : s + a.batch]], y[idx[s : s + a.batch]]
            ps = per_sample_loss(ddp(xb), yb)
            opt.zero_grad()
            ps.mean().backward()
            opt.step()
            loss_sum += (ps.detach().double() * weight[s : s + a.batch].double()).sum()
        totals = torch.stack([loss_sum, weight.double().sum()])
        dist.all_reduce(totals)
        if rank == 0:
            print(f"epoch {epoch} loss {(totals[0] / totals[1]).item():.10f}", flush=True)
    dist.barrier()
    # Leave without tearing gloo down: its teardown now and then aborts a rank ("terminate called
    # without an active exception"), and the runner skips its static destructors too.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
