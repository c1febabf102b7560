#!/usr/bin/env python3
"""How well the benchmark's early losses rank its trials (docs/benchmarks.md#searches-side-by-side-with-optuna):
random searches of 20 trials to the full budget (9 epochs), and for each the Spearman rank
correlation of the validation loss at 1 and at 3 epochs with the loss at 9, and where the best
trial at 9 epochs ranked earlier. ASHA can only find what its first rungs rank well.

    RUNNER=target/release/runner /tmp/optuna/bin/python benches/reference/search_fidelity.py OUT [SEEDS]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import search_optuna as so  # noqa: E402


def rank(xs):
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0] * len(xs)
    for k, i in enumerate(order):
        r[i] = k
    return r


def spearman(a, b):
    ra, rb, n = rank(a), rank(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main():
    out = Path(sys.argv[1])
    seeds = [int(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "0,1").split(",")]
    out.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        exp, d = out / f"random-{seed}.toml", out / f"random-{seed}"
        so.experiment(exp, "random", 20, seed, None)
        so.run_sweep(exp, d)
        losses, _ = so.full_trials(d)
        e1, e3, e9 = ([x[k] for x in losses] for k in range(3))
        best = min(range(len(e9)), key=lambda i: e9[i])
        print(f"seed {seed}: Spearman(1 epoch, 9) = {spearman(e1, e9):.2f}, Spearman(3, 9) = {spearman(e3, e9):.2f}; "
              f"the best trial at 9 epochs ranks {sorted(e1).index(e1[best]) + 1} of {len(e9)} at 1 epoch, "
              f"{sorted(e3).index(e3[best]) + 1} at 3")


if __name__ == "__main__":
    main()
