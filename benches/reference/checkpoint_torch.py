"""The PyTorch side of activation checkpointing's side by side (docs/benchmarks.md,
benches/reference/checkpoint_side_by_side.sh): the runner's transformer (transformer_torch.py's
model) trained on random tokens with every block kept or checkpointed by
torch.utils.checkpoint's non-reentrant variant (use_reentrant=False, as torchtitan uses it):
"full" recomputes the whole block; "selective" is torchtitan's op-level policy
(create_selective_checkpoint_contexts: the matrix products' and the attention's outputs saved,
everything else recomputed).

    python3 checkpoint_torch.py --policy none|selective|full --seq-len 2048 [--layers 6 --d-model 128
        --heads 4 --vocab 512 --batch 4 --steps 4 --threads 2]

Prints one JSON line: the policy, the process's peak resident memory (ru_maxrss), its resident
memory before the first step (libtorch and the model: what the activations, the gradients and
AdamW's state, 4 bytes × 3 per parameter, add to), and the median wall and CPU (user + system,
this process's threads: what a machine shared with other work does not inflate) time of the
steps after the first.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformer_torch import Transformer  # noqa: E402


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# torchtitan's op-level policy: what selective checkpointing keeps (the products and the attention).
SAVED = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}


def keep_products(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def run_block(policy, block, h):
    if policy == "full":
        return checkpoint(block, h, use_reentrant=False)
    if policy == "selective":
        contexts = functools.partial(create_selective_checkpoint_contexts, keep_products)
        return checkpoint(block, h, use_reentrant=False, context_fn=contexts)
    return block(h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", choices=["none", "selective", "full"], required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Transformer(a.vocab, a.d_model, a.heads, a.layers, a.seq_len, tied=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def forward(x):
        h = model.tok(x) + model.pos.weight[: x.shape[1]]
        for block in model.blocks:
            h = run_block(a.policy, block, h)
        return model.head(model.ln_f(h))

    times, cpu, base = [], [], rss_bytes()
    for _ in range(a.steps):
        w = torch.randint(0, a.vocab, (a.batch, a.seq_len + 1))
        t0, c0 = time.perf_counter(), time.process_time()
        logits = forward(w[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, a.vocab), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        del logits, loss
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "policy": a.policy,
                "seq_len": a.seq_len,
                "peak_bytes": peak,
                "base_bytes": base,
                "step_s": statistics.median(times[1:] or times),
                "step_cpu_s": statistics.median(cpu[1:] or cpu),
            }
        )
    )


if __name__ == "__main__":
    main()
