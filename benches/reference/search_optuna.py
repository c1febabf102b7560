#!/usr/bin/env python3
"""The runner's search side by side with Optuna's (docs/benchmarks.md#searches-side-by-side-with-optuna).

The objective: pipelines/ddp.toml at world size 1 (10000 synthetic rows, an MLP, 313 optimizer
steps an epoch), its validation loss after 9 epochs, over the learning rate (log-uniform), the
width (a choice of three) and the dropout (uniform). Four searches of the same number of trials,
for each seed:

- runner-asha:   `runner sweep` with method = "tpe" and ASHA (rungs at 1, 3 and 9 epochs, η = 3);
                 (runner-sha, not run by default: the same with synchronous successive halving);
- optuna-sh:     Optuna's TPESampler with its SuccessiveHalvingPruner (min_resource 1 epoch,
                 reduction_factor 3), driving `runner run` as a subprocess: a trial runs to 1
                 epoch, reports, and unless pruned continues the same run (--resume) to 3, then 9;
- runner-full:   `runner sweep` with method = "tpe", every trial to 9 epochs;
- optuna-full:   Optuna's TPESampler, every trial `runner run` to 9 epochs.

All run one trial at a time, with Optuna's defaults on both sides (10 random startup trials, 24
candidates). Reported per search: the best validation loss at 9 epochs, the optimizer steps of all
trials, and the wall time.

Then the cost of deciding promotions at fixed points (ASHA's in the order trials entered a rung;
successive halving's once a rung is whole) against fully asynchronous ASHA: a random search run
to the full budget gives every trial's loss at 1, 3 and 9 epochs and its time per epoch; the
schedulers are replayed on them with P workers (each run costing the process start measured here
plus its epochs), and the replay of the ordered one is compared with a real `runner sweep` of the
same random search under ASHA with 2 at a time.

Needs Optuna 5 and pyarrow (not the tests' Python):
    .deps/reference/bin/python -m venv /tmp/optuna && /tmp/optuna/bin/pip install optuna==5.0.0 pyarrow
    /tmp/optuna/bin/python benches/reference/search_optuna.py /tmp/search-bench [SEEDS] [TRIALS] [SEARCHES]

SEARCHES (comma-separated) runs only those, without the replay; `runner-asha@N` is ASHA with N
trials, e.g. `runner-asha@26,runner-full` compares ASHA within a third of the full search's compute;
`runner-sha` (and `runner-sha@N`) is synchronous successive halving; `replay` runs the replay.
"""
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]
RUNNER = os.environ.get("RUNNER") or str(ROOT / "target/release/runner")
if not Path(RUNNER).exists():
    RUNNER = str(ROOT / "target/debug/runner")
PIPELINE = ROOT / "pipelines/ddp.toml"
RUNGS = [1, 3, 9]
FIXED = {"run.world_size": "1", "run.threads_per_rank": "1", "checkpoint.every": "1"}
SPACE = '''"train.lr" = { log_uniform = [0.0003, 0.1] }
"wrap.model.hidden" = { choice = [[32], [64, 64], [128, 128]] }
"wrap.model.dropout" = { uniform = [0.0, 0.3] }'''
HIDDEN = ["[32]", "[64, 64]", "[128, 128]"]


def experiment(path, method, trials, seed, scheduler, parallel=1):
    """`scheduler`: "asha", "sha", or None (every trial to the full budget)."""
    sets = "\n".join(f'"{k}" = {v}' for k, v in FIXED.items())
    sched = (
        f'scheduler = "{scheduler}"\nmin_epochs = {RUNGS[0]}\nmax_epochs = {RUNGS[-1]}\nreduction_factor = 3\n'
        if scheduler
        else ""
    )
    text = f'''pipeline = "{PIPELINE}"

[set]
{sets}
"train.epochs" = {RUNGS[-1]}

[search]
method = "{method}"
trials = {trials}
metric = "val_loss"
seed = {seed}
parallel = {parallel}
{sched}
[search.space]
{SPACE}
'''
    path.write_text(text)


def val_loss(run_dir, epoch):
    t = pq.read_table(run_dir / "trace.parquet").to_pydict()
    rows = [i for i in range(len(t["epoch"])) if t["rank"][i] == 0 and t["epoch"][i] == epoch]
    return t["val_loss"][rows[-1]], t["step"][rows[-1]]


def run_sweep(exp, out):
    start = time.time()
    subprocess.run([RUNNER, "sweep", str(exp), "--out", str(out), "--force"], check=True,
                   stdout=subprocess.DEVNULL)
    wall = time.time() - start
    index = json.loads((out / "sweep.json").read_text())
    best, steps = math.inf, 0
    for p in index["points"]:
        d = out / p["dir"]
        t = pq.read_table(d / "trace.parquet").to_pydict()
        r0 = [i for i in range(len(t["epoch"])) if t["rank"][i] == 0]
        steps += max(t["step"][i] for i in r0)
        done = [i for i in r0 if t["epoch"][i] == RUNGS[-1]]
        if done:
            best = min(best, t["val_loss"][done[-1]])
    return best, steps, wall


def full_trials(sweep_dir):
    """A sweep run to the full budget: each trial's loss at every rung, and its seconds an epoch."""
    index = json.loads((sweep_dir / "sweep.json").read_text())
    values, seconds = [], []
    for p in index["points"]:
        t = pq.read_table(sweep_dir / p["dir"] / "trace.parquet").to_pydict()
        r0 = [i for i in range(len(t["epoch"])) if t["rank"][i] == 0]
        values.append([next(t["val_loss"][i] for i in r0 if t["epoch"][i] == e) for e in RUNGS])
        seconds.append(sum(t["epoch_s"][i] for i in r0) / len(r0))
    return values, seconds


def run_optuna(out, trials, seed, prune):
    out.mkdir(parents=True, exist_ok=True)
    spent = {"steps": 0}

    def objective(trial):
        lr = trial.suggest_float("train.lr", 0.0003, 0.1, log=True)
        hidden = trial.suggest_categorical("wrap.model.hidden", HIDDEN)
        dropout = trial.suggest_float("wrap.model.dropout", 0.0, 0.3)
        sets = dict(FIXED, **{"train.lr": repr(lr), "wrap.model.hidden": hidden, "wrap.model.dropout": repr(dropout)})
        run_dir = out / f"trial-{trial.number:03d}"
        budgets = RUNGS if prune else RUNGS[-1:]
        done = 0
        for epochs in budgets:
            args = [RUNNER, "run", str(PIPELINE)]
            for k, v in dict(sets, **{"train.epochs": str(epochs)}).items():
                args += ["--set", f"{k}={v}"]
            args += ["--resume", str(run_dir)] if done else ["--out", str(run_dir), "--force"]
            subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            value, step = val_loss(run_dir, epochs)
            spent["steps"] += step - done
            done = step
            trial.report(value, epochs)
            if prune and epochs < RUNGS[-1] and trial.should_prune():
                raise optuna.TrialPruned()
        return value

    pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=RUNGS[0], reduction_factor=3) if prune \
        else optuna.pruners.NopPruner()
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed), pruner=pruner)
    start = time.time()
    study.optimize(objective, n_trials=trials)
    return study.best_value, spent["steps"], time.time() - start


def decide(results, eta, synchronous=False):
    """The runner's rules (src/search/halving.rs): ASHA's promotes after each prefix of the order
    trials entered a rung; successive halving's once every trial of the rung has its result."""
    entrants = [list(range(len(results)))]
    for k in range(len(RUNGS) - 1):
        promoted, seen = [], []
        for place, t in enumerate(entrants[k]):
            if results[t][k] is None:
                break
            seen.append((results[t][k], place, t))
            whole = len(seen) == len(entrants[k])  # a later rung is entered all at once
            quota = len(seen) // eta if not synchronous or whole else 0
            while len(promoted) < quota:
                promoted.append(min(s for s in seen if s[2] not in promoted)[2])
        entrants.append(promoted)
    return entrants


def replay(values, seconds, start_s, workers, ordered, eta=3, synchronous=False):
    """The makespan of ASHA (ordered: the runner's; or asynchronous), or with `synchronous` of
    successive halving, over the trials' known losses, with `workers` at a time: each run of
    trial t from rung k-1 to rung k lasts start_s + its epochs × seconds[t]."""
    n = len(values)
    known = [[None] * len(RUNGS) for _ in range(n)]
    running, clock, next_trial, busy = [], 0.0, 0, 0.0
    promoted = [set() for _ in RUNGS]
    completed = [[] for _ in RUNGS]  # async: each rung's results in the order they finished
    while True:
        while len(running) < workers:
            job = None
            if ordered:
                entrants = decide(known, eta, synchronous)
                taken = {(t, k) for _, t, k in running}
                for k in reversed(range(len(RUNGS))):
                    for t in entrants[k]:
                        if known[t][k] is None and (t, k) not in taken and all(r[1] != t for r in running):
                            job = (t, k)
                            break
                    if job:
                        break
            else:
                for k in reversed(range(len(RUNGS) - 1)):
                    done = completed[k]
                    top = sorted(done, key=lambda t: values[t][k])[: len(done) // eta]
                    free = [t for t in top if t not in promoted[k]]
                    if free:
                        promoted[k].add(free[0])
                        job = (free[0], k + 1)
                        break
            if job is None and not ordered and next_trial < n:
                job = (next_trial, 0)
                next_trial += 1
            if job is None:
                break
            t, k = job
            epochs = RUNGS[k] - (RUNGS[k - 1] if k else 0)
            length = start_s + epochs * seconds[t]
            busy += length
            running.append((clock + length, t, k))
        if not running:
            return clock, busy / (workers * clock)
        running.sort()
        clock, t, k = running.pop(0)
        known[t][k] = values[t][k]
        completed[k].append(t)


def main():
    out = Path(sys.argv[1])
    seeds = [int(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "0,1,2").split(",")]
    trials = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    searches = sys.argv[4].split(",") if len(sys.argv) > 4 else ["runner-asha", "optuna-sh", "runner-full", "optuna-full"]
    out.mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print(f"runner: {RUNNER}; Optuna {optuna.__version__}; {trials} trials; seeds {seeds}", flush=True)
    rows = []
    replaying = len(sys.argv) <= 4 or "replay" in searches
    searches = [s for s in searches if s != "replay"]
    for seed in seeds:
        for name in searches:
            d = out / f"{name}-{seed}"
            # runner-asha@N: ASHA with N trials (the full searches keep TRIALS).
            base, n = (name.split("@")[0], int(name.split("@")[1])) if "@" in name else (name, trials)
            if base.startswith("runner"):
                exp = out / f"{name}-{seed}.toml"
                experiment(exp, "tpe", n, seed, {"runner-asha": "asha", "runner-sha": "sha"}.get(base))
                best, steps, wall = run_sweep(exp, d)
            else:
                best, steps, wall = run_optuna(d, n, seed, prune=base.endswith("sh"))
            rows.append((name, seed, best, steps, wall))
            print(f"{name:12s} seed {seed}: best val_loss {best:.4f}, {steps} steps, {wall:.0f} s", flush=True)
    print("\n| search | seeds | best val loss at 9 epochs, mean ± std | optimizer steps, mean | wall time, mean |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in searches:
        mine = [r for r in rows if r[0] == name]
        b = [r[2] for r in mine]
        mean = sum(b) / len(b)
        std = math.sqrt(sum((x - mean) ** 2 for x in b) / (len(b) - 1)) if len(b) > 1 else 0.0
        print(f"| {name} | {len(b)} | {mean:.4f} ± {std:.4f} | {sum(r[3] for r in mine) / len(b):.0f} | "
              f"{sum(r[4] for r in mine) / len(b):.0f} s |")

    if not replaying:
        return
    # Ordered against asynchronous ASHA, replayed on a random search run to the full budget.
    exp = out / "random-full.toml"
    experiment(exp, "random", trials, seeds[0], None)
    run_sweep(exp, out / "random-full")
    index = json.loads((out / "random-full" / "sweep.json").read_text())
    values, seconds = full_trials(out / "random-full")
    # A run's time beyond its epochs: the process, the plan, the data, the checkpoints (median).
    dirs = [p["dir"] for p in index["points"]]
    jobs = [j.split(",") for j in (out / "random-full" / "search_jobs.csv").read_text().splitlines()[1:]]
    extra = sorted(float(j[4]) - RUNGS[-1] * seconds[dirs.index(j[0])] for j in jobs)
    start_s = extra[len(extra) // 2]
    exp = out / "random-asha.toml"
    experiment(exp, "random", trials, seeds[0], "asha", parallel=2)
    _, _, measured = run_sweep(exp, out / "random-asha")
    print(f"\nASHA replayed on the {trials} trials of a random search (seed {seeds[0]}): each run costs "
          f"{start_s:.2f} s to start plus {sum(seconds) / len(seconds):.3f} s an epoch (mean)")
    print(f"real `runner sweep` under ASHA, 2 at a time: {measured:.1f} s; its replay: "
          f"{replay(values, seconds, start_s, 2, True)[0]:.1f} s")
    print("\n| workers | ordered ASHA (runner) | successive halving (runner) | asynchronous ASHA | ordered ÷ async | "
          "SH ÷ async | busy: ordered, SH, async |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for workers in [1, 2, 4, 8]:
        (a, ua) = replay(values, seconds, start_s, workers, True)
        (c, uc) = replay(values, seconds, start_s, workers, True, synchronous=True)
        (b, ub) = replay(values, seconds, start_s, workers, False)
        print(f"| {workers} | {a:.1f} s | {c:.1f} s | {b:.1f} s | {a / b:.3f} | {c / b:.3f} | {ua:.0%}, {uc:.0%}, {ub:.0%} |")


if __name__ == "__main__":
    main()
