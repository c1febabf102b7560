"""The PyTorch side of the GPU check's throughput comparison (scripts/gpu_check.py): the runner's
transformer (transformer_torch.py's model: pre-norm blocks, scaled_dot_product_attention, GELU
MLP) trained as nanoGPT's train.py trains it on one GPU, from the same token file and shapes as the
runner's run beside it.

    python3 gpt_throughput.py TOKENS.bin --vocab 50304 --d-model 768 --heads 12 --layers 12
        --seq-len 1024 --batch 8 --steps 300 [--bf16] [--device cuda] [--peak-tflops 989.4]
        [--syncs-per-step N] [--compile]

What nanoGPT does and this does too: windows at random offsets of a memory-mapped uint16 file,
copied to the GPU from pinned memory without blocking; bfloat16 autocast; AdamW with
fused=True; gradient clipping at 1.0; one optimizer step per batch; with --compile, the model
through `torch.compile` in its default mode, as nanoGPT's `compile = True` (compiled in the
warm-up steps, which are not timed). Timed after 10 warm-up steps,
synchronised at both ends; --syncs-per-step N also waits for the device N times a step (at most
8, at the phase ends), as a loop that times its phases does. Prints one JSON line: tokens per second, model FLOPs utilisation
(the runner's FLOPs count: 3 × (layers × (2 T × matrices + 4 T² × d) + 2 T d V) per window) and the
peak memory libtorch's caching allocator handed out (torch.cuda.max_memory_allocated).
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformer_torch import Transformer  # noqa: E402

WARMUP = 10


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tokens")
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--d-model", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--syncs-per-step", type=int, default=0, help="torch.cuda.synchronize() calls at phase ends, as a loop that times each phase makes")
    ap.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps first (compiling, the allocator's growth)")
    ap.add_argument("--compile", action="store_true", help="the model through torch.compile (default mode)")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile's backend: inductor (its default), or eager (dynamo's tracing alone: what the GPU check's --cpu mode uses, since inductor's C++ takes half a minute a point on 2 cores)")
    a = ap.parse_args()

    torch.manual_seed(0)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    data = np.memmap(a.tokens, dtype=np.uint16, mode="r")
    model = Transformer(a.vocab, a.d_model, a.heads, a.layers, a.seq_len, tied=True, bias=True).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    # The optimizer holds the parameters themselves: compiling wraps the module, not them.
    forward = torch.compile(model, backend=a.compile_backend) if a.compile else model
    rng = np.random.default_rng(0)

    def batch():
        starts = rng.integers(0, len(data) - a.seq_len - 1, a.batch)
        w = torch.from_numpy(np.stack([data[s : s + a.seq_len + 1].astype(np.int64) for s in starts]))
        if cuda:
            w = w.pin_memory().to(dev, non_blocking=True)
        return w[:, :-1], w[:, 1:]

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # Where a loop that times its phases waits for the device: after the batch, the forward
    # pass, the loss, the backward pass, the clipping and the update (8 at most).
    at = set(range(a.syncs_per_step))

    def phase(i):
        if i in at:
            sync()

    def step():
        phase(0)
        x, y = batch()
        phase(1)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16):
            logits = forward(x)
        phase(2)
        loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), y.reshape(-1))
        phase(3)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        phase(4)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        phase(5)
        opt.step()
        phase(6)
        phase(7)
        return loss

    compile_start = time.perf_counter()
    for _ in range(a.warmup):
        step()
    sync()
    warmup_s = time.perf_counter() - compile_start
    start = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    sync()
    seconds = time.perf_counter() - start
    tokens_per_s = a.steps * a.batch * a.seq_len / seconds
    d, t, v, n = a.d_model, a.seq_len, a.vocab, a.layers
    matrices = 3 * d * d + d * d + 8 * d * d
    flops_per_window = 3 * (n * (2 * t * matrices + 4 * t * t * d) + 2 * t * d * v)
    flops_per_s = flops_per_window * tokens_per_s / t
    out = {
        "torch": torch.__version__,
        "steps": a.steps,
        "seconds": round(seconds, 3),
        "syncs_per_step": a.syncs_per_step,
        "compiled": a.compile_backend if a.compile else None,
        "warmup_s": round(warmup_s, 1),
        "tokens_per_s": round(tokens_per_s, 1),
        "tflops_per_s": round(flops_per_s / 1e12, 2),
        "mfu": round(flops_per_s / (a.peak_tflops * 1e12), 4) if a.peak_tflops else None,
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_loss": round(loss.item(), 4),
    }
    if cuda:
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(dev)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
