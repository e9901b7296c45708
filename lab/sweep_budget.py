"""
The tables and the plot of `python -m lab.sweep --mode=budget`: how the gap between each scheme and Pre-LN at one
loop, and each scheme's gain from R = 1 to R = 3, change as the training budget grows.

Runs of the same seed see the same batches and are evaluated on the same val windows, so every difference here is
taken seed by seed (paired) and then averaged over the seeds that both sides have. A scheme on the paper's block
(`+paper`: RMSNorm, RoPE, normalized branch input) is compared with Pre-LN on the same block where the study has it.

The trend of a gap is a straight line in log10(tokens) fitted to its means over the budgets: its slope is the change
per tenfold more training and its root the budget where the line would reach zero. A line through four or five CPU
budgets says nothing certain about a budget thousands of times larger; the table gives the root only to show how
far the paper's budget lies from where the trend points.
"""

import json
import math
import os

import numpy as np

from dataset import SPLITS, TokenWindows

PAPER_TOKENS = 100_000 * 480 * 1024  # the paper's 100K steps of 480 sequences of 1024 tokens: 49B


def neighbours(lr, rates):
    """The grid's nearest rates on each side of lr (which need not be on the grid); past the grid's edge, one more
    step of its spacing."""
    rates = sorted(rates)
    step = rates[1] / rates[0] if len(rates) > 1 else 3.0
    below = max((r for r in rates if r < lr), default=lr / step)
    above = min((r for r in rates if r > lr), default=lr * step)
    return [float(f"{below:.3g}"), float(f"{above:.3g}")]


def rate_at(grid_rate, scheme, steps, cfg):
    """The rate a scheme trains at at a budget: cfg's long_rate past full_grid_until for a long scheme, else the
    grid's."""
    long = cfg["long_rate"] and scheme in cfg["long_schemes"] and steps > cfg["full_grid_until"]
    return cfg["long_rate"] if long else grid_rate


def rate_walk(chosen, rates, mean_at, max_moves=3):
    """The rate a long budget's verdict takes, found on every long seed: the chosen rate and the grid's neighbours on
    each side run on every seed, the lowest mean wins (the chosen rate on a tie), and where a neighbour won, its own
    far neighbour runs too, until the best rate's two neighbours are both worse (at most max_moves moves; past the
    grid's edge, one more step of its spacing, and no further). A chosen rate off the grid (a walk that starts where
    another one ended past the edge) is bracketed all the same. mean_at(lr): the mean final val loss over the long
    seeds, None while one of them has not run, inf where one diverged. -> (the best rate so far, the rates the walk
    has asked for in order, done: True once no rate is still wanted)."""
    asked, best = [], chosen
    for _ in range(max_moves + 1):
        around = [best, *neighbours(best, rates)] if best in rates or best == chosen else [best]
        for lr in around:
            if lr not in asked:
                asked.append(lr)
        means = {lr: mean_at(lr) for lr in around}
        if None in means.values():
            return best, asked, False
        winner = min(around, key=lambda lr: (means[lr], lr != best))
        if winner == best or means[winner] == math.inf:
            return best, asked, True
        best = winner
    return best, asked, True


def coverage(data_dir, block_size, batch_size, steps, seed=0):
    """(the share of the training split a run of `steps` steps ever reads, the share of the bytes it reads that it read
    before): its windows are drawn with replacement (dataset.TokenWindows, one micro-batch a step), so a long budget
    reads some text twice. Measured from the draws themselves, on one seed's."""
    windows = TokenWindows(data_dir, "train", block_size, seed)
    picks = np.concatenate([np.random.default_rng([seed, SPLITS.index("train"), index]).integers(
        windows.ends[-1], size=batch_size) for index in range(steps)])
    reads = np.zeros(windows.tokens + 1, dtype=np.int64)  # +1 at each window's first byte, -1 past its last
    np.add.at(reads, picks, 1)
    np.add.at(reads, picks + block_size + 1, -1)
    seen = np.count_nonzero(np.cumsum(reads))
    return seen / windows.tokens, 1 - seen / (len(picks) * (block_size + 1))


def mean_std(values):
    if not values:
        return None
    m = sum(values) / len(values)
    return m, (float(np.std(values, ddof=1)) if len(values) > 1 else 0.0), len(values)


def t_interval(differences):
    """(mean, half-width of its 95% t-interval, n, two-sided p of a zero mean) of paired differences (one per seed):
    the mean over n seeds with the standard error s / sqrt(n) and Student's t with n - 1 degrees of freedom (n = 3:
    t = 4.30). A difference is a finding only where the interval excludes zero. None for no seeds; for one seed the
    half-width and p are nan (one seed measures no spread)."""
    if not differences:
        return None
    from scipy import stats
    n, m = len(differences), float(np.mean(differences))
    if n < 2:
        return m, math.nan, 1, math.nan
    se = float(np.std(differences, ddof=1)) / math.sqrt(n)
    if se <= 1e-12 * max(1.0, abs(m)):  # no spread but float rounding: the mean is the difference, certain
        return m, 0.0, n, 0.0 if m else 1.0
    p = float(2 * stats.t.sf(abs(m) / se, n - 1))
    return m, float(stats.t.ppf(0.975, n - 1)) * se, n, p


def tenfold_slope(by_bytes):
    """The slope per tenfold bytes of a difference measured seed by seed at several budgets: each seed's least-squares
    line through (log10 bytes, difference) over the budgets, where it has every one, and the t_interval of those
    slopes (paired by seed, like every difference here). by_bytes: {bytes read: {seed: difference}}. None where no
    seed has two budgets."""
    slopes = []
    for seed in set().union(*by_bytes.values()):
        points = [(math.log10(b), values[seed]) for b, values in sorted(by_bytes.items()) if seed in values]
        if len(points) == len(by_bytes) >= 2:
            x, y = np.array(points).T
            slopes.append(float(np.polyfit(x, y, 1)[0]))
    return t_interval(sorted(slopes))


def lead_verdict(lead_sign, by_bytes):
    """How one's lead in a difference moves as training grows, in a sentence. by_bytes: as tenfold_slope's;
    lead_sign: +1 where a positive difference is the lead (phi, a gain), -1 where a negative one is (a loss). The lead
    persists where the longest budget's interval lies on the lead's side of zero, reverses where it lies on the other,
    fades where the slope's interval lies against the lead and the longest budget's holds zero; else it cannot be told
    yet."""
    last = max(by_bytes)
    at_last, trend = t_interval(list(by_bytes[last].values())), tenfold_slope(by_bytes)
    where = f"at {last / 1e6:.1f}M bytes ({fmt(at_last)})"
    if at_last is None or math.isnan(at_last[1]):
        return f"cannot be told yet: {where}, too few seeds for an interval."
    low, high = sorted(lead_sign * (at_last[0] + np.array([-1, 1]) * at_last[1]))
    trend_text = f"slope {fmt(trend)} per tenfold bytes" if trend else "one budget, no slope"
    if low > 0:
        return f"the lead persists {where}; {trend_text}."
    if high < 0:
        return f"the lead reverses {where}; {trend_text}."
    if trend and not math.isnan(trend[1]) and max(lead_sign * (trend[0] + np.array([-1, 1]) * trend[1])) < 0:
        return f"the lead fades: {trend_text}, and {where} the interval holds zero."
    return (f"cannot be told yet: {where} the interval holds zero, and the {trend_text} does not exclude zero; more "
            f"seeds at the longest budget, or a longer budget, would tell it.")


def fmt(stat, digits=3):
    """A paired difference as "mean ± 95% half-width (n, p)"; — without seeds."""
    if stat is None:
        return "—"
    if stat[2] < 2:
        return f"{stat[0]:+.{digits}f} (1 seed)"
    return f"{stat[0]:+.{digits}f} ± {stat[1]:.{digits}f} ({stat[2]}, p {stat[3]:.2g})"


def fmt_loss(stat, digits=4):
    return "—" if stat is None else f"{stat[0]:.{digits}f} ± {stat[1]:.{digits}f} ({stat[2]})"


def fit_line(xs, ys):
    """(slope, intercept) of the least-squares line through the points, None for fewer than two."""
    if len(xs) < 2:
        return None
    slope, intercept = np.polyfit(xs, ys, 1)
    return float(slope), float(intercept)


def report(results, best, cfg):
    """Write cfg['out_dir']/results.md and budget.png from {(scheme, R, p, lr, seed, steps): result} and the best rate
    of each (scheme, R) at the first budget; print the tables."""
    budgets, loops, seeds = cfg["budgets"], cfg["loops"], cfg["seeds"]
    tokens = {steps: steps * cfg["tokens_per_step"] for steps in budgets}

    def rate(s, r, steps):
        return rate_at(best.get((s, r)), s, steps, cfg)

    def losses(s, r, steps, lr=None):
        """{seed: final val loss} of (s, r) at its rate (or lr) at a budget; diverged runs left out"""
        lr = rate(s, r, steps) if lr is None else lr
        out = {}
        for seed in seeds:
            run = results.get((s, r, 0.0, lr, seed, steps))
            if run and run["val_loss"] is not None:
                out[seed] = run["val_loss"]
        return out

    def differences(a, b):
        """{seed: a - b} over the seeds both {seed: loss} have"""
        return {seed: a[seed] - b[seed] for seed in sorted(set(a) & set(b))}

    def paired(a, b):
        """t_interval of a - b over the seeds both have"""
        return t_interval(list(differences(a, b).values()))

    def seed_gains(s, steps):
        """{seed: loss at R = 1 minus loss at R = 3} of s at a budget, over the seeds it has at both"""
        return differences(losses(s, 1, steps), losses(s, 3, steps))

    def baseline(s):
        block = s.partition("+")[2]
        return "preln+" + block if block and "preln+" + block in cfg["schemes"] else "preln"

    pairs = [(s, r) for s in cfg["schemes"] for r in loops if (s, r) in best]
    meta = cfg["meta"]
    lines = ["# python -m lab.sweep --mode=budget", "",
             f"Final val loss in nats per {cfg['unit']} on data/{cfg['dataset']} ({meta['tokens']['train']:,} training "
             f"and {meta['tokens']['val']:,} val {cfg['unit']}s"
             + (f", Python {meta['python']}, text SHA-256 {meta['text_sha256'][:16]}..." if "python" in meta else "")
             + f"), {cfg['n_layer']} physical blocks of width {cfg['n_embd']}, "
             f"{cfg['tokens_per_step']} tokens a step, warmup {cfg['warmup_iters']} steps, cosine to lr/10 at the "
             f"budget's end, {cfg['dtype']}. Budgets in steps: {', '.join(f'{b:,}' for b in budgets)} "
             f"({', '.join(f'{tokens[b] / 1e6:.2f}M' for b in budgets)} tokens). Windows are drawn with "
             f"replacement: a run of each budget reads " + ", ".join(
                 f"{seen:.0%} of the training split ({again:.0%} of its reads repeats)" for seen, again in
                 (coverage(os.path.join("data", cfg["dataset"]), cfg["block_size"], cfg["batch_size"], b)
                  for b in budgets)) + ". "
             f"Every scheme and seed ({','.join(map(str, seeds))}) up to {cfg['full_grid_until']:,} steps; beyond, "
             f"{', '.join(cfg['long_schemes'])} with seeds {','.join(map(str, cfg['long_seeds']))}"
             + (f" at lr {cfg['long_rate']:g}" if cfg["long_rate"] else "") + ". Losses: mean ± std (seeds); "
             f"differences between runs: paired by seed, mean ± the half-width of the 95% t-interval (seeds, two-sided "
             f"p of a zero mean). Unigram floor {cfg['floor']:.4f}.", ""]
    if cfg["report_only"]:
        lines += [f"Report of the runs finished so far ({len(results)}); cells without runs are —.", ""]

    # the rate grid at the first budget
    first = budgets[0]
    lines += [f"Each scheme's rate, chosen on the grid at {first} steps (mean final val loss over seeds; **best**):",
              "", "| scheme | R | " + " | ".join(f"lr {lr:g}" for lr in cfg["rates"]) + " |",
              "|---|---|" + "---|" * len(cfg["rates"])]
    for s in cfg["schemes"]:
        for r in loops:
            cells = []
            for lr in cfg["rates"]:
                runs = [results.get((s, r, 0.0, lr, seed, first)) for seed in seeds]
                done = [run["val_loss"] for run in runs if run and run["val_loss"] is not None]
                diverged = sum(1 for run in runs if run and run["val_loss"] is None)
                text = "—" if not done else f"{sum(done) / len(done):.4f}"
                text = f"**{text}**" if best.get((s, r)) == lr else text
                cells.append(text + (f" ({diverged} diverged)" if diverged else ""))
            lines.append(f"| {s} | {r} | " + " | ".join(cells) + " |")

    # val loss by budget
    lines += ["", "Final val loss at each scheme's rate, by budget:", "",
              "| scheme | R | lr | " + " | ".join(f"{b:,} steps" for b in budgets) + " |",
              "|---|---|---|" + "---|" * len(budgets)]
    for s, r in pairs:
        cells = [fmt_loss(mean_std(list(losses(s, r, b).values()))) for b in budgets]
        moved = rate(s, r, budgets[-1]) != best[s, r]
        lr_text = f"{best[s, r]:g}" + (f"; {cfg['long_rate']:g} past {cfg['full_grid_until']:,}" if moved else "")
        lines.append(f"| {s} | {r} | {lr_text} | " + " | ".join(cells) + " |")

    # the gap to Pre-LN at R = 1 (and at R = 3), with its trend
    gaps, gains = {}, {}
    for s, r in pairs:
        if s != baseline(s) and (baseline(s), r) in best:
            gaps[s, r] = {b: paired(losses(s, r, b), losses(baseline(s), r, b)) for b in budgets}
    for s in cfg["schemes"]:
        if (s, 1) in best and (s, 3) in best:
            gains[s] = {b: paired(losses(s, 1, b), losses(s, 3, b)) for b in budgets}

    def trend(series):
        points = [(math.log10(tokens[b]), stat[0]) for b, stat in series.items() if stat]
        line = fit_line(*zip(*points)) if len(points) > 1 else None
        if line is None:
            return "—", "—", None
        slope, intercept = line
        root = 10 ** (-intercept / slope) if slope and (-intercept / slope) < 15 else None
        last = points[-1][1]
        if last < 0:
            where = "below zero already"
        elif slope < 0:  # shrinking toward zero
            where = f"{root:.2g} tokens" if root else "beyond 1e15 tokens"
        else:
            where = "never: it grows"
        return f"{slope:+.3f}", where, line

    lines += ["", "The gap to Pre-LN (the scheme's loss minus Pre-LN's on the same block and R, seed by seed; positive: "
                  "Pre-LN ahead) and its trend: the slope of a line in log10(tokens) through the means (nats per tenfold "
                  f"tokens) and where that line would cross zero (the paper trained {PAPER_TOKENS / 1e9:.0f}B tokens):",
              "", "| scheme | R | " + " | ".join(f"{b:,} steps" for b in budgets) + " | slope | zero at |",
              "|---|---|" + "---|" * (len(budgets) + 2)]
    lines_of = {}
    for (s, r), series in gaps.items():
        slope, where, line = trend(series)
        lines_of["gap", s, r] = line
        lines.append(f"| {s} | {r} | " + " | ".join(fmt(series[b]) for b in budgets) + f" | {slope} | {where} |")
    lines += ["", "The gain from loops: loss at R = 1 minus loss at R = 3 (positive: the loops help), seed by seed:",
              "", "| scheme | " + " | ".join(f"{b:,} steps" for b in budgets) + " | slope |",
              "|---|" + "---|" * (len(budgets) + 1)]
    for s, series in gains.items():
        slope, _, line = trend(series)
        lines_of["gain", s] = line
        lines.append(f"| {s} | " + " | ".join(fmt(series[b]) for b in budgets) + f" | {slope} |")
    lines += ["", "The gain from loops against Pre-LN's on the same block (scheme's gain minus Pre-LN's, seed by seed; "
                  "positive: the loops pay the scheme more):", "",
              "| scheme | " + " | ".join(f"{b:,} steps" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for s in gains:
        if s != baseline(s) and baseline(s) in gains:
            cells = [fmt(paired(seed_gains(s, b), seed_gains(baseline(s), b))) for b in budgets]
            lines.append(f"| {s} | " + " | ".join(cells) + " |")

    # the rate walk at every budget past the full grid (rate_walk): the chosen rate and its neighbours on every long
    # seed, and on past a neighbour that wins on the mean
    long_budgets = [b for b in budgets[1:] if b > cfg["full_grid_until"]]
    walked = [(s, r) for s, r in pairs if s in cfg["long_schemes"]]
    long_seeds = cfg["long_seeds"]

    def long_mean(s, r, b, lr):
        runs = [results.get((s, r, 0.0, lr, seed, b)) for seed in long_seeds]
        if None in runs:
            return None
        return math.inf if any(run["val_loss"] is None for run in runs) else \
            sum(run["val_loss"] for run in runs) / len(runs)

    walks = {(s, r, b): rate_walk(rate(s, r, b), cfg["rates"], lambda lr: long_mean(s, r, b, lr))
             for s, r in walked for b in long_budgets}
    if walks:
        lines += ["", f"The rate walk at each budget past {cfg['full_grid_until']:,} steps: mean final val loss over "
                      f"seeds {','.join(map(str, long_seeds))} at each rate it asked for (**best**; a rate whose "
                      f"neighbours both lost is where the walk stops):", "",
                  "| scheme | R | steps | rates (mean over the seeds) | best |", "|---|---|---|---|---|"]
        for (s, r, b), (best_lr, asked, done) in walks.items():
            cells = []
            for lr in sorted(asked):
                m = long_mean(s, r, b, lr)
                text = "not run yet" if m is None else "diverged" if m == math.inf else f"{m:.4f}"
                cells.append(f"{lr:g}: " + (f"**{text}**" if lr == best_lr and done else text))
            lines.append(f"| {s} | {r} | {b:,} | " + "; ".join(cells) + f" | {best_lr:g}"
                         + ("" if done else " (walk not finished)") + " |")

    # the verdict at each long budget: each long scheme at the rate its walk found best, seed by seed, and how far
    # the gap moves when the scheme's rate moves one grid step
    checked_gaps, checked_gains = {}, {}
    for b in long_budgets:
        at_best = {(s, r): losses(s, r, b, walks[s, r, b][0]) for s, r in walked}
        gains_at_best = {s: differences(at_best[s, 1], at_best[s, 3]) for s, r in walked
                         if (s, 1) in at_best and (s, 3) in at_best}
        lines += ["", f"At {b:,} steps, each at the rate its walk found best, seed by seed (a difference: mean ± the "
                      f"half-width of its 95% t-interval (seeds, p)); the last column: the gap to Pre-LN with the "
                      f"scheme's rate one grid step lower / higher:", "",
                  "| scheme | R | rate | loss | gap to Pre-LN | gain from R = 1 to 3 | gain minus Pre-LN's | gap one step "
                  "lower / higher |", "|---|---|---|---|---|---|---|---|"]
        for s, r in walked:
            base, (best_lr, _, done) = baseline(s), walks[s, r, b]
            gap = paired(at_best[s, r], at_best[base, r]) if s != base and (base, r) in at_best else None
            gain = t_interval(list(gains_at_best[s].values())) if r == 3 and s in gains_at_best else None
            versus = paired(gains_at_best.get(s, {}), gains_at_best.get(base, {})) if r == 3 and s != base else None
            moved = "—" if gap is None or best_lr not in cfg["rates"] else " / ".join(
                fmt(paired(losses(s, r, b, lr), at_best[base, r])) for lr in neighbours(best_lr, cfg["rates"]))
            if b == long_budgets[-1]:
                checked_gaps[s, r], checked_gains[s] = gap, gain if r == 3 else checked_gains.get(s)
            lines.append(f"| {s} | {r} | {best_lr:g}{'' if done else ' (walk not finished)'} | "
                         f"{fmt_loss(mean_std(list(at_best[s, r].values())))} | {fmt(gap) if s != base else '—'} | "
                         f"{fmt(gain) if r == 3 else '—'} | {fmt(versus) if r == 3 and s != base else '—'} | {moved} |")
    checked_gaps = {k: v for k, v in checked_gaps.items() if v}
    checked_gains = {k: v for k, v in checked_gains.items() if v}

    seconds = {}
    for (s, r, p, lr, seed, steps), run in results.items():
        seconds.setdefault((r, steps), []).append(run["seconds"])
    lines += ["", "Seconds a run took (median over the runs here, one thread each, wall time including any time "
                  "paused):", "", "| R | " + " | ".join(f"{b:,} steps" for b in budgets) + " |",
              "|---|" + "---|" * len(budgets)]
    for r in loops:
        lines.append(f"| {r} | " + " | ".join(f"{np.median(seconds[r, b]):.0f}" if (r, b) in seconds else "—"
                                              for b in budgets) + " |")
    lines += ["", f"{len(results)} runs here; {cfg['wall_minutes']:.1f} min wall in this invocation with "
                  f"{cfg['workers']} worker(s). Command: `{cfg['command']}`"]
    table = "\n".join(lines)
    with open(os.path.join(cfg["out_dir"], "results.md"), "w") as f:
        f.write(table + "\n")
    # every run's result without its training curve, the file --results_from takes
    with open(os.path.join(cfg["out_dir"], "runs.jsonl"), "w") as f:
        for run in sorted(results.values(), key=lambda run: run["name"]):
            f.write(json.dumps({k: v for k, v in run.items() if k != "curve"}) + "\n")
    print(table)
    plot(cfg, losses, gaps, gains, lines_of, tokens, pairs, checked_gaps, checked_gains)


def plot(cfg, losses, gaps, gains, lines_of, tokens, pairs, checked_gaps, checked_gains):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -r requirements-lab.txt)")
        return
    budgets = cfg["budgets"]
    colors = {s: f"C{i}" for i, s in enumerate(cfg["schemes"])}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    for s, r in pairs:
        points = [(tokens[b], *mean_std(list(losses(s, r, b).values()))[:2]) for b in budgets if losses(s, r, b)]
        if points:
            xs, ms, sd = zip(*points)
            ax.errorbar(xs, ms, yerr=sd, marker="o", ms=3, capsize=2, color=colors[s], ls="-" if r == 1 else "--",
                        label=f"{s} R={r}")
    ax.set(xscale="log", xlabel="training tokens", ylabel=f"final val loss (nats per {cfg['unit']})",
           title="val loss at each scheme's rate")
    ax.legend(fontsize=6, ncol=2)
    for ax, series_of, title, key in ((axes[1], gaps, "gap to Pre-LN (+: Pre-LN ahead)", "gap"),
                                      (axes[2], {(s, 1): v for s, v in gains.items()}, "gain from R = 1 to R = 3",
                                       "gain")):
        marked = False
        for (s, r), series in series_of.items():
            points = [(tokens[b], series[b][0], np.nan_to_num(series[b][1])) for b in budgets if series[b]]  # 95% t
            if not points:
                continue
            xs, ms, sd = zip(*points)
            label = f"{s} R={r}" if key == "gap" else s
            ax.errorbar(xs, ms, yerr=sd, marker="o", ms=3, capsize=2, color=colors[s],
                        ls="-" if r == 1 else "--", label=label)
            at_best = checked_gaps.get((s, r)) if key == "gap" else checked_gains.get(s)
            if at_best:  # the longest budget at the rate its walk found best
                ax.errorbar([tokens[budgets[-1]]], [at_best[0]], yerr=[np.nan_to_num(at_best[1])], marker="D", ms=6,
                            mfc="none",
                            capsize=2, color=colors[s], ls="none",
                            label=None if marked else "at the rate the walk found best")
                marked = True
            line = lines_of.get(("gap", s, r) if key == "gap" else ("gain", s))
            if line and key == "gap" and r == 1:
                span = np.array([min(xs), max(xs) * 10])
                ax.plot(span, line[0] * np.log10(span) + line[1], color=colors[s], lw=0.7, ls=":")
        ax.axhline(0, color="black", lw=0.8)
        ax.set(xscale="log", xlabel="training tokens", ylabel="nats", title=title)
        if ax.get_legend_handles_labels()[0]:  # no legend where nothing could be subtracted yet
            ax.legend(fontsize=6)
    for ax in axes:  # a log axis that spans less than a decade labels its minor ticks, and they overlap
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.tight_layout()
    path = os.path.join(cfg["out_dir"], "budget.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")
