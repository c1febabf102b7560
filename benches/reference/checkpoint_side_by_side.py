"""Activation checkpointing, the runner beside PyTorch (docs/benchmarks.md): docs/memory.md's
`long.toml` (6 blocks of width 128, 4 heads, vocabulary 512, batches of 4 windows, AdamW, one
rank of 2 threads) at one context, without checkpointing and with every block checkpointed,
selective and full, alternating the runner's runs and checkpoint_torch.py's
(torch.utils.checkpoint, use_reentrant=False; selective: torchtitan's op-level policy).

    .deps/reference/bin/python benches/reference/checkpoint_side_by_side.py [--runner
        target/debug/runner] [--seq-len 2048] [--rounds 2]

For each: the peak resident memory (the runner's trace, ru_maxrss for PyTorch), what
checkpointing saves of it, and the CPU time (user + system) of a step, which a machine shared
with other work inflates far less than the wall time: the runner's is the difference between a
run of 4 steps and one of 1 (the same start-up, load and validation), over 3.

PyTorch runs with MALLOC_MMAP_THRESHOLD_=131072: glibc then maps every block of 128 KiB or more
on its own and hands it back on free, so the peak resident memory follows the tensors alive
(with glibc's default, freed activations stay in a fragmented heap and the peak says little of
them: PyTorch's checkpointing then seemed to save 133 MiB instead of 334). The runner keeps its
own cache of blocks reused by size (src/dist/memory.rs), whose peak follows the tensors alive.
"""

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile

import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def long_toml():
    text = open(os.path.join(ROOT, "docs", "memory.md")).read()
    return re.search(r"```toml file=long.toml\n(.*?)```", text, re.S).group(1)


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def runner(binary, work, policy, seq_len, steps):
    """CPU seconds of one run and its peak resident bytes."""
    out = os.path.join(work, f"{policy}-{steps}")
    sets = [f"wrap.model.seq_len={seq_len}", f"train.steps={steps}", f'wrap.activation_checkpointing.policy="{policy}"']
    args = [binary, "run", os.path.join(work, "long.toml"), "--out", out]
    for s in sets:
        args += ["--set", s]
    before = children_cpu()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    cpu = children_cpu() - before
    peak = max(pq.read_table(os.path.join(out, "trace.parquet")).column("peak_rss_bytes").to_pylist())
    subprocess.run(["rm", "-rf", out], check=True)
    return cpu, peak


def torch_run(policy, seq_len):
    script = os.path.join(HERE, "checkpoint_torch.py")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    args = [sys.executable, script, "--policy", policy, "--seq-len", str(seq_len)]
    line = subprocess.run(args, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(line.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runner", default=os.path.join(ROOT, "target", "debug", "runner"))
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    policies = ["none", "selective", "full"]
    res = {(who, p): {"cpu": [], "peak": [], "base": []} for who in ["runner", "torch"] for p in policies}
    with tempfile.TemporaryDirectory(prefix="ckpt-sbs-") as work:
        open(os.path.join(work, "long.toml"), "w").write(long_toml())
        for _ in range(a.rounds):
            for policy in policies:
                c1, _ = runner(a.runner, work, policy, a.seq_len, 1)
                c4, peak = runner(a.runner, work, policy, a.seq_len, 4)
                res["runner", policy]["cpu"].append((c4 - c1) / 3)
                res["runner", policy]["peak"].append(peak)
                t = torch_run(policy, a.seq_len)
                res["torch", policy]["cpu"].append(t["step_cpu_s"])
                res["torch", policy]["peak"].append(t["peak_bytes"])
                res["torch", policy]["base"].append(t["base_bytes"])
    mib = 1 << 20
    print(f"context {a.seq_len}, {a.rounds} round(s), medians")
    print("| | policy | peak | saved | CPU s per step | / none |")
    print("|---|---|---|---|---|---|")
    for who in ["runner", "torch"]:
        m = {p: {k: statistics.median(v) for k, v in res[who, p].items() if v} for p in policies}
        for p in policies:
            saved = m["none"]["peak"] - m[p]["peak"]
            print(
                f"| {who} | {p} | {m[p]['peak'] / mib:.0f} MiB | {saved / mib:.0f} MiB | {m[p]['cpu']:.2f} "
                f"| {m[p]['cpu'] / m['none']['cpu']:.2f}× |"
            )
    base = statistics.median(res["torch", "none"]["base"])
    print(f"PyTorch's process before its first step: {base / mib:.0f} MiB (libtorch and the model)")


if __name__ == "__main__":
    main()
