"""
Training curves of train.py runs, side by side in one PNG: train and val loss against tokens seen, and kappa_R of
each physical block at every evaluation where python -m lab.train recorded it (1: the visits' gradients are
orthogonal; n_loop: they all point one way); below them test-time depth: val loss at each evaluated loop count (train.py's eval_loops) against tokens, and against
the loop count at the last evaluation.

    python -m lab.plot out-smoke
    python -m lab.plot out-deeploop out-deepnorm out-unlooped --png=compare.png

Each run is a folder holding the metrics.jsonl that train.py writes; its legend entry names its residual scheme and
loop count (and the folder, where two runs share both). Runs on a task of tasks.py (config/depth_cpu.py) get a third
panel: the val accuracy by k at the last evaluation, and the best shortcut (dashed). Runs whose diagnostics probe the
stream (lab.probes.linear_probe) get a last one: at the last evaluation, how well a linear read-out recovers each
position's input token (solid) and its index (dashed) from the stream after each visit of the core, printed as a
table too: 1.0, the stream still knows what its cell is; near 0, it no longer does. Needs matplotlib.
"""

import json
import os
import sys

from configurator import configure, die
from lab import require

png = "runs.png"  # where the figure goes


def read_metrics(path):
    """The records of a metrics.jsonl. A last line without its newline is a record cut short (the run was killed
    while writing it; train.py removes it when it resumes): it is left out, with a note."""
    with open(path) as f:
        *lines, last = f.read().split("\n")  # last is "" when the file ends with a newline
    if last:
        print(f"note: {path} ends in a record cut short; left out", file=sys.stderr)
    return [json.loads(line) for line in lines if line]


def sampled_loops(config):
    """How a run drew its training loop counts, for its legend entry; "" for a fixed count (n_loop)."""
    sampling = config.get("loop_sampling", "fixed")
    if sampling == "fixed":
        return ""
    drawn = f"{config['loop_min']}..{config['loop_max']}" if sampling == "uniform" else f"mean {config['loop_mean']:g}"
    backprop = f", backprop {config['backprop_loops']}" if config.get("backprop_loops") else ""
    return f" (trained at {sampling} {drawn}{backprop})"


def layout(config):
    """A run's prelude / core / coda and loop input, for its legend entry; "" for the whole stack looped alone."""
    shape = f", {config['n_prelude']}/{config['n_layer']}/{config['n_coda']} blocks" \
        if config.get("n_prelude") or config.get("n_coda") else ""
    return shape + (f", loop_input={config['loop_input']}" if config.get("loop_input", "none") != "none" else "")


def depth_table(what, rows, name="loop count at test time"):
    """Print {run: {loop count: figure}} as a markdown table, a column per loop count (or per visit: name); nothing
    when rows is empty."""
    if not rows:
        return
    counts = sorted({int(loops) for by_loops in rows.values() for loops in by_loops})
    print(f"\n{what} at the last evaluation, by {name}:\n\n| run | {' | '.join(map(str, counts))} |\n"
          f"|---|{'---|' * len(counts)}")
    for label, by_loops in rows.items():
        print(f"| {label} | " + " | ".join(f"{by_loops[str(c)]:.3f}" if str(c) in by_loops else "" for c in counts)
              + " |")


def curves(run_dir):
    """(config, {kind: [records by step]}) of one run. A resumed run may hold steps twice (those after its
    last checkpoint, run again): the later record of each step wins."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        die(f"no metrics.jsonl in {run_dir}; name folders that train.py wrote (its --out_dir)")
    records = read_metrics(path)
    starts = [r for r in records if r["type"] == "start"]
    if not starts:
        die(f"{path} holds no start record; is it a train.py run?")
    config = starts[-1]["config"]
    by_kind = {}
    for r in records:
        by_kind.setdefault(r["type"], {})[r["iter"]] = r
    return config, {kind: [steps[i] for i in sorted(steps)] for kind, steps in by_kind.items()}


if __name__ == "__main__":
    run_dirs = [a for a in sys.argv[1:] if not a.startswith("--")]
    configure(globals(), [a for a in sys.argv[1:] if a.startswith("--")])
    require("matplotlib")
    if not run_dirs:
        die("name the runs to plot: python -m lab.plot out-a out-b ... (folders that train.py wrote)")
    runs = [(run_dir, *curves(run_dir)) for run_dir in run_dirs]
    labels = [f"{config['residual']}, n_loop={config['n_loop']}" + layout(config) + sampled_loops(config)
              for _, config, _ in runs]
    labels = [label + (f" ({run_dir})" if labels.count(label) > 1 else "")
              for label, (run_dir, _, _) in zip(labels, runs)]

    import matplotlib
    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    from lab.tasks import best_shortcut  # here: it imports torch, which reading metrics does not need

    task_runs = any("accuracy" in r for _, _, kinds in runs for r in kinds.get("eval", []))
    probe_runs = any("token_probe" in r.get("loop", {}) for _, _, kinds in runs for r in kinds.get("eval", []))
    wide = task_runs or probe_runs
    fig, ((ax_loss, ax_kappa, *ax_task), (ax_depth, ax_last, *ax_probe)) = plt.subplots(
        2, 2 + wide, figsize=(13 + 6 * wide, 10))
    for ax, used in ((ax_task, task_runs), (ax_probe, probe_runs)):
        if ax and not used:
            ax[0].axis("off")
    probes = {}  # label -> the last evaluation's probes, for the table
    for color, label, (_, config, kinds) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"] * len(runs),
                                                labels, runs):
        train, evals = kinds.get("train", []), kinds.get("eval", [])
        ax_loss.plot([r["tokens"] for r in train], [r["loss"] for r in train], color=color, alpha=0.35, lw=1)
        ax_loss.plot([r["tokens"] for r in evals], [r["val_loss"] for r in evals], "o-", color=color, ms=3,
                     label=f"{label}: val (train: pale)")
        probed = [r for r in evals if "loop" in r]  # python -m lab.train records them, train.py alone does not
        for block in range(config["n_layer"] if probed else 0):
            ax_kappa.plot([r["tokens"] for r in probed], [r["loop"]["kappa"][block] for r in probed], "o-", color=color,
                          ms=3, alpha=1 - 0.6 * block / config["n_layer"],
                          label=f"{label}: blocks 0-{config['n_layer'] - 1}" if block == 0 else None)
        if evals and "accuracy" in evals[-1]:
            ks = sorted(evals[-1]["accuracy"], key=int)
            ax_task[0].plot([int(k) for k in ks], [evals[-1]["accuracy"][k] for k in ks], "o-", color=color, ms=3,
                            label=f"{label}, step {evals[-1]['iter']}")
            shortcut = best_shortcut(kinds["start"][-1]["shortcuts"])
            ax_task[0].plot([int(k) for k in ks], [shortcut[k] for k in ks], "--", color=color, lw=1)
        if evals and "token_probe" in evals[-1].get("loop", {}):
            probes[label] = evals[-1]["loop"]
            for what, style in (("token_probe", "o-"), ("position_probe", "s--")):
                values = evals[-1]["loop"][what]
                ax_probe[0].plot(range(len(values)), values, style, color=color, ms=3, lw=1.5 if style == "o-" else 1,
                                 label=f"{label}, step {evals[-1]['iter']}" if what == "token_probe" else None)
        evals = [r for r in evals if "val_loss_by_loops" in r]  # runs from before train.py's eval_loops have none
        if evals:
            # a run resumed with other eval_loops has other loop counts before and after: each count's line has the
            # evaluations that ran it
            loop_counts = sorted({loops for r in evals for loops in r["val_loss_by_loops"]}, key=int)
            for i, loops in enumerate(loop_counts):
                points = [r for r in evals if loops in r["val_loss_by_loops"]]
                ax_depth.plot([r["tokens"] for r in points], [r["val_loss_by_loops"][loops] for r in points], "o-",
                              color=color, ms=2, lw=1, alpha=1 - 0.7 * i / len(loop_counts),
                              label=f"{label}: {', '.join(loop_counts)} loops" if i == 0 else None)
            last = evals[-1]["val_loss_by_loops"]
            ax_last.plot(sorted(map(int, last)), [last[loops] for loops in sorted(last, key=int)], "o-",
                         color=color, ms=4, label=f"{label}: step {evals[-1]['iter']}")
    ax_loss.set(xlabel="tokens", ylabel="loss (nats)", title="train and val loss")
    ax_kappa.set(xlabel="tokens", ylabel="kappa_R", title="kappa_R per block (paler: later blocks; python -m lab.train)")
    ax_depth.set(xlabel="tokens", ylabel="val loss (nats)", title="val loss at each test-time loop count (paler: more)")
    ax_last.set(xlabel="loop count at test time", ylabel="val loss (nats)", title="test-time depth, last evaluation")
    if task_runs:
        ax_task[0].set(xlabel="k (pointers to follow)", ylabel="val accuracy", ylim=(0, 1.02),
                       title="accuracy by k (dashed: the best shortcut)")
    if probe_runs:
        ax_probe[0].set(xlabel="visit of the core (0: its input)", ylabel="linear probe accuracy", ylim=(0, 1.02),
                        title="what the stream still holds: its token (solid), its position (dashed)")
    for ax in (ax_loss, ax_kappa, ax_depth, ax_last, *ax_task[:task_runs], *ax_probe[:probe_runs]):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print(f"wrote {png}: {'; '.join(labels)}")
    # the last panel as a table, and on a task the accuracy at its hardest k, for runs evaluated at several loop counts
    lasts = {label: kinds["eval"][-1] for label, (_, _, kinds) in zip(labels, runs) if "eval" in kinds}
    lasts = {label: r for label, r in lasts.items() if len(r.get("val_loss_by_loops", {})) > 1}
    depth_table("val loss", {label: r["val_loss_by_loops"] for label, r in lasts.items()})
    depth_table("val accuracy at the hardest k", {
        f"{label}, k = {max(r['accuracy'], key=int)}": {loops: by_k[max(r["accuracy"], key=int)]
                                                         for loops, by_k in r["accuracy_by_loops"].items()}
        for label, r in lasts.items() if "accuracy_by_loops" in r})
    for what in ("token_probe", "position_probe"):
        depth_table(f"{what} (the stream after each visit of the core; 0: its input)",
                    {label: {str(v): p for v, p in enumerate(loop[what])} for label, loop in probes.items()},
                    name="visit")
