"""The optimizer step's time, fused against foreach, on the kernels the runner calls.

`train.fused = true` runs libtorch's `_fused_adamw_`, `false` its `_foreach_` operations
(src/dist/kernels.rs); PyTorch's `torch.optim.AdamW(fused=True)` and `(foreach=True)` run the
same kernels, so this times them on a GPT-sized parameter set (by default 23M parameters in 73
tensors: a 6-layer, 512-wide GPT), one thread, median of --repeat steps:

    .deps/reference/bin/python scripts/optim-speed.py [--params 25e6] [--device cpu] [--repeat 20]
"""
import argparse
import statistics
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--params", type=float, default=25e6)
p.add_argument("--device", default="cpu")
p.add_argument("--repeat", type=int, default=20)
p.add_argument("--threads", type=int, default=1)
a = p.parse_args()
torch.set_num_threads(a.threads)
width = 512
per_layer = 12 * width * width
layers = max(1, int((a.params - 8192 * width) // per_layer))
shapes = [(8192, width)] + [s for _ in range(layers) for s in
                            [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width),
                             (width,), (width,), (3 * width,), (width,), (4 * width,), (width,), (width,), (width,)]]
torch.manual_seed(0)
params = [torch.randn(s, device=a.device, requires_grad=True) for s in shapes]
for q in params:
    q.grad = torch.randn_like(q)
total = sum(q.numel() for q in params)


def median_ms(**mode):
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **mode)
    times = []
    for _ in range(a.repeat + 3):
        if a.device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.step()
        if a.device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[3:]) * 1e3


foreach = median_ms(foreach=True)
fused = median_ms(fused=True)
print(f"{total / 1e6:.1f}M parameters in {len(params)} tensors on {a.device}, {a.threads} thread(s): "
      f"AdamW step foreach {foreach:.1f} ms, fused {fused:.1f} ms, foreach/fused {foreach / fused:.2f}x")
