"""
Adaptive exit and the last_loop KV cache, measured on a train.py checkpoint, text or task (docs/test_time_depth.md).
On the val batches that train.py evaluates on: val loss (on a task also the accuracy by k) against the mean loops per
position, at fixed loop counts and with adaptive exit at each KL threshold (lab.decode.exit_logits: every position in
parallel, up to max_loops); then the same scored through the KV cache one position at a time, as generation computes
it (teacher forcing), with kv_cache per_visit and last_loop, at the trained loop count and at each threshold.

    python -m lab.exit_eval --out_dir=out-depth-sampled --loops=1,2,3,4,6,8 --exit_thresholds=1e-3,1e-2,1e-1
    python -m lab.exit_eval --out_dir=out-smoke-sampled --png=docs/adaptive_exit_text.png

Each line: how the positions were scored, their mean loops (the spread: standard deviation), val loss, and on a task
the accuracy at k = 1..max_hops. The figure: val loss (text) or the accuracy at the largest k (task) against the mean
loops, and the loops by k (task) or the share of positions at each loop count (text), per threshold.
"""

import os
import sys

import torch
from torch.nn import functional as F

from configurator import configure, die
from lab import require
from dataset import EVAL_SEED, TokenWindows
from model import MAX_LOOPS
from guard import load_checkpoint
from runtime import check_device
from lab.decode import KV_CACHES, exit_logits, new_caches
from lab.tasks import TASKS, accuracy_by_k, format_by_k, hits_by_k, make_task

out_dir = "out-smoke-sampled"  # the train.py run: reads out_dir/ckpt.pt
loops = "1,2,3,4,6,8"  # fixed loop counts, comma-separated
exit_thresholds = "1e-3,1e-2,1e-1"  # KL thresholds of adaptive exit, comma-separated
max_loops = 0  # the most loops adaptive exit runs; 0: the largest of loops
cached_batches = 2  # val batches scored through the KV cache, one position at a time (slow); 0: none
png = ""  # the figure; "": none
device = "cpu"
configure(globals(), sys.argv[1:])

try:
    loop_counts = [int(v) for v in str(loops).split(",")]
    thresholds = [float(v) for v in str(exit_thresholds).split(",")] if exit_thresholds != "" else []
except ValueError:
    die(f"loops must be comma-separated ints and exit_thresholds numbers, got {loops!r} and {exit_thresholds!r}")
# isinstance: the command line can give None
if not (all(1 <= n <= MAX_LOOPS for n in loop_counts) and all(t >= 0 for t in thresholds)
        and isinstance(max_loops, int) and 0 <= max_loops <= MAX_LOOPS
        and isinstance(cached_batches, int) and cached_batches >= 0):
    die(f"need loops from 1 to {MAX_LOOPS} (model.MAX_LOOPS), exit_thresholds >= 0 (0 = off), max_loops from 0 (the "
        f"largest of loops) to {MAX_LOOPS} and cached_batches >= 0, got loops={loops!r} "
        f"exit_thresholds={exit_thresholds!r} max_loops={max_loops!r} cached_batches={cached_batches!r}")
if png:  # checked before the evaluation, which can take minutes
    require("matplotlib")
    from matplotlib.backend_bases import FigureCanvasBase

    folder, suffix = os.path.dirname(png) or ".", os.path.splitext(png)[1][1:].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if not os.path.isdir(folder) or os.path.isdir(png) or not os.access(folder, os.W_OK):
        die(f"--png={png}: cannot write a file there (no writable folder {folder}); create the folder or name "
            f"another file")
    if suffix and suffix not in formats:
        die(f"--png={png}: matplotlib does not write .{suffix} files; name a file ending in one of "
            f"{', '.join(sorted(formats))}")
try:
    check_device(device)
    model, checkpoint = load_checkpoint(f"{out_dir}/ckpt.pt", device)
except (FileNotFoundError, ValueError) as e:
    die(str(e))
model.eval()
config = checkpoint["config"]
max_loops = max_loops or max(loop_counts)
task = make_task(config, "val", EVAL_SEED) if config.get("dataset") in TASKS else None
try:
    data = task or TokenWindows(os.path.join("data", config["dataset"]), "val", config["block_size"], EVAL_SEED)
except (ValueError, FileNotFoundError) as e:
    die(str(e))
batches = [data.batch(index, config["batch_size"]) for index in range(config["eval_iters"])]


def parallel(x, threshold, n_loop):
    """Logits and loops of every position, all positions at once."""
    if threshold:
        logits, _, used = exit_logits(model, x, threshold, n_loop)
        return logits, used
    return model(x, n_loop=n_loop)[0], torch.full_like(x, n_loop)


def cached(x, threshold, n_loop, kv_cache):
    """Logits and loops of every position, fed one at a time through a KV cache, as generate feeds its tokens."""
    caches = new_caches(model, n_loop, kv_cache)
    steps = [exit_logits(model, x[:, t:t + 1], threshold, n_loop, caches=caches) if threshold else
             (model(x[:, t:t + 1], n_loop=n_loop, caches=caches)[0], None, torch.full_like(x[:, :1], n_loop))
             for t in range(x.size(1))]
    return torch.cat([logits for logits, _, _ in steps], 1), torch.cat([used for _, _, used in steps], 1)


@torch.no_grad()
def score(name, run, n_batches):
    """One line and its figures: mean loops, their sd, val loss, accuracy by k (task) and all the loops used."""
    totals, hits, counts, used_all, used_by_k = 0.0, 0, 0, [], {}
    for x, y in batches[:n_batches]:
        logits, used = run(x.to(device))
        totals += F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten(), ignore_index=-1).item()
        used_all.append(used.cpu().flatten().float())
        if task:
            batch_hits, batch_counts = hits_by_k(task, logits.argmax(-1).cpu(), x, y)
            hits, counts = hits + batch_hits, counts + batch_counts
            k = task.hops(x)
            for j in range(1, task.max_hops + 1):
                used_by_k.setdefault(j, []).append(used.cpu()[(k == j) & (y >= 0)].float())
    used = torch.cat(used_all)
    result = dict(name=name, loops=used.mean().item(), sd=used.std(correction=0).item(), loss=totals / n_batches,
                  used=used, accuracy=accuracy_by_k(hits, counts) if task else None,
                  by_k={j: torch.cat(v) for j, v in used_by_k.items()})
    accuracy = f", accuracy by k {format_by_k(result['accuracy'])}" if task else ""
    print(f"{name:>28}: loops {result['loops']:.2f} (sd {result['sd']:.2f}), val loss {result['loss']:.4f}{accuracy}")
    sys.stdout.flush()
    return result


cfg = model.config
print(f"{out_dir}: {cfg.n_layer} blocks x {cfg.n_loop} loops trained ({cfg.residual}), iter {checkpoint['iter_num']}, "
      f"{len(batches)} val batches of {config['batch_size']} x {config['block_size']}; loops: the mean per position")
fixed = [score(f"{n} loops", lambda x, n=n: parallel(x, 0.0, n), len(batches)) for n in loop_counts]
adaptive = [score(f"exit at KL {t:g} (<= {max_loops})", lambda x, t=t: parallel(x, t, max_loops), len(batches))
            for t in thresholds]
through_cache = []
if cached_batches:
    n = min(cached_batches, len(batches))
    print(f"through the KV cache, one position at a time, on the first {n} val batches (parallel first, alike):")
    for threshold, n_loop in ((0.0, cfg.n_loop), *((t, max_loops) for t in thresholds)):
        what = f"exit at KL {threshold:g}" if threshold else f"{n_loop} loops"
        score(f"parallel, {what}", lambda x: parallel(x, threshold, n_loop), n)
        through_cache += [score(f"{kv_cache}, {what}", lambda x, c=kv_cache: cached(x, threshold, n_loop, c), n)
                          for kv_cache in KV_CACHES]

if png:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def metric(result):
        return result["accuracy"][str(task.max_hops)] if task else result["loss"]

    fig, (ax, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax.plot([r["loops"] for r in fixed], [metric(r) for r in fixed], "o-", color="gray", label="fixed loop count")
    ax.plot([r["loops"] for r in adaptive], [metric(r) for r in adaptive], "s-", color="C0",
            label=f"adaptive exit (parallel, <= {max_loops} loops)")
    for r, t in zip(adaptive, thresholds):
        ax.annotate(f"{t:g}", (r["loops"], metric(r)), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("mean loops per position")
    ax.set_ylabel(f"val accuracy at k = {task.max_hops}" if task else "val loss (nats per token)")
    ax.set_title(f"{os.path.basename(os.path.normpath(out_dir))}: quality against depth")
    ax.legend()
    for r, t in zip(adaptive, thresholds):
        if task:
            ks = sorted(r["by_k"])
            right.errorbar(ks, [r["by_k"][j].mean() for j in ks], [r["by_k"][j].std(correction=0) for j in ks],
                           marker="o", capsize=3, label=f"KL {t:g}")
        else:
            share = torch.bincount(r["used"].long(), minlength=max_loops + 1)[1:] / len(r["used"])
            right.plot(range(1, max_loops + 1), share, "o-", label=f"KL {t:g}")
    right.set_xlabel("k (pointers from the value)" if task else "loops")
    right.set_ylabel("loops used (mean, sd)" if task else "share of positions")
    right.set_title("loops by k" if task else "loops per position")
    right.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")
