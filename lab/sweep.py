"""
The paper's experiments at CPU scale. Every run is a plain `python -m lab.train --key=value ...` (train.py with
kappa_R recorded) in a subprocess, so what is measured here is exactly what train.py does. Three modes share the
runs, the escape rule, the tables and the plots:

    python -m lab.sweep --mode=exponent   # Appendix C: DeepLoop's exponent p from 0.25 (DeepNorm) to 1 at R = 3, 5 seeds
    python -m lab.sweep --mode=lr         # each scheme at its own best learning rate, R = 1 and R = 3, 3 seeds
    python -m lab.sweep --mode=loops      # Table 1: loop counts R = 1, 3, 5, 7 at fixed physical depth, 3 seeds
    python -m lab.sweep --mode=transfer   # does each scheme's best learning rate stay put as R grows? R = 1, 2, 4, 8
    python -m lab.sweep --mode=loops --schemes=preln,deeploop,deepnorm,postln --seeds=0   # any grid, by override
    python -m lab.sweep --mode=depth      # where depth is the bottleneck: accuracy by k on pointer chains (tasks.py)
    python -m lab.sweep --mode=budget     # the gap to Pre-LN at R = 1 and the gain from R = 1 to 3 as training grows

The budget mode trains on data/stdlib_bytes (31M bytes of the standard library's source, 14 times builtin_bytes;
windows are drawn with replacement, so the longest budget of 43,000 steps of 8 x 64 bytes reads some bytes twice). It
runs in stages, all from that one command: every scheme at every rate and seed at the first budget; then each scheme
at its best rate there at each longer budget (every scheme and seed up to full_grid_until steps, long_schemes with
long_seeds beyond, at long_rate if given); then, at every budget past full_grid_until, the long schemes' rate walk
(sweep_budget.rate_walk) on every long seed: the chosen rate's neighbours on each side, and past a neighbour that wins
on the mean, the next rate, until the best rate has both neighbours run. The longest runs go first. Every run records
the machine it trained on and the code's commit, and resumes from its checkpoint (written every checkpoint_minutes)
when a study is stopped and started again. `--report_only=True` writes the tables and the plot of the
runs finished so far, so a study that a session cannot finish is read as far as it got and resumed with the same
command; the report's runs.jsonl (every run's result) goes on elsewhere with `--results_from=` that file.
lab/sweep_budget.py holds its tables and plot.

The depth mode is apart from the other three: its runs train config/depth_cpu.py on a smaller budget (BUDGETS;
the settings of the model and the budget given to sweep.py, in a config file or on the command line, override
both), scheme `untied` is the control with n_layer * R blocks run once (Pre-LN, R times the parameters), and its
results are accuracy by k instead of loss; see the end of the file and docs/depth_task.md. The transfer mode runs
on the depth task too:

    python -m lab.sweep --mode=transfer --dataset=chains   # best rates by accuracy at the hardest k, not by val loss

Each mode runs every combination of its schemes x loops x exponents x learning_rates x seeds (an empty setting takes
the mode's default, MODES below) and writes out_dir/results.md (tables), out_dir/<mode>.png (its plot) and
out_dir/curves.png (every run's training loss against the floor and the escape line) and one folder per run under
out_dir/runs/. A run whose folder already holds result.json is not trained again, so an interrupted sweep picks up
where it stopped (a text run it interrupted resumes from its checkpoint; a depth-task run starts over, train.py's
start_over moving that attempt's files into the run's previous-N folder), and a sweep with more seeds reuses the runs
it has; delete out_dir to start from scratch. A result of other settings than the sweep's is never reused, and
SIGTERM or Ctrl-C stops the sweep with its runs' checkpoints, to resume with the same command (lab/sweep_runs.py).

Escaping the floor. A model that has only learned how often each token occurs scores the unigram entropy of the
data, measured here from the training split; short Post-LN runs often stall there. A run has *escaped* when its
final val loss is below that floor by more than escape_margin nats. In the sweeps of docs/text.md the runs
whose training loss stayed on the floor's curve ended between 0.097 below and 0.095 above it (the training split's
byte frequencies score 3.312 on the val split against the floor's 3.315) and those that learned more ended at least
0.112 below it. A margin of 0.1 falls in that narrow gap; curves.png shows where it falls for any new sweep.

Byte-level tokens (data/builtin_bytes, vocab 256 + a separator) by default: with GPT-2's 50K vocabulary a CPU step
goes almost entirely to the output layer, and in the minutes a sweep has every scheme stops near the unigram level.
"""

import itertools
import math
import os
import runpy
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import numpy as np

from configurator import configure, die
from lab import require
from dataset import load_meta, read_shard
from model import OWN_EXPONENT, RESIDUALS
from lab.sweep_runs import VARIANTS, Runs, mean_over_k, split_scheme, variant_settings
from prepare_data import prepare_builtin_if_missing

# -----------------------------------------------------------------------------------------------------------------
mode = "exponent"         # exponent | lr | loops | transfer | depth
out_dir = ""              # default: out-sweep-<mode>
dataset = ""              # default: builtin_bytes; stdlib_bytes for --mode=budget
# the grid; "" takes the mode's default from MODES
schemes = ""
loops = ""                # n_loop values; the physical depth n_layer stays fixed
exponents = ""            # residual_exponent values (0 = the scheme's own p)
learning_rates = ""
scheme_rates = ""         # depth mode: some schemes' own rates instead, like "postln:3e-4,1e-3;deeploop:1e-3,3e-3"
seeds = ""
budgets = ""              # budget mode: max_iters of each budget, shortest first; the rate grid runs at the first
full_grid_until = 4300    # budget mode: budgets up to this many steps (one pass over builtin_bytes at 8 x 64) run every
#                           scheme and seed; the longer ones run long_schemes with long_seeds
long_schemes = ""
long_seeds = ""
long_rate = 0.0           # budget mode: the long schemes' rate past full_grid_until in place of the grid's, where a rate
#                           check at a longer budget than the grid's found a neighbour better (0: the grid's)
report_only = False       # budget mode: tables and plot of the runs finished so far, training nothing
results_from = ""         # budget mode: a runs.jsonl that a study wrote (docs/runs/budget_study_runs.jsonl): its runs
#                           count as done here, so that a study goes on on another machine
checkpoint_minutes = 3.0  # each text run writes ckpt.pt this often, so that a stopped study loses minutes only
workers = 2               # runs at the same time, one CPU thread each (2 single-threaded runs beat 1 two-threaded)
escape_margin = 0.1       # nats below the unigram floor that count as having escaped it
learned_accuracy = 0.9    # depth mode: a run has learned the task when its val accuracy at k = 1 is at least this
# the model and the budget of every run
n_layer = 2
n_head = 4
n_embd = 64
block_size = 64
batch_size = 8
max_iters = 400           # the token budget: max_iters * batch_size * block_size tokens per run
warmup_iters = 100        # Post-LN needs a real warmup: with 30, every Post-LN scheme stalled at unigram level
eval_iters = 20
dtype = "auto"            # one precision for every run; auto: measured once here (Runs.sweep_dtype), then kept
# the settings as this file sets them: what the runs of a result that records no settings got (lab/sweep_runs.py)
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str))}
given = set()             # the settings that config files and --key=value overrides set (configurator)
config = configure(globals(), sys.argv[1:], given)
require("matplotlib")  # the plots at the end
# -----------------------------------------------------------------------------------------------------------------

MODES = {
    # 0.25..0.60: the paper's Appendix C; 0.75 and 1 beyond it (p = 1 gives the branches 1/N, the rival's exponent)
    "exponent": dict(schemes="deeploop", loops="3", exponents="0.25,0.3,0.35,0.4,0.45,0.5,0.55,0.6,0.75,1",
                     learning_rates="3e-3", seeds="0,1,2,3,4"),
    "lr": dict(schemes="deeploop,deepnorm,preln", loops="1,3", exponents="0", learning_rates="3e-4,1e-3,3e-3",
               seeds="0,1,2"),
    "loops": dict(schemes="preln,deeploop", loops="1,3,5,7", exponents="0", learning_rates="1e-3", seeds="0,1,2"),
    # the rival's claim (arXiv 2606.18524): with preln_scaled the best rate depends on n_layer only, not on R; the
    # rates bracket every scheme's best on the bytes (1.6e-2 and 3.2e-2 were worse for all 16 (scheme, R))
    "transfer": dict(schemes="preln,preln_scaled,deeploop,deepnorm", loops="1,2,4,8", exponents="0",
                     learning_rates="2.5e-4,5e-4,1e-3,2e-3,4e-3,8e-3", seeds="0,1,2"),
    "transfer on chains": dict(schemes="preln,preln_scaled,deeploop,deepnorm", loops="1,2,4,8", exponents="0",
                               learning_rates="1e-3,2e-3,4e-3,8e-3,1.6e-2,3.2e-2", seeds="0,1,2"),
    "depth": dict(schemes="preln,deeploop,deepnorm,untied", loops="1,2,4,8", exponents="0",
                  learning_rates="1e-3,3e-3", seeds="0,1,2"),
    # 400 steps (the other modes' budget) to ten passes over builtin_bytes, in steps of about sqrt(10)
    "budget": dict(schemes="preln,postln,deepnorm,deeploop,preln_scaled,preln+paper,deeploop+paper", loops="1,3",
                   exponents="0", learning_rates="3e-4,1e-3,3e-3,1e-2", seeds="0,1,2",
                   budgets="400,1350,4300,13500,43000", long_schemes="preln,deeploop", long_seeds="0,1"),
}
DEPTH_CONFIG = "config/depth_cpu.py"  # what every run on the depth task (--dataset=chains) trains, before the grid
# Budgets of their own, where a mode's grid would not fit its time on 2 cores with the settings above (the depth task:
# config/depth_cpu.py's 1,500 x 64 sequences); settings given in a config file or on the command line override them.
BUDGETS = {
    "transfer": dict(batch_size=4, max_iters=300),  # 288 runs, 84.5 min of run time: 42 min (400 x 8: ~80)
    "depth": dict(batch_size=32, max_iters=500, warmup_iters=100),  # 90 runs in 27 min (at 600 steps: 32)
    "transfer on chains": dict(batch_size=32, max_iters=200, warmup_iters=50),  # 288 runs in 30.6 min
    "budget": dict(eval_iters=50),  # 25,600 val bytes: the gaps it compares are a few hundredths of a nat
}
INJECTED = ("add", "concat")  # variants that differ from the scheme alone only from the second loop on
ON_CHAINS_ONLY = ("relative", "curriculum")
MODEL_AND_BUDGET = ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "max_iters", "warmup_iters",
                    "eval_iters")
# Appendix C of the paper: runs out of 5 (GPT-2 small, R = 3, ~2,700 steps) that escaped the unigram floor
PAPER_ESCAPED = {0.30: 0, 0.35: 1, 0.40: 2, 0.45: 2, 0.50: 3, 0.55: 5, 0.60: 5}

if mode not in MODES:
    die(f"unknown mode {mode!r}; use --mode=exponent, --mode=lr, --mode=loops, --mode=transfer, --mode=depth or "
        f"--mode=budget")
if results_from and mode != "budget":
    die(f"results_from applies to --mode=budget, whose study goes on across machines; --mode={mode} resumes from "
        f"its own out_dir")
if report_only and mode != "budget":
    die(f"report_only applies to --mode=budget, whose study a session may not finish; --mode={mode} tables its "
        f"runs when they are done")
mode_dataset = "stdlib_bytes" if mode == "budget" else "builtin_bytes"
dataset = dataset or mode_dataset
on_chains = mode == "depth" or dataset == "chains"  # the depth task (tasks.py): accuracy by k, not loss
if on_chains and mode not in ("depth", "transfer"):
    die(f"--dataset=chains (the depth task) applies to --mode=depth and --mode=transfer, not --mode={mode}; "
        f"use a text dataset such as builtin_bytes")
grid_name = mode + (" on chains" if mode == "transfer" and on_chains else "")  # its grid (MODES) and budget (BUDGETS)
out_dir = out_dir or f"out-sweep-{mode}" + ("-chains" if mode == "transfer" and on_chains else "")
mode_budget = dict(BUDGETS.get(grid_name, {}), **{k: config[k] for k in MODEL_AND_BUDGET if k in given})
if on_chains:  # the runs train DEPTH_CONFIG's model and budget where neither BUDGETS nor the user say otherwise
    depth_config = runpy.run_path(DEPTH_CONFIG)
    globals().update({k: depth_config[k] for k in MODEL_AND_BUDGET})
globals().update(mode_budget)  # the model and budget settings above, as every run of this sweep gets them


def number_list(name, kind):
    text = str(globals()[name] or MODES[grid_name][name])
    try:
        return [kind(v) for v in text.split(",")]
    except ValueError:
        die(f"{name} must be comma-separated {kind.__name__}s like {MODES['loops'].get(name, MODES[grid_name][name])}, "
            f"got {text!r}")


scheme_list = str(schemes or MODES[grid_name]["schemes"]).split(",")
loop_list, seed_list = number_list("loops", int), number_list("seeds", int)
exponent_list, lr_list = number_list("exponents", float), number_list("learning_rates", float)
own_rates = {}  # scheme -> its learning rates where scheme_rates gives them
for entry in filter(None, scheme_rates.split(";")):
    scheme, _, rates = entry.partition(":")
    if mode != "depth":
        die(f"scheme_rates apply to --mode=depth, not --mode={mode}; give every scheme --learning_rates")
    if scheme not in scheme_list:
        die(f"scheme_rates names '{scheme}', which is not in --schemes={','.join(scheme_list)}")
    try:
        own_rates[scheme] = [float(v) for v in rates.split(",")]
    except ValueError:
        die(f"scheme_rates must be scheme:rates entries separated by ';', like \"postln:3e-4,1e-3;deeploop:1e-3\", "
            f"got {scheme_rates!r}")
for scheme in scheme_list:
    known = RESIDUALS + (("untied",) if mode == "depth" else ())
    residual, variants = split_scheme(scheme)
    if residual not in known:
        die(f"unknown scheme '{residual}' in --schemes; use {', '.join(known)}")
    for variant in variants:
        if variant not in VARIANTS:
            die(f"unknown variant '{variant}' in --schemes={scheme}; use {', '.join(VARIANTS)} after a +")
        if variant in ON_CHAINS_ONLY and not on_chains:
            die(f"variant '{variant}' in --schemes={scheme} is for the depth task: use it with --mode=depth")
    if residual == "untied" and variants:
        die(f"the untied control takes no variant: use --schemes=untied, not {scheme}")
    if residual not in OWN_EXPONENT and any(exponent_list):
        die(f"--exponents apply to deeploop and deepnorm only, not {residual}; drop it from --schemes")


def unigram_floor(data_dir):
    """The entropy of the training split's token frequencies in nats per token: the loss of a model that predicts
    every token from how often it occurs, ignoring the context."""
    counts = sum(np.bincount(read_shard(os.path.join(data_dir, shard["file"])), minlength=1 << 16)
                 for shard in load_meta(data_dir)["shards"]["train"])
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def score(run):
    """What a finished run is ranked by: its final val loss (lower is better) or, on the depth task, its val accuracy
    at the hardest k (higher is better); None for a diverged run."""
    if on_chains:
        return run["accuracy"][hardest] if run["accuracy"] else None
    return run["val_loss"]


def escaped(run):
    """Below the unigram floor by escape_margin; on the depth task: above the best shortcut at the hardest k."""
    if score(run) is None:
        return False
    return score(run) > shortcut[hardest] if on_chains else score(run) < floor - escape_margin


def mean_std(values):
    if not values:
        return None
    m = sum(values) / len(values)
    return m, (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0


def fmt(stat, digits=4):
    return "—" if stat is None else f"{stat[0]:.{digits}f} ± {stat[1]:.{digits}f}"


def scheme_label(scheme, exponent):
    return scheme if not exponent else f"{scheme} p={exponent:g}"


t_start = time.time()
grid = [(s, r, p, lr, seed) for s in scheme_list for r in loop_list for p in exponent_list
        for lr in own_rates.get(s, lr_list)
        for seed in seed_list if (s, r) != ("untied", 1) and not (r == 1 and set(split_scheme(s)[1]) & set(INJECTED))]
# untied at R = 1 is Pre-LN at R = 1; an injected input at R = 1 is never read (it enters between loops)
if not grid:
    die("the grid has no runs: untied at R = 1 would be Pre-LN at R = 1, and an injected input is never read at R = 1, "
        "so they run at loop counts above 1 only; add one to --loops")
if not on_chains:
    data_dir = prepare_builtin_if_missing(dataset)  # once, here: parallel runs must not all start preparing it
    try:
        meta = load_meta(data_dir)
    except (FileNotFoundError, ValueError) as e:
        die(str(e))
    floor = unigram_floor(data_dir)
    unit = "byte" if meta["tokenizer"] == "bytes" else "token"
    print(f"unigram floor of data/{dataset} (train split): {floor:.4f} nats per {unit}; a run has escaped it when "
          f"its final val loss is below {floor - escape_margin:.4f}")
if mode == "budget" and "dtype" not in given:
    dtype = "float32"  # auto picks by the machine's bfloat16 speed: a study compared across CPUs trains in one precision
# the runs of this sweep, and those of its mode's defaults (what a result that records no settings was made with)
default_budget = {**{k: (depth_config if on_chains else DEFAULTS)[k] for k in MODEL_AND_BUDGET},
                  **BUDGETS.get(grid_name, {})}
runner = Runs(out_dir, mode, on_chains, dataset, mode_budget, DEPTH_CONFIG, variant_settings, loop_list,
              checkpoint_minutes, **{k: globals()[k] for k in MODEL_AND_BUDGET},
              defaults=Runs(out_dir, mode, on_chains, mode_dataset, BUDGETS.get(grid_name, {}), DEPTH_CONFIG,
                            variant_settings, loop_list, checkpoint_minutes, **default_budget))
train = runner.train
# auto: measured on the deepest runs' model, those that take the longest
run_dtype, dtype_reason = runner.sweep_dtype(dtype, max(grid, key=lambda job: job[1]))
print(f"dtype {run_dtype} for every run: {dtype_reason}")
if mode == "budget":
    from lab.sweep_budget import rate_at, rate_walk, report

    budget_list = number_list("budgets", int)
    long_list, long_seed_list = str(long_schemes or MODES[grid_name]["long_schemes"]).split(","), number_list(
        "long_seeds", int)
    if budget_list != sorted(set(budget_list)) or budget_list[0] < 1:
        die(f"budgets must be distinct positive step counts, shortest first, like {MODES[grid_name]['budgets']}; "
            f"got {budgets}")
    if not set(long_list) <= set(scheme_list):
        die(f"long_schemes must be among --schemes={','.join(scheme_list)}; got {','.join(long_list)}")
    if "preln" not in scheme_list:
        die("the budget mode measures every scheme against preln: keep preln in --schemes")
    if long_rate and long_rate not in lr_list:
        die(f"long_rate must be one of --learning_rates={','.join(f'{lr:g}' for lr in lr_list)}, so that its rate "
            f"check has the grid's neighbours; got {long_rate:g}")
    if results_from:
        taken, total = runner.import_results(results_from)
        print(f"{results_from}: {taken} of its {total} runs taken as done", flush=True)


    def best_rate(s, r):
        """The rate with the lowest mean val loss over the seeds at the first budget, once all its grid runs are done;
        a rate with a diverged run is not eligible. None while the grid is unfinished or when every rate diverged."""
        grid = [results.get((s, r, 0.0, lr, seed, budget_list[0])) for lr in lr_list for seed in seed_list]
        if not all(grid):
            return None
        means = {lr: [results[s, r, 0.0, lr, seed, budget_list[0]]["val_loss"] for seed in seed_list]
                 for lr in lr_list}
        means = {lr: sum(v) / len(v) for lr, v in means.items() if None not in v}
        return min(means, key=means.get) if means else None

    def long_mean(s, r, lr, steps):
        """rate_walk's mean_at: the mean over the long seeds of (s, r) at lr, None while one has not run, inf where
        one diverged"""
        runs = [results.get((s, r, 0.0, lr, seed, steps)) for seed in long_seed_list]
        if None in runs:
            return None
        losses = [run["val_loss"] for run in runs]
        return math.inf if None in losses else sum(losses) / len(losses)

    def resolve(job):
        """A planned run (scheme, R, rate, seed, steps), its rate "best" until the scheme's grid is done, or "walk<k>"
        (the k-th rate the rate walk at that budget asks for) until the walk has asked for it, -> the job train()
        takes, or None while its rate is not known (a walk's job that is never asked for stays None)."""
        s, r, rate, seed, steps = job
        if not isinstance(rate, str):
            return s, r, 0.0, rate, seed, steps
        lr = rate_at(best_rate(s, r), s, steps, dict(long_rate=long_rate, long_schemes=long_list,
                                                     full_grid_until=full_grid_until))
        if lr is None or rate == "best":
            return lr and (s, r, 0.0, lr, seed, steps)
        _, asked, _ = rate_walk(lr, lr_list, lambda x: long_mean(s, r, x, steps))
        k = int(rate[len("walk"):])
        return (s, r, 0.0, asked[k], seed, steps) if k < len(asked) else None

    # the plan, most wanted first: the long schemes' grid, then their runs from the longest budget down, then the
    # other schemes' grid and budgets, then the rate checks; a run waits until its scheme's rate is known
    plan = []
    for group in (long_list, [s for s in scheme_list if s not in long_list]):
        plan += [(s, r, lr, seed, budget_list[0]) for s in group for r in loop_list for lr in lr_list
                 for seed in seed_list]
        for steps in sorted(budget_list[1:], reverse=True):
            wide = steps <= full_grid_until
            plan += [(s, r, "best", seed, steps) for s in group if wide or s in long_list for r in loop_list
                     for seed in (seed_list if wide else long_seed_list)]
    # then at every budget past the full grid the rate walk (rate_walk) on every long seed, one loop count at a
    # time from R = 1 (its runs are the cheapest): the chosen rate's neighbours, then any rate beyond a winner. A walk
    # of up to 3 moves asks for 6 rates at the most; the jobs it never asks for stay unresolved and do not run.
    plan += [(s, r, f"walk{k}", seed, steps) for r in loop_list for steps in sorted(budget_list[1:], reverse=True)
             if steps > full_grid_until for s in long_list for k in range(6) for seed in long_seed_list]
    results = {}
    print(f"budget study: {len(plan)} runs planned, {workers} at a time, into {out_dir}/runs", flush=True)
    if report_only:
        changed = True
        while changed:  # a resolved rate makes the next budget's runs resolvable
            changed = False
            for job in map(resolve, plan):
                if job and job not in results and (result := runner.done(*job)):
                    results[job] = result
                    changed = True
    else:
        pending, running = list(plan), {}
        runner.catch_signals()
        with ThreadPoolExecutor(workers) as pool:
            while pending or running:
                while len(running) < workers and not runner.stopping:
                    ready = next(((planned, job) for planned in pending for job in [resolve(planned)] if job), None)
                    if ready is None:
                        break
                    pending.remove(ready[0])
                    if ready[1] in results or ready[1] in running.values():  # the same run planned twice
                        continue
                    running[pool.submit(train, *ready[1])] = ready[1]
                if not running:  # every pending run waits on a grid whose every rate diverged
                    break
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    results[running.pop(future)] = future.result()
        runner.end_if_stopped()
    best = {(s, r): best_rate(s, r) for s in scheme_list for r in loop_list if best_rate(s, r) is not None}
    report(results, best, dict(out_dir=out_dir, schemes=scheme_list, loops=loop_list, rates=lr_list,
                               seeds=seed_list, budgets=budget_list, long_schemes=long_list, long_seeds=long_seed_list,
                               long_rate=long_rate,
                               full_grid_until=full_grid_until, floor=floor, unit=unit, dataset=dataset,
                               meta=meta, tokens_per_step=batch_size * block_size, block_size=block_size,
                               batch_size=batch_size, n_layer=n_layer, n_embd=n_embd,
                               warmup_iters=warmup_iters, dtype=run_dtype, workers=workers,
                               wall_minutes=(time.time() - t_start) / 60, report_only=report_only,
                               command=" ".join(["python -m lab.sweep"] + sys.argv[1:])))
    sys.exit(0)
jobs = sorted(grid, key=lambda job: -job[1])  # the deepest runs first: the last minutes are not one run on one core
if on_chains:
    budget = f"{DEPTH_CONFIG} with " + ", ".join(f"{k}={v}" for k, v in mode_budget.items())
else:
    budget = f"{max_iters * batch_size * block_size:,} tokens"
print(f"{mode} sweep: {len(grid)} runs of {budget}, {workers} at a time, into {out_dir}/runs", flush=True)
runner.catch_signals()
with ThreadPoolExecutor(workers) as pool:
    results = dict(zip(jobs, pool.map(lambda job: train(*job), jobs)))
runner.end_if_stopped()
minutes = (time.time() - t_start) / 60
run_minutes = sum(run["seconds"] for run in results.values()) / 60

# -----------------------------------------------------------------------------------------------------------------
# tables: one row per (scheme, R, p, lr) over its seeds, then the mode's own summary

def write_results(lines):
    """results.md (and stdout): the tables, then the sweep's time and the command that redoes it."""
    lines = lines + ["", f"Sweep time: {minutes:.1f} min wall with {workers} worker(s), {run_minutes:.1f} min summed "
                     f"over the runs trained in this invocation and earlier ones. Command: "
                     f"`{' '.join(['python -m lab.sweep'] + sys.argv[1:])}`"]
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


groups = {}  # (scheme, R, p, lr) -> its runs, one per seed
for (s, r, p, lr, seed), run in sorted(results.items()):
    groups.setdefault((s, r, p, lr), []).append(run)
if on_chains:
    shortcut = next(run["shortcut"] for run in results.values())  # accuracy by k of the best guess without the chains
    hardest = max(shortcut, key=int)

if mode == "depth":
    # -------------------------------------------------------------------------------------------------------------
    # the depth mode's tables and plots: val accuracy by k (tasks.py) where the other modes have loss

    def by_k(runs, field="accuracy"):
        """{k: (mean, std) over the runs} of a field that holds accuracy by k"""
        return {k: mean_std([run[field][k] for run in runs]) for k in runs[0][field]} if runs else {}

    def cell(stat):
        return "—" if stat is None else f"{stat[0]:.2f} ± {stat[1]:.2f}"

    def learned(runs):
        """How many of the runs learned the task: val accuracy at k = 1 at least learned_accuracy."""
        return sum(run["accuracy"]["1"] >= learned_accuracy for run in runs)

    done = {key: [run for run in runs if run["accuracy"]] for key, runs in groups.items()}
    ks = sorted(shortcut, key=int)
    best_lr = {}  # (scheme, R, p) -> ((learned, mean accuracy over k and seeds), its rate); none with a diverged run
    for (s, r, p, lr), runs in groups.items():
        if len(done[s, r, p, lr]) == len(runs):
            rank = (learned(runs), sum(mean_over_k(run["accuracy"]) for run in runs) / len(runs))
            if rank > best_lr.get((s, r, p), ((-1, -1), None))[0]:
                best_lr[s, r, p] = (rank, lr)
    best = {key: (lr, done[(*key, lr)]) for key, (_, lr) in best_lr.items()}
    first = next(iter(results.values()))
    lines = ["# python -m lab.sweep --mode=depth", "",
             f"Val accuracy by k (the pointers to follow) on the task of {budget} (tasks.py), {n_layer} physical "
             f"blocks looped R times; `untied` is the control with {n_layer}R blocks run once (Pre-LN). Seeds "
             f"{','.join(map(str, seed_list))}, learning rates {', '.join(f'{lr:g}' for lr in lr_list)}"
             + "".join(f" ({s}: {', '.join(f'{lr:g}' for lr in rates)})" for s, rates in own_rates.items())
             + "; mean ± std "
             "over seeds. Chance is 1/chain_values; the best shortcut is the best of the guesses that do not follow "
             "the chains (lab.tasks.shortcuts), on the same val batches.", "",
             f"Each scheme at its best learning rate: where most seeds *learned* the task (val accuracy at k = 1 at "
             f"least {learned_accuracy:g}), then the highest mean accuracy over k; a rate with a diverged run is not "
             f"eligible:", "",
             "| scheme | R | lr | " + " | ".join(f"k={k}" for k in ks) + " | kappa_R | learned |",
             "|---|---|---|" + "---|" * (len(ks) + 2),
             "| best shortcut | | | " + " | ".join(f"{shortcut[k]:.2f}" for k in ks) + " | | |"]
    for s in scheme_list:
        for p in exponent_list:
            for r in loop_list:
                if (s, r, p) in best:
                    lr, runs = best[s, r, p]
                    acc = by_k(runs)
                    lines.append(f"| {scheme_label(s, p)} | {r} | {lr:g} | " + " | ".join(cell(acc[k]) for k in ks)
                                 + f" | {fmt(mean_std([run['kappa'] for run in runs]), 2)} | "
                                 f"{learned(runs)}/{len(runs)} |")
                elif any(key[:3] == (s, r, p) for key in groups):
                    lines.append(f"| {scheme_label(s, p)} | {r} | — | every rate had a diverged run |")
    # the paper's Appendix C on the task: how many seeds learn, by scheme (and exponent p) and R
    lines += ["", f"Seeds that learned the task (val accuracy at k = 1 at least {learned_accuracy:g}) at each "
              f"scheme's best rate, out of the seeds run:", "",
              "| scheme | " + " | ".join(f"R={r}" for r in loop_list) + " |", "|---|" + "---|" * len(loop_list)]
    for s in scheme_list:
        for p in exponent_list:
            cells = [f"{learned(best[s, r, p][1])}/{len(best[s, r, p][1])} (lr {best[s, r, p][0]:g})"
                     if (s, r, p) in best else "—" for r in loop_list]
            lines.append(f"| {scheme_label(s, p)} | " + " | ".join(cells) + " |")
    lines += ["", f"Every run: accuracy at the hardest k = {hardest}, mean accuracy over k, and kappa_R (visit "
              f"alignment, mean over the physical blocks) at the end of training:", "",
              "| scheme | R | lr | seed | k=" + hardest + " | mean over k | kappa_R |", "|---|---|---|---|---|---|---|"]
    for (s, r, p, lr, seed), run in sorted(results.items()):
        if run["accuracy"]:
            lines.append(f"| {scheme_label(s, p)} | {r} | {lr:g} | {seed} | {run['accuracy'][hardest]:.2f} | "
                         f"{mean_over_k(run['accuracy']):.2f} | {run['kappa']:.2f} |")
        else:
            lines.append(f"| {scheme_label(s, p)} | {r} | {lr:g} | {seed} | diverged | | |")
    test_loops = sorted({int(n) for run in results.values() for n in run["test_time"]})
    lines += ["", "Test-time depth: the looped models at their best rate, run at other loop counts than they were "
              "trained with (mean accuracy over k, mean over seeds):", "",
              "| scheme | trained R | " + " | ".join(f"run at {n}" for n in test_loops) + " |",
              "|---|---|" + "---|" * len(test_loops)]
    for (s, r, p), (lr, runs) in best.items():
        if runs and runs[0]["test_time"]:
            # a sweep resumed with other loop counts has tested its earlier runs at fewer of them
            means = [sum(mean_over_k(run["test_time"][str(n)]) for run in runs) / len(runs)
                     if all(str(n) in run["test_time"] for run in runs) else None for n in test_loops]
            lines.append(f"| {scheme_label(s, p)} | {r} | " + " | ".join(
                "—" if m is None else f"**{m:.2f}**" if n == r else f"{m:.2f}" for n, m in zip(test_loops, means))
                + " |")
    write_results(lines)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(s, p) for s in scheme_list for p in exponent_list]
    cols = min(len(panels) + 1, 5)  # rows of 5 panels: a grid of many schemes (variants) stays readable
    rows = -(-(len(panels) + 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 4 * rows), squeeze=False)
    axes = axes.ravel()
    for ax in axes[len(panels) + 1:]:
        ax.axis("off")
    for ax, (s, p) in zip(axes, panels):
        for i, r in enumerate(loop_list):
            if (s, r, p) in best and best[s, r, p][1]:
                acc = by_k(best[s, r, p][1])
                ax.errorbar([int(k) for k in ks], [acc[k][0] for k in ks], yerr=[acc[k][1] for k in ks], marker="o",
                            ms=3, capsize=2, color=plt.cm.viridis(i / max(1, len(loop_list) - 1)),
                            label=f"R={r} (lr {best[s, r, p][0]:g})")
        ax.plot([int(k) for k in ks], [shortcut[k] for k in ks], "k--", lw=1, label="best shortcut")
        ax.set(xlabel="k (pointers to follow)", ylim=(0, 1.02), title=scheme_label(s, p))
        ax.legend(fontsize=7)
    axes[0].set_ylabel("val accuracy (mean ± std over seeds)")
    ax = axes[len(panels)]
    for s, p in panels:
        points = [(r, *mean_std([run["accuracy"][hardest] for run in best[s, r, p][1]])) for r in loop_list
                  if (s, r, p) in best and best[s, r, p][1]]
        if points:
            xs, ms, sd = zip(*points)
            ax.errorbar(xs, ms, yerr=sd, marker="o", capsize=3, label=scheme_label(s, p))
    ax.axhline(shortcut[hardest], color="black", ls="--", lw=1, label="best shortcut")
    ax.set_xscale("log", base=2)
    ax.set_xticks(loop_list, [str(r) for r in loop_list])
    ax.set(xlabel=f"R (unrolled depth {n_layer}R)", ylim=(0, 1.02), title=f"accuracy at the hardest k = {hardest}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "depth.png"), dpi=110)
    plt.close(fig)  # tests run the sweep in-process
    print(f"plot: {os.path.join(out_dir, 'depth.png')}")
    print(f"sweep took {minutes:.1f} min")
    sys.exit(0)


def summary(runs):
    """escaped count, score (final val loss, or accuracy at the hardest k) of all finished runs and of the escaped
    ones, kappa_R of the finished runs"""
    done = [run for run in runs if score(run) is not None]
    return dict(escaped=sum(map(escaped, runs)), runs=len(runs), diverged=len(runs) - len(done),
                score=mean_std([score(run) for run in done]),
                escaped_score=mean_std([score(run) for run in runs if escaped(run)]),
                kappa=mean_std([run["kappa"] for run in done]))


stats = {key: summary(runs) for key, runs in groups.items()}
for key in itertools.product(scheme_list, loop_list, exponent_list, lr_list):
    stats.setdefault(key, summary([]))  # not in the grid (an injected input at R = 1): no runs, no score
sign = -1 if on_chains else 1  # best = lowest sign * score
what, escape_word = (f"accuracy k={hardest}", "above shortcut") if on_chains else ("val loss", "escaped")
tokens = max_iters * batch_size * block_size
if on_chains:
    setting = (f"Val accuracy at the hardest k = {hardest} (the pointers to follow) on the task of {budget} "
               f"(tasks.py), {n_layer} physical blocks looped R times, seeds {','.join(map(str, seed_list))}; mean ± "
               f"std over seeds. *above shortcut* = better than the best guess that does not follow the chains "
               f"({shortcut[hardest]:.2f} at k = {hardest}; chance is 1/chain_values).")
else:
    setting = (f"Final val loss in nats per {unit} after {tokens:,} training tokens ({max_iters} steps of "
               f"{batch_size}x{block_size}, warmup {warmup_iters}, cosine to lr/10), {n_layer} physical blocks of width "
               f"{n_embd}, data/{dataset}, seeds {','.join(map(str, seed_list))}; mean ± std over seeds. Unigram floor "
               f"{floor:.4f} (entropy of the training split's {unit} frequencies); *escaped* = final val loss below "
               f"{floor - escape_margin:.4f} (floor - {escape_margin}).")
lines = [f"# python -m lab.sweep --mode={mode}" + (" --dataset=chains" if on_chains else ""), "",
         setting + " kappa_R: visit alignment at the end of training, mean over the physical blocks (1 = visits "
                   "decorrelated, R = fully aligned).", "",
         f"| scheme | R | p | lr | {escape_word} | {what} (all) | {what} ({escape_word}) | kappa_R |",
         "|---|---|---|---|---|---|---|---|"]
for (s, r, p, lr), st in ((key, st) for key, st in stats.items() if st["runs"]):
    residual = split_scheme(s)[0]
    p_text = f"{p or OWN_EXPONENT[residual]:g}" if residual in OWN_EXPONENT else "—"
    diverged = f" ({st['diverged']} diverged)" if st["diverged"] else ""
    lines.append(f"| {s} | {r} | {p_text} | {lr:g} | {st['escaped']}/{st['runs']}{diverged} | {fmt(st['score'])} | "
                 f"{fmt(st['escaped_score'])} | {fmt(st['kappa'], 2)} |")


def best_rate(s, r, p):
    """(the rate with the best mean score over all seeds (lowest loss, highest accuracy), None), or (None, why there
    is no best rate): a rate where any run diverged is not eligible; on the depth task, a rate is best only where some
    run beat the shortcut (below it, no rate taught the model to follow the chains); a best score that two rates or
    more share names none of them (a model that learned the same at every rate, like one collapsed to a constant
    guess, would otherwise "stay put" at the lowest)."""
    eligible = [(sign * stats[s, r, p, lr]["score"][0], lr) for lr in lr_list
                if stats[s, r, p, lr]["score"] and not stats[s, r, p, lr]["diverged"]]
    if not any(stats[s, r, p, lr]["runs"] for lr in lr_list):
        return None, "not run"
    if not eligible:
        return None, "every rate had a diverged run"
    if on_chains and not any(stats[s, r, p, lr]["escaped"] for lr in lr_list):
        return None, "no run beat the shortcut"
    tied = [lr for v, lr in eligible if v == min(eligible)[0]]
    if len(tied) > 1:
        return None, f"rates {', '.join(f'{lr:g}' for lr in tied)} tie"
    return tied[0], None


if mode in ("lr", "transfer"):
    lines += ["", f"Each scheme at its best learning rate ({'highest' if on_chains else 'lowest'} mean {what} over "
                  f"all seeds):", "",
              f"| scheme | R | best lr | {what} | {escape_word} |", "|---|---|---|---|---|"]
    for s in scheme_list:
        for p in exponent_list:
            for r in loop_list:
                lr, why_none = best_rate(s, r, p)
                if lr is None:
                    lines.append(f"| {scheme_label(s, p)} | {r} | — | no best rate: {why_none} | — |")
                    continue
                edge = " (grid edge)" if len(lr_list) > 1 and lr in (min(lr_list), max(lr_list)) else ""
                best = stats[s, r, p, lr]
                lines.append(f"| {scheme_label(s, p)} | {r} | {lr:g}{edge} | {fmt(best['score'])} | "
                             f"{best['escaped']}/{best['runs']} |")
if mode == "transfer":
    # how far each scheme's best rate moves across the loop counts, in factors of 2 of the grid, and which scheme
    # is best at each R when every scheme gets its own best rate
    lines += ["", "Does the best rate stay put as R grows? (a best rate at the grid's edge is not bracketed)", ""]
    for s in scheme_list:
        for p in exponent_list:
            rates = {r: best_rate(s, r, p)[0] for r in loop_list}
            found = [lr for lr in rates.values() if lr is not None]
            missing = ", ".join(f"R={r}" for r, lr in rates.items() if lr is None)
            if len(found) < 2:  # nothing to compare
                spread = f"no best rate at {missing}" if found else "no best rate"
            else:
                spread = "stays put" if max(found) == min(found) else f"moves by a factor {max(found) / min(found):g}"
                spread += f" (no best rate at {missing})" if missing else ""
            lines.append(f"- {scheme_label(s, p)}: " + ", ".join(f"R={r} {lr:g}" if lr else f"R={r} —"
                                                                    for r, lr in rates.items()) + f": {spread}")
    lines += ["", "Best scheme at each R, each at its own best rate:", ""]
    for r in loop_list:
        ranked = sorted((sign * stats[s, r, p, lr]["score"][0], scheme_label(s, p), lr) for s in scheme_list
                        for p in exponent_list for lr in [best_rate(s, r, p)[0]] if lr is not None)
        without = [scheme_label(s, p) for s in scheme_list for p in exponent_list if best_rate(s, r, p)[0] is None]
        parts = [", ".join(f"{label} {sign * v:.4f} (lr {lr:g})" for v, label, lr in ranked)] if ranked else []
        parts += [f"no best rate: {', '.join(without)}"] if without else []
        lines.append(f"- R={r}: " + "; ".join(parts))
if mode == "loops":
    lines += ["", "Final val loss by loop count (the paper's Table 1 layout):", "",
              "| scheme | " + " | ".join(f"R={r} (N={n_layer * r})" for r in loop_list) + " |",
              "|---|" + "---|" * len(loop_list)]
    for s in scheme_list:
        for p in exponent_list:
            for lr in lr_list:
                cells = []
                for r in loop_list:
                    st = stats[s, r, p, lr]
                    stalled = st["runs"] - st["escaped"]
                    cells.append(fmt(st["score"]) + (f" ({stalled} of {st['runs']} stalled)" if stalled else ""))
                label = scheme_label(s, p) + (f" lr {lr:g}" if len(lr_list) > 1 else "")
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
write_results(lines)

# -----------------------------------------------------------------------------------------------------------------
# plots

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

# every run's training loss: the escape line must fall between the runs that stall and those that learn more
if not on_chains:  # the depth task has no unigram floor to draw
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in results.values():
        if run["curve"]:
            iters, losses = zip(*run["curve"])
            ax.plot(iters, losses, color="tab:blue" if escaped(run) else "tab:red", alpha=0.4, lw=0.8)
    ax.axhline(floor, color="black", ls="--", lw=1, label=f"unigram floor {floor:.3f}")
    ax.axhline(floor - escape_margin, color="gray", ls=":", lw=1, label=f"escape line {floor - escape_margin:.3f}")
    ax.plot([], [], color="tab:blue", label="escaped (final val loss)")
    ax.plot([], [], color="tab:red", label="stalled or diverged")
    ax.set_ylim(floor - 1.0, floor + 0.6)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{mode} sweep: every run's training loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "curves.png"), dpi=110)

fig, ax = plt.subplots(figsize=(6.5, 4))
if mode == "exponent":
    for s in scheme_list:
        for r in loop_list:
            for lr in lr_list:
                ps = [p or OWN_EXPONENT[split_scheme(s)[0]] for p in exponent_list]
                fractions = [stats[s, r, p, lr]["escaped"] / stats[s, r, p, lr]["runs"] if stats[s, r, p, lr]["runs"]
                             else float("nan") for p in exponent_list]  # a cell with no runs is no point, not a 0
                ax.plot(ps, fractions, marker="o", label=f"this repo: {s} R={r} lr {lr:g}")
    ax.plot(list(PAPER_ESCAPED), [n / 5 for n in PAPER_ESCAPED.values()], marker="s", ls="--", color="black",
            label="paper, Appendix C (GPT-2 small, R=3)")
    ax.set_xlabel("exponent p  (alpha = (2N)^p, beta = (8N)^-p; 0.25 = DeepNorm, 0.5 = DeepLoop)")
    ax.set_ylabel("fraction of seeds that escaped the floor")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=8, loc="upper left")
    loss_ax = ax.twinx()
    for s in scheme_list:
        for r in loop_list:
            for lr in lr_list:
                points = [(p or OWN_EXPONENT[s], *stats[s, r, p, lr]["escaped_score"])
                          for p in exponent_list if stats[s, r, p, lr]["escaped_score"]]
                if points:
                    xs, ms, sd = zip(*points)
                    loss_ax.errorbar(xs, ms, yerr=sd, color="tab:green", marker="^", ls=":", capsize=2,
                                     label="mean final val loss of the escaped runs")
    loss_ax.set_ylabel("final val loss of escaped runs", color="tab:green")
    if loss_ax.get_legend_handles_labels()[0]:
        loss_ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"escape fraction against p, {len(seed_list)} seeds per point")
elif mode == "lr":
    for s in scheme_list:
        for p in exponent_list:
            for r, style in zip(loop_list, ("-", "--", ":", "-.") * len(loop_list)):
                points = [(lr, *stats[s, r, p, lr]["score"]) for lr in lr_list if stats[s, r, p, lr]["score"]]
                if points:
                    xs, ms, sd = zip(*points)
                    ax.errorbar(xs, ms, yerr=sd, marker="o", ls=style, capsize=3, label=f"{scheme_label(s, p)} R={r}",
                                color=f"C{scheme_list.index(s)}")
    ax.axhline(floor, color="black", ls="--", lw=1, label="unigram floor")
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final val loss (mean ± std over seeds)")
    ax.set_title("each scheme across learning rates")
    ax.legend(fontsize=8)
elif mode == "transfer":  # one panel per scheme, one line per R: a best rate that stays put lines the minima up
    plt.close(fig)
    panels = [(s, p) for s in scheme_list for p in exponent_list]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.8), sharey=True, squeeze=False)
    for (s, p), ax in zip(panels, axes[0]):
        for r in loop_list:
            points = [(lr, *stats[s, r, p, lr]["score"]) for lr in lr_list if stats[s, r, p, lr]["score"]]
            if points:
                xs, ms, sd = zip(*points)
                ax.errorbar(xs, ms, yerr=sd, marker="o", capsize=2, label=f"R={r}")
        ax.axhline(shortcut[hardest] if on_chains else floor, color="black", ls="--", lw=1)  # the shortcut / floor
        ax.set_xscale("log")
        ax.set_xticks(lr_list, [f"{lr:g}" for lr in lr_list], rotation=45, fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel("peak learning rate")
        ax.set_title(scheme_label(s, p))
    axes[0][0].set_ylabel((f"val accuracy at k = {hardest}" if on_chains else "final val loss") + " (mean ± std)")
    axes[0][0].legend(fontsize=8)
else:
    for s in scheme_list:
        for p in exponent_list:
            for lr in lr_list:
                points = [(r, *stats[s, r, p, lr]["score"]) for r in loop_list if stats[s, r, p, lr]["score"]]
                if points:
                    xs, ms, sd = zip(*points)
                    ax.errorbar(xs, ms, yerr=sd, marker="o", capsize=3, label=scheme_label(s, p))
    ax.set_xticks(loop_list, [str(r) for r in loop_list])
    ax.set_xlabel(f"loop count R (physical blocks fixed at {n_layer})")
    ax.set_ylabel("final val loss (mean ± std over seeds)")
    ax.set_title(f"{tokens:,} tokens per run")
    ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(out_dir, f"{mode}.png"), dpi=110)
plt.close("all")  # the curves' figure too: tests run the sweep in-process
print("plots: " + ", ".join(os.path.join(out_dir, name) for name in [f"{mode}.png"] + ["curves.png"] * (not on_chains)))
print(f"sweep took {minutes:.1f} min")
