"""
How many unique blocks is a loop worth, under DeepLoop and under Pre-LN, and does that change one width up?

    python -m lab.sweep_phi                          # the study: widths 64 and 128, 2 schemes, 3 shapes, 3 seeds
    python -m lab.sweep_phi --widths=64 --seeds=0,1  # any part of it, by override
    python -m lab.sweep_phi --report_only=True       # the tables and the plot of the runs finished so far
    python -m lab.sweep_phi --results_from=docs/runs/phi_study_runs.jsonl   # go on from a study's committed runs
    python -m lab.sweep_phi --widths=64 --budgets=8000,54000 --results_from=docs/runs/phi_budgets_runs.jsonl
                                                     # the same as training grows, to one pass over the corpus

Three shapes on the paper's block (`+paper`: RMSNorm, RoPE, normalized branch input) at the same number of steps:
2 blocks run once (2x1), the same 2 blocks looped 3 times (2x3), and 6 unique blocks run once (6x1, the unrolled
depth of 2x3 with three times its blocks). The loop's worth is

    phi = (L(2x1) - L(2x3)) / (L(2x1) - L(6x1)),

the share of the 4 extra unique blocks' gain that looping the 2 recovers: 0 when the loops buy nothing, 1 when they
buy all that 6 blocks do (with loss linear in log depth, the looped model acts as 2 * 3^phi unique blocks). phi is
taken seed by seed (the three shapes of one seed read the same batches) and reported with its mean and 95%
t-interval (lab.sweep_budget.t_interval), per scheme and width, and so are the differences DeepLoop minus Pre-LN and
how that difference changes from width 64 to 128: the paper's claim, restated, is that DeepLoop's phi is the larger
and that the gap grows with width.

Choosing on one split, reporting on another. The corpus is data/stdlib_bytes_heldout: the standard library's source as
the budget study reads it (the same training split, byte for byte; its SHA-256 is in meta.json), with half of the val
documents held out as a test split (prepare_data.py --test_share=0.5): val 1.0M bytes, test 1.6M. Each (width,
scheme, shape) trains at the rate of its rate walk (lab.sweep_budget.rate_walk: start_rate and the grid's neighbours
on each side on the walk_seeds, the lowest mean final val loss wins, and past a winning neighbour the next rate runs,
until the best rate has both neighbours run); the other seeds then run at that rate. Every loss in the phi table is
the final checkpoint's loss on the whole test split (every byte once, in windows of block_size, but for each shard's
last partial window: 42 of 1,602,346 bytes on stdlib_bytes_heldout), which nothing was chosen on. A run's test
loss is computed once, after it trains, and kept in its result.json.

Budgets. With several (--budgets=8000,54000), each budget is a study of its own whose walks start where the
same cell's walk ended at the budget before (the first budget's as above), and the report adds, for each difference
DeepLoop minus Pre-LN (L(2x3), the loop gain L(2x1) - L(2x3), phi), its interval at every budget, its slope per
tenfold bytes (each seed's least-squares slope, then their t-interval) and a verdict: the lead persists, reverses,
fades, or cannot be told yet (out_dir/budgets.png plots them). The longest budget's runs are started first once their
walks can start: the long end decides the question.

Runs are lab.sweep's (lab/sweep_runs.py): one folder each under out_dir/<cell>/runs (cell: w64_2x3, say), result.json
when done, a checkpoint every checkpoint_minutes to resume from after a stop (SIGTERM or Ctrl-C: the runs stop with
their checkpoints, "stopped; resume with: ..."), every setting and the machine recorded and compared on reuse. The
report (out_dir/results.md, out_dir/phi.png, out_dir/runs.jsonl) is written at the end and with report_only.
"""

import json
import math
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import numpy as np

from configurator import configure, die, require
from dataset import HEADER_BYTES, load_meta
from lab.sweep_budget import coverage, fmt, lead_verdict, mean_std, neighbours, rate_walk, t_interval, tenfold_slope
from lab.sweep_runs import VARIANTS, Runs, split_scheme, variant_settings, write_json
from prepare_data import prepare

# -----------------------------------------------------------------------------------------------------------------
out_dir = "out-sweep-phi"
schemes = "preln+paper,deeploop+paper"
widths = "64,128"
head_size = 16            # n_head = width / head_size: 4 heads at width 64, 8 at 128
shapes = "2x1,2x3,6x1"    # n_layer x n_loop; phi needs exactly these three: (2x1 - 2x3) / (2x1 - 6x1)
learning_rates = "3e-4,1e-3,3e-3,1e-2"  # the grid the walks move on
start_rate = 3e-3         # where the first width's walks start (the budget study's rate); a wider model's walk starts
#                           at the rate the first width's walk found for its scheme and shape
seeds = "0,1,2"
walk_seeds = "0,1"        # the seeds every rate a walk asks for runs on; the others run at the walk's best rate only
budgets = "8000"          # the steps of a run, one budget each, comma-separated: 8,000 steps read 4.1M bytes at 8 x 64
#                           (the whole study at one budget, both widths, in about 10 CPU-hours: docs/text.md)
block_size = 64
batch_size = 8
warmup_iters = 100
eval_iters = 50           # the val batches the walks choose on (25,600 bytes); the test split is read whole
checkpoint_minutes = 3.0
workers = 2               # runs at the same time, one CPU thread each
report_only = False
results_from = ""         # a runs.jsonl this study wrote (docs/runs/phi_study_runs.jsonl): its runs count as done
config = configure(globals(), sys.argv[1:])
# -----------------------------------------------------------------------------------------------------------------
SHAPES_NEEDED = ["2x1", "2x3", "6x1"]
DATASET = "stdlib_bytes_heldout"  # the study's own corpus, which it prepares itself: no other command writes there


def numbers(name, kind):
    try:
        return [kind(v) for v in str(globals()[name]).split(",")]
    except ValueError:
        die(f"{name} must be comma-separated {kind.__name__}s, got {globals()[name]!r}")


def shape_of(text):
    """'2x3' -> (n_layer 2, n_loop 3)"""
    n_layer, _, n_loop = text.partition("x")
    return int(n_layer), int(n_loop)


def phi(short, looped, deep):
    """The loop's worth from the three shapes' losses: (L(2x1) - L(2x3)) / (L(2x1) - L(6x1)); nan where the deep
    model gains nothing over the short one (the share is then undefined)."""
    return (short - looped) / (short - deep) if short != deep else math.nan


def test_loss(run_dir, data_dir, block_size, batch=128):
    """(mean cross-entropy of the run's final checkpoint on the whole test split, in windows of block_size tokens that
    tile each shard once, the number of tokens predicted): a deterministic pass that reads every test byte but each
    shard's last partial window."""
    import torch
    from guard import load_checkpoint
    torch.set_num_threads(1)
    model, _ = load_checkpoint(os.path.join(run_dir, "ckpt.pt"))
    model.eval()
    total, count = 0.0, 0
    for shard in load_meta(data_dir)["shards"]["test"]:
        data = np.fromfile(os.path.join(data_dir, shard["file"]), dtype="<u2", offset=HEADER_BYTES).astype(np.int64)
        n = (len(data) - 1) // block_size  # windows of block_size inputs and their next tokens
        x = torch.from_numpy(data[:n * block_size].reshape(n, block_size))
        y = torch.from_numpy(data[1:n * block_size + 1].reshape(n, block_size))
        with torch.no_grad():
            for i in range(0, n, batch):
                logits, _ = model(x[i:i + batch])
                total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[i:i + batch].flatten(),
                                                           reduction="sum").item()
        count += n * block_size
    return total / count, count


# -----------------------------------------------------------------------------------------------------------------
scheme_list, seed_list, walk_seed_list = schemes.split(","), numbers("seeds", int), numbers("walk_seeds", int)
width_list, lr_list = numbers("widths", int), numbers("learning_rates", float)
budget_list = numbers("budgets", int)
if budget_list != sorted(set(budget_list)) or budget_list[0] < 1:
    die(f"budgets must be positive step counts in increasing order, got {budgets!r}")
for name, values in (("widths", width_list), ("learning_rates", lr_list)):
    if min(values) <= 0:
        die(f"every one of {name} must be above 0, got {globals()[name]!r}")
for name in ("workers", "head_size"):
    if not isinstance(globals()[name], int) or globals()[name] < 1:
        die(f"{name} must be a positive integer, got {globals()[name]!r}")
if sorted(shapes.split(",")) != sorted(SHAPES_NEEDED):
    die(f"shapes must be {','.join(SHAPES_NEEDED)} (phi needs all three), got {shapes!r}")
if not set(walk_seed_list) <= set(seed_list):
    die(f"walk_seeds must be among seeds={seeds}, got {walk_seeds}")
if start_rate not in lr_list:
    die(f"start_rate must be one of learning_rates={learning_rates}, got {start_rate:g}")
for scheme in scheme_list:
    residual, variants = split_scheme(scheme)
    if residual not in ("preln", "deeploop", "deepnorm", "postln", "preln_scaled"):
        die(f"unknown scheme '{scheme}': use e.g. preln+paper or deeploop+paper")
    if unknown := [v for v in variants if v not in VARIANTS]:
        die(f"unknown variant {', '.join(map(repr, unknown))} in scheme '{scheme}': use {', '.join(VARIANTS)}")
for width in width_list:
    if width % head_size:
        die(f"every width must be a multiple of head_size={head_size}, got {width}")
require("matplotlib")
cells = [(w, s) for w in width_list for s in SHAPES_NEEDED]
data_dir = prepare("stdlib", tokenizer="bytes", name=DATASET, test_share=0.5, quiet=True, owner="lab.sweep_phi")
meta = load_meta(data_dir)


def make_runs(width, shape, stop_with=None):
    n_layer, _ = shape_of(shape)
    kw = dict(out_dir=os.path.join(out_dir, f"w{width}_{shape}"), mode="phi", on_chains=False, dataset=DATASET,
              mode_budget={}, depth_config=None, variant_settings=variant_settings, loop_list=[shape_of(shape)[1]],
              checkpoint_minutes=checkpoint_minutes, n_layer=n_layer, n_head=width // head_size, n_embd=width,
              block_size=block_size, batch_size=batch_size, max_iters=budget_list[-1], warmup_iters=warmup_iters,
              eval_iters=eval_iters)
    return Runs(**kw, defaults=Runs(**kw), stop_with=stop_with)


first = make_runs(*cells[0])
runners = {cell: make_runs(*cell, stop_with=first) for cell in cells}  # one signal stops every cell's runs
for runner in runners.values():
    runner.sweep_dtype("float32")  # one precision on every CPU: the study pairs runs across machines
if results_from:  # every cell's lines checked before any is taken
    imported = {cell: runner.results_in(results_from, cell=f"w{cell[0]}_{cell[1]}", needs=("test_loss",))
                for cell, runner in runners.items()}
    for (width, shape), runner in runners.items():
        taken = runner.take(imported[width, shape])
        print(f"{results_from}: {taken} of its {len(imported[width, shape])} runs of w{width}_{shape} taken as done",
              flush=True)
results = {}  # (steps, width, shape, scheme, lr, seed) -> result, with test_loss


def job(steps, width, shape, scheme, lr, seed):
    return scheme, shape_of(shape)[1], 0.0, lr, seed, steps


def with_test_loss(key, result):
    """The result with its test loss, computed once and written into its result.json."""
    if result is None or result.get("val_loss") is None or "test_loss" in result:
        return result
    width, shape = key[1:3]
    run_dir = os.path.join(out_dir, f"w{width}_{shape}", "runs", result["name"])
    if not os.path.isfile(os.path.join(run_dir, "ckpt.pt")):
        die(f"{os.path.join(run_dir, 'result.json')} has no test_loss and the run no checkpoint to compute it from: "
            f"delete {run_dir}, and the study trains that run again")
    result = dict(result, cell=f"w{width}_{shape}")
    result["test_loss"], result["test_tokens"] = test_loss(run_dir, data_dir, block_size)
    write_json(os.path.join(run_dir, "result.json"), result)
    return result


def walk(steps, width, shape, scheme):
    """(best rate so far, the rates the walk asked for, done) of one cell's walk on the walk seeds at a budget; None
    while the walk where this one starts is not done: at the first budget the first width's (start_rate for the first
    width itself), at a later budget the same cell's at the budget before."""
    start = start_rate
    if steps != budget_list[0] or width != width_list[0]:
        previous = walk(budget_list[budget_list.index(steps) - 1], width, shape, scheme) if steps != budget_list[0] \
            else walk(steps, width_list[0], shape, scheme)
        if previous is None or not previous[2]:
            return None
        start = previous[0]

    def mean_at(lr):
        runs = [results.get((steps, width, shape, scheme, lr, seed)) for seed in walk_seed_list]
        if None in runs:
            return None
        losses = [run["val_loss"] for run in runs]
        return math.inf if None in losses else sum(losses) / len(losses)
    return rate_walk(start, lr_list, mean_at)


def wanted():
    """The runs the study wants now, most wanted first: the longest budget whose walks can start (the long end
    decides how a difference moves with training), width by width, each cell's walk, then its other seeds at the
    walk's best rate; within a width the loop gain's two shapes (2x3, 2x1) before 6x1, so that the loop gain, which
    needs only those two, has its verdict before phi has its."""
    jobs = []
    for steps in reversed(budget_list):
        for width in width_list:
            for shape in ("2x3", "2x1", "6x1"):
                for scheme in scheme_list:
                    if (walked := walk(steps, width, shape, scheme)) is None:
                        continue
                    best, asked, done = walked
                    jobs += [(steps, width, shape, scheme, lr, seed) for lr in asked for seed in walk_seed_list]
                    if done:
                        jobs += [(steps, width, shape, scheme, best, seed) for seed in seed_list
                                 if seed not in walk_seed_list]
    return [key for key in jobs if key not in results]


def collect():
    """Every finished run that the study wants, as far as the walks can see: done runs make further ones wanted."""
    while True:
        found = False
        for key in wanted():
            if (result := runners[key[1:3]].done(*job(*key))) is not None:
                results[key] = with_test_loss(key, result)
                found = True
        if not found:
            return


t_start = time.time()
collect()
if not report_only:
    running = {}
    first.catch_signals()
    with ThreadPoolExecutor(workers) as pool:
        while True:
            pending = [key for key in wanted() if key not in running.values()]
            while len(running) < workers and pending and not first.stopping:
                key = pending.pop(0)
                running[pool.submit(lambda k: with_test_loss(k, runners[k[1:3]].train(*job(*k))), key)] = key
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                key = running.pop(future)
                if (result := future.result()) is not None:
                    results[key] = result
    first.end_if_stopped("lab.sweep_phi")


# -----------------------------------------------------------------------------------------------------------------
# the report: at each budget the walks, the losses at each walk's rate, phi and its differences; across budgets how
# DeepLoop's differences move with the bytes read; every run

def seed_losses(steps, width, shape, scheme, field="test_loss"):
    """{seed: loss} of a cell at its walk's best rate at a budget, once the walk is done; {} before."""
    walked = walk(steps, width, shape, scheme)
    if not walked or not walked[2]:
        return {}
    runs = {seed: results.get((steps, width, shape, scheme, walked[0], seed)) for seed in seed_list}
    return {seed: run[field] for seed, run in runs.items() if run and run.get(field) is not None}


def seed_phis(steps, width, scheme):
    """{seed: phi} over the seeds that have all three shapes."""
    short, looped, deep = (seed_losses(steps, width, shape, scheme) for shape in SHAPES_NEEDED)
    return {seed: phi(short[seed], looped[seed], deep[seed]) for seed in seed_list
            if seed in short and seed in looped and seed in deep}


def seed_loop_gains(steps, width, scheme):
    """{seed: L(2x1) - L(2x3)}, what the loops gain, over the seeds that have both shapes."""
    short, looped = seed_losses(steps, width, "2x1", scheme), seed_losses(steps, width, "2x3", scheme)
    return {seed: short[seed] - looped[seed] for seed in short if seed in looped}


def minus(a, b):
    """{seed: a - b} over the seeds both have."""
    return {seed: a[seed] - b[seed] for seed in a if seed in b}


def paired(a, b):
    """t_interval of a - b over the seeds both have."""
    return t_interval(list(minus(a, b).values()))


def fmt_phi(stat):
    return fmt(stat).replace("+", "") if stat else "—"


lines = [f"# How much is a loop worth? (`python -m lab.sweep_phi`)", ""]
budget_text = ", ".join(f"{steps:,}" for steps in budget_list)
lines += [f"data/{DATASET}: train {meta['tokens']['train']:,} bytes, val {meta['tokens']['val']:,}, test "
          f"{meta['tokens']['test']:,} (SHA-256 of test {meta['split_sha256']['test'][:16]}..., of train "
          f"{meta['split_sha256']['train'][:16]}...); {budget_text} steps of {batch_size} x {block_size} bytes, "
          f"warmup {warmup_iters}, float32, one thread a run; heads of {head_size}; rates chosen on the mean final val "
          f"loss ({eval_iters} batches) of seeds {walk_seeds}, every loss below on the whole test split.", ""]
if len(budget_list) > 1:
    lines += ["Windows are drawn with replacement; what each budget reads of the training split (seed 0's draws):",
              "", "| steps | bytes read | share of the split ever read | share of the bytes read that were read before |",
              "|---|---|---|---|"]
    for steps in budget_list:
        seen, repeat = coverage(data_dir, block_size, batch_size, steps)
        lines.append(f"| {steps:,} | {steps * batch_size * block_size / 1e6:.1f}M | {seen:.1%} | {repeat:.1%} |")
    lines.append("")
phis, gains, looped_losses = {}, {}, {}  # (steps, width, scheme) -> {seed: value}
for steps in budget_list:
    at = f" at {steps:,} steps" if len(budget_list) > 1 else ""
    lines += [f"## The rate walks{at}", "", "| width | shape | scheme | rates: mean val loss on the walk seeds | rate |",
              "|---|---|---|---|---|"]
    for width in width_list:
        for shape in SHAPES_NEEDED:
            for scheme in scheme_list:
                walked = walk(steps, width, shape, scheme)
                if walked is None:
                    continue
                best, asked, done = walked
                cells_text = []
                for lr in sorted(asked):
                    vals = [results[steps, width, shape, scheme, lr, seed]["val_loss"] for seed in walk_seed_list
                            if (steps, width, shape, scheme, lr, seed) in results]
                    shown = "—" if not vals else "diverged" if None in vals else f"{np.mean(vals):.4f}"
                    if 0 < len(vals) < len(walk_seed_list):
                        shown += f" ({len(vals)} of {len(walk_seed_list)} seeds)"
                    cells_text.append(f"{lr:g}: {shown}")
                lines.append(f"| {width} | {shape} | {scheme} | {'; '.join(cells_text)} | "
                             f"{f'**{best:g}**' if done else 'walking'} |")
    lines += ["", f"## Test loss at each walk's rate{at} (mean ± std over seeds)", "",
              "| width | scheme | " + " | ".join(SHAPES_NEEDED) + " | machines |", "|---|---|" + "---|" * 4]
    for width in width_list:
        for scheme in scheme_list:
            stats = [mean_std(list(seed_losses(steps, width, shape, scheme).values())) for shape in SHAPES_NEEDED]
            cpus = sorted({(m or {}).get("cpu", "?") for shape in SHAPES_NEEDED
                           for key, run in results.items() if key[:4] == (steps, width, shape, scheme)
                           for m in run.get("machines") or [None]})
            lines.append(f"| {width} | {scheme} | " + " | ".join(
                "—" if not st else f"{st[0]:.4f} ± {st[1]:.4f} ({st[2]})" for st in stats) + f" | {'; '.join(cpus)} |")
    lines += ["", f"## phi = (L(2x1) - L(2x3)) / (L(2x1) - L(6x1)) on the test split{at}", "",
              "phi: mean ± 95% half-width (seeds, p of phi = 0); 2 * 3^phi: the unique blocks the looped model acts "
              "as.", "", "| width | scheme | phi by seed | phi | 2 * 3^phi | L(2x1) - L(6x1) |", "|---|---|---|---|---|---|"]
    for width in width_list:
        for scheme in scheme_list:
            by_seed = phis[steps, width, scheme] = seed_phis(steps, width, scheme)
            gains[steps, width, scheme] = seed_loop_gains(steps, width, scheme)
            looped_losses[steps, width, scheme] = seed_losses(steps, width, "2x3", scheme)
            stat = t_interval(list(by_seed.values()))
            depth_gain = paired(seed_losses(steps, width, "2x1", scheme), seed_losses(steps, width, "6x1", scheme))
            lines.append(f"| {width} | {scheme} | {', '.join(f'{v:.3f}' for v in by_seed.values()) or '—'} | "
                         f"{fmt_phi(stat)} | {f'{2 * 3 ** stat[0]:.2f}' if stat and abs(stat[0]) < 3 else '—'} | "
                         f"{fmt(depth_gain)} |")
    lines += ["", "phi with the looped model one rate step off its walk's rate (2x1 and 6x1 at theirs; the walk seeds, "
                  "by seed and mean):", "", "| width | scheme | lower rate | higher rate |", "|---|---|---|---|"]
    for width in width_list:
        for scheme in scheme_list:
            walked = walk(steps, width, "2x3", scheme)
            if not phis[steps, width, scheme] or not walked:
                continue
            shifted = []
            for lr in neighbours(walked[0], lr_list):
                looped = {seed: results.get((steps, width, "2x3", scheme, lr, seed), {}).get("test_loss")
                          for seed in walk_seed_list}
                short, deep = seed_losses(steps, width, "2x1", scheme), seed_losses(steps, width, "6x1", scheme)
                values = [phi(short[seed], loss, deep[seed]) for seed, loss in looped.items()
                          if loss is not None and seed in short and seed in deep]
                shifted.append(f"{lr:g}: {', '.join(f'{v:.3f}' for v in values)} (mean {np.mean(values):.3f})"
                               if values else f"{lr:g}: —")
            lines.append(f"| {width} | {scheme} | " + " | ".join(shifted + ["—"] * (2 - len(shifted))) + " |")
    if len(scheme_list) == 2:
        other, base = scheme_list[1], scheme_list[0]
        lines += ["", f"## {other} minus {base}{at}", "", "Paired by seed: test loss at each shape, and phi.", "",
                  "| width | " + " | ".join(SHAPES_NEEDED) + " | phi |", "|---|" + "---|" * 4]
        diffs = {width: minus(phis[steps, width, other], phis[steps, width, base]) for width in width_list}
        for width, d in diffs.items():
            shape_gaps = [paired(seed_losses(steps, width, shape, other), seed_losses(steps, width, shape, base))
                          for shape in SHAPES_NEEDED]
            lines.append(f"| {width} | " + " | ".join(fmt(gap) for gap in shape_gaps)
                         + f" | {fmt(t_interval(list(d.values())))} |")
        if len(width_list) == 2:
            lines += ["", f"Change of the difference from width {width_list[0]} to {width_list[1]} (paired by seed): "
                          f"{fmt(paired(diffs[width_list[1]], diffs[width_list[0]]))}."]
    lines.append("")
# across budgets: each difference DeepLoop minus Pre-LN, seed by seed, at every budget


def bytes_read(by_budget):
    """{steps: values} -> {the bytes a run of those steps reads: values}"""
    return {steps * batch_size * block_size: values for steps, values in by_budget.items()}


QUANTITIES = (("L(2x3)", -1, looped_losses), ("loop gain L(2x1) - L(2x3)", 1, gains), ("phi", 1, phis))
across = {}  # (quantity, width) -> {steps: {seed: difference}}
if len(budget_list) > 1 and len(scheme_list) == 2:
    other, base = scheme_list[1], scheme_list[0]
    lines += [f"## Across budgets: {other} minus {base}", "",
              "Each difference paired by seed at each budget; its slope per tenfold bytes is each seed's least-squares "
              "slope over the budgets, mean ± 95% half-width over seeds.", "",
              "| width | difference | " + " | ".join(f"{steps:,} steps" for steps in budget_list)
              + " | slope per tenfold bytes |", "|---|---|" + "---|" * (len(budget_list) + 1)]
    for width in width_list:
        for name, lead_sign, values in QUANTITIES:
            by_budget = across[name, width] = {steps: minus(values[steps, width, other], values[steps, width, base])
                                               for steps in budget_list}
            lines.append(f"| {width} | {name} | " + " | ".join(fmt(t_interval(list(by_budget[steps].values())))
                                                              for steps in budget_list)
                         + f" | {fmt(tenfold_slope(bytes_read(by_budget)))} |")
    lines += ["", "Verdicts (the lead is DeepLoop's: a lower L(2x3), a larger loop gain, a larger phi):", ""]
    for width in width_list:
        lines += [f"- width {width}, {name}: " + lead_verdict(lead_sign, bytes_read(across[name, width]))
                  for name, lead_sign, _ in QUANTITIES]
    lines.append("")
cost = sum(run["seconds"] for run in results.values()) / 3600
lines += [f"{len(results)} runs, {cost:.1f} CPU-hours of training recorded (a run that resumed records only the part "
          f"after its last start). A difference is a finding only where its 95% interval excludes zero.", "", "```",
          "python -m lab.sweep_phi " + " ".join(sys.argv[1:]), "```"]
os.makedirs(out_dir, exist_ok=True)
with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
with open(os.path.join(out_dir, "runs.jsonl.tmp"), "w") as f:
    for key in sorted(results, key=str):
        f.write(json.dumps(dict(results[key], cell=f"w{key[1]}_{key[2]}")) + "\n")
os.replace(os.path.join(out_dir, "runs.jsonl.tmp"), os.path.join(out_dir, "runs.jsonl"))
print("\n".join(lines))

import matplotlib  # noqa: E402  (require() checked it above)
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

groups = [(steps, width) for steps in budget_list for width in width_list]
fig, ax = plt.subplots(figsize=(5.5 if len(groups) <= 2 else 2 + 1.2 * len(groups), 4))
for i, scheme in enumerate(scheme_list):
    for j, (steps, width) in enumerate(groups):
        by_seed, x = phis[steps, width, scheme], j + (i - 0.5) * 0.15
        ax.plot([x] * len(by_seed), list(by_seed.values()), "o", ms=3, color=f"C{i}", alpha=0.5)
        if stat := t_interval(list(by_seed.values())):
            ax.errorbar([x], [stat[0]], yerr=[np.nan_to_num(stat[1])], marker="D", capsize=3, color=f"C{i}",
                        label=scheme if j == 0 else None)
ax.axhline(0, color="black", lw=0.8)
ax.set(xticks=range(len(groups)), xlim=(-0.6, len(groups)), ylabel="phi (share of 4 extra blocks' gain)",
       xticklabels=[f"width {w}" + (f"\n{s:,} steps" if len(budget_list) > 1 else "") for s, w in groups],
       title="the loop's worth: 2x3 against 2x1 and 6x1 (95% t)")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(out_dir, "phi.png"), dpi=110)
written = [os.path.join(out_dir, name) for name in ("results.md", "phi.png", "runs.jsonl")]
if across:
    fig, axes = plt.subplots(1, len(QUANTITIES), figsize=(12, 3.8))
    for ax, (name, _, _) in zip(axes, QUANTITIES):
        for j, width in enumerate(width_list):
            points = [(steps * batch_size * block_size, t_interval(list(across[name, width][steps].values())))
                      for steps in budget_list]
            points = [(b, st) for b, st in points if st]
            if points:
                ax.errorbar([b * (1 + 0.03 * j) for b, _ in points], [st[0] for _, st in points],
                            yerr=[np.nan_to_num(st[1]) for _, st in points], marker="o", capsize=3, color=f"C{j}",
                            label=f"width {width}")
        ax.axhline(0, color="black", lw=0.8)
        ax.set(xscale="log", xlabel="bytes read in training", title=name)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{other} minus {base} as training grows (paired by seed, 95% t)", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "budgets.png"), dpi=110)
    written.append(os.path.join(out_dir, "budgets.png"))
print(f"{', '.join(written)}; {(time.time() - t_start) / 60:.1f} min")
