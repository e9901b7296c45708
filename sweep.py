"""
Check the paper's claims at CPU scale: the same small looped model trained under each residual scheme at several loop
counts, a few seeds each, at a fixed token budget; then a stability sweep at a large unrolled depth with a raised
learning rate. Every run is a plain `python train.py --key=value ...` in a subprocess, so what is measured here is
exactly what train.py does.

    python sweep.py                                  # the whole sweep (18 min on 2 CPU cores), results in out-sweep/
    python sweep.py --seeds=0 --loops=1,4 --max_iters=100 --out_dir=out-sweep-quick   # a quick look

Writes out_dir/results.md (tables), out_dir/val_loss_vs_n_loop.png (plot, needs matplotlib) and one folder per run
under out_dir/runs/. A run whose folder already holds result.json is not trained again, so an interrupted sweep
picks up where it stopped; delete out_dir to start from scratch.

Byte-level tokens (data/builtin_bytes, vocab 256 + a separator) by default: with GPT-2's 50K vocabulary a CPU step
goes almost entirely to the output layer, and in the minutes a sweep has every scheme stops near the unigram level,
where the schemes cannot be told apart.
"""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from configurator import configure, die
from plot import read_metrics
from prepare_data import prepare_builtin_if_missing

# -----------------------------------------------------------------------------------------------------------------
out_dir = "out-sweep"
dataset = "builtin_bytes"
schemes = "deeploop,deepnorm,postln,preln"
loops = "1,2,4,8"         # n_loop values; the physical depth n_layer stays fixed
seeds = "0,1,2"
workers = 2               # runs at the same time, one CPU thread each (2 single-threaded runs beat 1 two-threaded)
# the model and the budget of every run in the main sweep
n_layer = 2
n_head = 4
n_embd = 128
block_size = 128
batch_size = 8
max_iters = 300           # the token budget: max_iters * batch_size * block_size tokens per run
learning_rate = 1e-3
warmup_iters = 100        # Post-LN needs a real warmup: with 30, every Post-LN scheme stalled at unigram level
eval_iters = 20
# stability sweep: a deep unroll of the same physical blocks and a raised learning rate, one seed per scheme
stability_n_loop = 32
stability_learning_rate = 1e-2
stability_max_iters = 100
stability_warmup_iters = 5
stability_batch_size = 8
stability_block_size = 64
config = configure(globals(), sys.argv[1:])
# -----------------------------------------------------------------------------------------------------------------


def int_list(name):
    try:
        return [int(v) for v in str(globals()[name]).split(",")]
    except ValueError:
        die(f"{name} must be comma-separated integers like 1,2,4, got {globals()[name]!r}")


scheme_list, loop_list, seed_list = schemes.split(","), int_list("loops"), int_list("seeds")
for scheme in scheme_list:
    if scheme not in ("deeploop", "deepnorm", "postln", "preln"):
        die(f"unknown scheme '{scheme}' in --schemes; use deeploop, deepnorm, postln, preln")


def train(name, n_loop, seed, lr, iters, warmup, batch, block):
    """One train.py run -> its result dict (also saved as result.json in the run's folder)."""
    run_dir = os.path.join(out_dir, "runs", name)
    result_path = os.path.join(run_dir, "result.json")
    if os.path.isfile(result_path):
        with open(result_path) as f:
            return json.load(f)
    scheme = name.split("_")[0]
    args = dict(out_dir=run_dir, dataset=dataset, residual=scheme, n_layer=n_layer, n_loop=n_loop, n_head=n_head,
                n_embd=n_embd, block_size=block, batch_size=batch, gradient_accumulation_steps=1, dropout=0.0,
                learning_rate=lr, min_lr=lr / 10, warmup_iters=warmup, max_iters=iters, lr_decay_iters=iters,
                eval_interval=iters, eval_iters=eval_iters, log_interval=max(1, iters // 20), seed=seed,
                device="cpu", dtype="float32", compile=False)
    cmd = [sys.executable, "train.py"] + [f"--{k}={v}" for k, v in args.items()]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 and "diverged" not in proc.stderr:
        die(f"run {name} failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}; command: "
            f"{' '.join(cmd)}")
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    evals = [r for r in records if r["type"] == "eval"]
    final = evals[-1] if proc.returncode == 0 else None
    result = dict(name=name, scheme=scheme, n_loop=n_loop, seed=seed, seconds=time.time() - t0,
                  initial_val_loss=evals[0]["val_loss"], val_loss=final["val_loss"] if final else None,
                  kappa=final["loop"]["kappa"] if final else None,
                  error=proc.stderr.strip().splitlines()[-1] if proc.returncode else None)
    # diverged: the loss went non-finite (train.py stops), or training ended worse than it started
    result["diverged"] = final is None or not final["val_loss"] < result["initial_val_loss"]
    with open(result_path, "w") as f:
        json.dump(result, f)
    status = "DIVERGED" if result["diverged"] else f"val {result['val_loss']:.4f}"
    print(f"{name:32s} {status:>14s}  ({result['seconds']:.0f} s)", flush=True)
    return result


def mean_std(values):
    m = sum(values) / len(values)
    return m, (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0


t_start = time.time()
prepare_builtin_if_missing(dataset)  # once, here: parallel runs must not all start preparing it
main_runs = [(f"{s}_loop{r}_seed{seed}", r, seed, learning_rate, max_iters, warmup_iters, batch_size, block_size)
             for s in scheme_list for r in loop_list for seed in seed_list]
stability_runs = [(f"{s}_loop{stability_n_loop}_stability", stability_n_loop, seed_list[0], stability_learning_rate,
                   stability_max_iters, stability_warmup_iters, stability_batch_size, stability_block_size)
                  for s in scheme_list]
# the longest runs first, so the last minutes are not one deep run with a single core busy
jobs = sorted(main_runs + stability_runs, key=lambda job: -job[1] * job[4] * job[6] * job[7])
print(f"{len(main_runs)} runs of {max_iters * batch_size * block_size:,} tokens and {len(stability_runs)} stability "
      f"runs, {workers} at a time, into {out_dir}/runs")
with ThreadPoolExecutor(workers) as pool:
    results = {r["name"]: r for r in pool.map(lambda job: train(*job), jobs)}
minutes = (time.time() - t_start) / 60

# -----------------------------------------------------------------------------------------------------------------
# tables and plot
tokens = max_iters * batch_size * block_size
lines = [f"Val loss (nats per {'byte' if 'bytes' in dataset else 'token'}) after {tokens:,} training tokens, "
         f"mean ± std over seeds {seeds}; {n_layer} physical blocks, width {n_embd}, lr {learning_rate}, "
         f"data/{dataset}. Diverged runs are left out of the mean and counted.", "",
         "| scheme | " + " | ".join(f"n_loop={r} (N={n_layer * r})" for r in loop_list) + " |",
         "|---|" + "---|" * len(loop_list)]
cells = {}
for s in scheme_list:
    row = []
    for r in loop_list:
        runs = [results[f"{s}_loop{r}_seed{seed}"] for seed in seed_list]
        ok = [run["val_loss"] for run in runs if not run["diverged"]]
        cells[s, r] = mean_std(ok) if ok else None
        text = f"{cells[s, r][0]:.4f} ± {cells[s, r][1]:.4f}" if ok else "—"
        if len(ok) < len(runs):
            text += f" ({len(runs) - len(ok)} of {len(runs)} diverged)"
        row.append(text)
    lines.append(f"| {s} | " + " | ".join(row) + " |")
lines += ["", "kappa_R at the end of training (mean over physical blocks, then over seeds; 1 = visits decorrelated, "
          "R = fully aligned):", "",
          "| scheme | " + " | ".join(f"R={r}" for r in loop_list) + " |", "|---|" + "---|" * len(loop_list)]
for s in scheme_list:
    row = []
    for r in loop_list:
        kappas = [sum(k) / len(k) for k in (results[f"{s}_loop{r}_seed{seed}"]["kappa"] for seed in seed_list) if k]
        row.append(f"{sum(kappas) / len(kappas):.2f}" if kappas else "—")
    lines.append(f"| {s} | " + " | ".join(row) + " |")
lines += ["", f"Stability: n_loop={stability_n_loop} (N={n_layer * stability_n_loop}), lr {stability_learning_rate}, "
          f"warmup {stability_warmup_iters}, {stability_max_iters} steps of {stability_batch_size}x"
          f"{stability_block_size} tokens, seed {seed_list[0]}:", "",
          "| scheme | initial val loss | final val loss | diverged |", "|---|---|---|---|"]
for s in scheme_list:
    run = results[f"{s}_loop{stability_n_loop}_stability"]
    final = f"{run['val_loss']:.4f}" if run["val_loss"] is not None else "non-finite"
    lines.append(f"| {s} | {run['initial_val_loss']:.4f} | {final} | {'yes' if run['diverged'] else 'no'} |")
lines += ["", f"Sweep time: {minutes:.1f} min with {workers} worker(s). Command: "
          f"`{' '.join(['python sweep.py'] + sys.argv[1:])}`"]
table = "\n".join(lines)
with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write(table + "\n")
print(table)

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("matplotlib is not installed: no plot (pip install matplotlib)")
else:
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in scheme_list:
        points = [(r, *cells[s, r]) for r in loop_list if cells[s, r]]
        if points:
            xs, ms, sd = zip(*points)
            ax.errorbar(xs, ms, yerr=sd, marker="o", capsize=3, label=s)
    ax.set_xscale("log", base=2)
    ax.set_xticks(loop_list, [str(r) for r in loop_list])
    ax.set_xlabel(f"n_loop (physical blocks fixed at {n_layer})")
    ax.set_ylabel("final val loss")
    ax.set_title(f"{tokens:,} tokens per run, mean ± std over {len(seed_list)} seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "val_loss_vs_n_loop.png"), dpi=120)
    print(f"plot: {os.path.join(out_dir, 'val_loss_vs_n_loop.png')}")
print(f"sweep took {minutes:.1f} min")
