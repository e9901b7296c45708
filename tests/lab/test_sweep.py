"""sweep.py end to end: the tables and plots of each mode on made-up run results (a run whose folder holds
result.json is not trained again, so these tests train nothing), and one tiny real sweep for the train.py runs."""

import json
import math
import os
import re

import numpy as np
import pytest

from dataset import read_shard
from lab.plot import read_metrics
from lab.sweep_runs import Runs
from prepare_data import prepare_builtin_if_missing
from scripts import ROOT, run_forked, run_script

MARGIN = 0.1


@pytest.fixture
def forked_runs(monkeypatch):
    """The sweep's train.py runs forked from this process, not started as new pythons (~2.5 s each, importing torch):
    for tests of what a sweep plans, runs and tables; how it starts its runs is the tiny real sweep's test."""
    monkeypatch.setattr(Runs, "run", lambda self, cmd, env: run_forked(cmd, env))


@pytest.fixture(scope="module")
def floor():
    """The byte entropy of the builtin corpus's training split, counted here independently of sweep.py."""
    data_dir = prepare_builtin_if_missing("builtin_bytes")
    tokens = read_shard(os.path.join(ROOT, data_dir, "train_000000.bin"))
    p = np.unique(tokens, return_counts=True)[1] / len(tokens)
    return float(-(p * np.log(p)).sum())


def sweep(*args):
    return run_script("lab/sweep.py", *args)  # its train.py runs are subprocesses still


MADE_UP = {"max_iters": 0}  # the settings of the made-up runs: sweep_made_up's, the mode's defaults for the others


def write_runs(out, runs, settings=MADE_UP):
    """runs: {(scheme, R, p, lr, seed): final val loss or None (diverged)} -> result.json files like sweep.py's, made
    with settings (the others as the mode's defaults)"""
    for (scheme, n_loop, p, lr, seed), val_loss in runs.items():
        name = f"{scheme}_R{n_loop}_p{p:g}_lr{lr:g}_seed{seed}"
        os.makedirs(out / "runs" / name)
        result = dict(name=name, scheme=scheme, n_loop=n_loop, exponent=p, lr=lr, seed=seed, seconds=1.5,
                      val_loss=val_loss, kappa=None if val_loss is None else 1.0 + n_loop * p,
                      curve=[(0, 5.6), (10, 3.4), (20, 3.3 if val_loss is None else val_loss)], settings=settings)
        (out / "runs" / name / "result.json").write_text(json.dumps(result))


def sweep_made_up(*args):
    """sweep.py over the made-up results only: a run it would have to train means the test's grid is wrong."""
    r = sweep(*args, "--max_iters=0")
    assert " s)\n" not in r.stdout, r.stdout
    return r


def rows(table):
    return [line for line in table.splitlines() if line.startswith("| ")]


def test_exponent_mode_counts_a_run_as_escaped_only_below_the_floor_minus_the_margin(tmp_path, floor):
    out = tmp_path / "exponent"
    line = floor - MARGIN
    write_runs(out, {("deeploop", 3, 0.3, 2e-3, 0): line + 0.001, ("deeploop", 3, 0.3, 2e-3, 1): None,
                     ("deeploop", 3, 0.3, 2e-3, 2): line - 0.001,
                     ("deeploop", 3, 0.5, 2e-3, 0): line - 0.4, ("deeploop", 3, 0.5, 2e-3, 1): line - 0.2,
                     ("deeploop", 3, 0.5, 2e-3, 2): floor})
    r = sweep_made_up("--mode=exponent", f"--out_dir={out}", "--exponents=0.3,0.5", "--learning_rates=2e-3",
                      "--seeds=0,1,2")
    assert r.returncode == 0, r.stderr
    assert f"unigram floor of data/builtin_bytes (train split): {floor:.4f} nats per byte" in r.stdout
    table = (out / "results.md").read_text()
    assert rows(table)[1:] == [
        f"| deeploop | 3 | 0.3 | 0.002 | 1/3 (1 diverged) | {(2 * line) / 2:.4f} ± {0.002 / 2 ** 0.5:.4f} | "
        f"{line - 0.001:.4f} ± 0.0000 | {1.9:.2f} ± 0.00 |",
        f"| deeploop | 3 | 0.5 | 0.002 | 2/3 | {(3 * line - 0.6 + MARGIN) / 3:.4f} ± "
        f"{np.std([line - 0.4, line - 0.2, floor], ddof=1):.4f} | {line - 0.3:.4f} ± {0.2 / 2 ** 0.5:.4f} | "
        f"2.50 ± 0.00 |"]
    assert (out / "exponent.png").stat().st_size > 10000 and (out / "curves.png").stat().st_size > 10000
    # a wider margin turns the run 0.2 below the line into a stalled one, without training anything again
    r = sweep_made_up("--mode=exponent", f"--out_dir={out}", "--exponents=0.3,0.5", "--learning_rates=2e-3",
                      "--seeds=0,1,2", "--escape_margin=0.35")
    assert r.returncode == 0 and "| deeploop | 3 | 0.5 | 0.002 | 1/3 |" in r.stdout


def test_lr_mode_picks_each_schemes_best_rate_and_skips_rates_with_a_diverged_run(tmp_path, floor):
    out = tmp_path / "lr"
    losses = {1e-3: [2.9, 2.8], 3e-3: [2.7, None], 3e-4: [3.0, 3.1]}
    write_runs(out, {(s, r, 0.0, lr, seed): v if s == "deeploop" else floor
                     for s in ("deeploop", "preln") for r in (1, 3) for lr, vs in losses.items()
                     for seed, v in enumerate(vs)})
    r = sweep_made_up("--mode=lr", f"--out_dir={out}", "--schemes=deeploop,preln", "--learning_rates=3e-4,1e-3,3e-3",
                      "--seeds=0,1")
    assert r.returncode == 0, r.stderr
    table = (out / "results.md").read_text()
    assert "| deeploop | 3 | 0.5 | 0.003 | 1/2 (1 diverged) | 2.7000 ± 0.0000 | 2.7000 ± 0.0000 | 1.00 ± 0.00 |" in table
    assert "| preln | 1 | — | 0.001 | 0/2 |" in table
    best = table.split("Each scheme at its best learning rate")[1]
    assert f"| deeploop | 1 | 0.001 | 2.8500 ± {0.1 / 2 ** 0.5:.4f} | 2/2 |" in best
    assert "| preln | 3 | — | no best rate: rates 0.0003, 0.001, 0.003 tie | — |" in best  # all on the floor
    assert (out / "lr.png").stat().st_size > 10000


def test_loops_mode_writes_the_table_1_layout(tmp_path, floor):
    out = tmp_path / "loops"
    write_runs(out, {(s, r, 0.0, 1e-3, seed): (floor if (s, r, seed) == ("deeploop", 3, 1) else 2.5 + r / 100)
                     for s in ("preln", "deeploop") for r in (1, 3) for seed in (0, 1)})
    r = sweep_made_up("--mode=loops", f"--out_dir={out}", "--loops=1,3", "--learning_rates=1e-3", "--seeds=0,1")
    assert r.returncode == 0, r.stderr
    table = (out / "results.md").read_text()
    layout = table.split("Table 1 layout")[1]
    assert "| scheme | R=1 (N=2) | R=3 (N=6) |" in layout
    assert "| preln | 2.5100 ± 0.0000 | 2.5300 ± 0.0000 |" in layout
    assert f"| deeploop | 2.5100 ± 0.0000 | {(2.53 + floor) / 2:.4f} ± " in layout and "(1 of 2 stalled) |" in layout
    assert table.endswith("Command: `python -m lab.sweep --mode=loops --out_dir=" + str(out) + " --loops=1,3 "
                          "--learning_rates=1e-3 --seeds=0,1 --max_iters=0`\n") and table in r.stdout
    assert (out / "loops.png").stat().st_size > 10000


@pytest.mark.parametrize("mode", ["loops", "lr"])
def test_text_modes_table_a_variant_that_is_not_run_at_one_loop(tmp_path, floor, mode):
    """An injected input is never read at R = 1, so preln+add has no runs there: its cells say so (this crashed)."""
    out = tmp_path / mode
    write_runs(out, {("preln", 1, 0.0, 1e-3, 0): 2.5, ("preln", 2, 0.0, 1e-3, 0): 2.6,
                     ("preln+add", 2, 0.0, 1e-3, 0): 2.7})
    r = sweep_made_up(f"--mode={mode}", f"--out_dir={out}", "--schemes=preln,preln+add", "--loops=1,2",
                      "--learning_rates=1e-3", "--seeds=0")
    assert r.returncode == 0, r.stderr
    table = (out / "results.md").read_text()
    assert "| preln+add | 1 | — | 0.001 |" not in table  # no row for runs that were never made
    if mode == "loops":
        assert "| preln+add | — | 2.7000 ± 0.0000 |" in table
    else:
        assert "| preln+add | 1 | — | no best rate: not run | — |" in table
        assert "| preln+add | 2 | 0.001 | 2.7000 ± 0.0000 | 1/1 |" in table


def test_transfer_mode_reads_each_schemes_best_rate_at_each_loop_count(tmp_path, floor):
    out = tmp_path / "transfer"
    rates = (1e-3, 2e-3, 4e-3, 8e-3)
    # preln's optimum halves from R=1 to R=4; preln_scaled's stays at 4e-3 and is lower at R=4, but diverges at 8e-3
    loss = {("preln", 1): [2.9, 2.8, 2.7, 2.75], ("preln", 4): [2.8, 2.6, 2.65, 2.7],
            ("preln_scaled", 1): [2.95, 2.85, 2.75, None], ("preln_scaled", 4): [2.9, 2.7, 2.5, None]}
    write_runs(out, {(s, r, 0.0, lr, seed): None if v is None else v + seed / 100
                     for (s, r), vs in loss.items() for lr, v in zip(rates, vs) for seed in (0, 1)})
    r = sweep_made_up("--mode=transfer", f"--out_dir={out}", "--schemes=preln,preln_scaled", "--loops=1,4",
                      "--learning_rates=1e-3,2e-3,4e-3,8e-3", "--seeds=0,1")
    assert r.returncode == 0, r.stderr
    table = (out / "results.md").read_text()
    best = table.split("Each scheme at its best learning rate")[1]
    assert f"| preln | 1 | 0.004 | 2.7050 ± {0.01 / 2 ** 0.5:.4f} | 2/2 |" in best
    assert "| preln | 4 | 0.002 | 2.6050 ± " in best and "| preln_scaled | 4 | 0.004 | 2.5050 ± " in best
    assert "- preln: R=1 0.004, R=4 0.002: moves by a factor 2" in table
    assert "- preln_scaled: R=1 0.004, R=4 0.004: stays put" in table
    assert "- R=4: preln_scaled 2.5050 (lr 0.004), preln 2.6050 (lr 0.002)" in table
    assert (out / "transfer.png").stat().st_size > 10000


def write_depth_runs(out, runs, settings=MADE_UP):
    """runs: {(scheme, R, lr, seed): accuracy at k = 1, 2 or None (diverged)} -> result.json files like sweep.py's
    depth mode writes, made with settings"""
    for (scheme, n_loop, lr, seed), accuracy in runs.items():
        name = f"{scheme}_R{n_loop}_p0_lr{lr:g}_seed{seed}"
        os.makedirs(out / "runs" / name)
        by_k = None if accuracy is None else {"1": accuracy[0], "2": accuracy[1]}
        result = dict(name=name, scheme=scheme, n_loop=n_loop, exponent=0.0, lr=lr, seed=seed, seconds=1.5,
                      val_loss=None if accuracy is None else 1.0, kappa=None if accuracy is None else n_loop / 2,
                      curve=[(0, 2.0), (10, 1.0)], accuracy=by_k, shortcut={"1": 0.4, "2": 0.25},
                      test_time={} if scheme == "untied" or by_k is None else
                      {str(n): {"1": accuracy[0] * min(n, n_loop) / n_loop, "2": 0.3} for n in (1, 2, 4)},
                      settings=settings)
        (out / "runs" / name / "result.json").write_text(json.dumps(result))


def test_depth_mode_tables_best_rates_test_time_depth_and_plot(tmp_path):
    out = tmp_path / "depth"
    runs = {}
    for seed in (0, 1):
        for r in (1, 2):
            runs["preln", r, 1e-3, seed] = (0.5 + 0.2 * r, 0.3 + 0.1 * r + 0.1 * seed)
            runs["preln", r, 3e-3, seed] = (0.9, 0.9) if seed == 0 else None  # best, but one seed diverged
            runs["deeploop", r, 1e-3, seed] = (0.4, 0.3)
            runs["deeploop", r, 3e-3, seed] = (0.8, 0.2 * r)
        runs["untied", 2, 1e-3, seed] = (1.0, 0.8)
        runs["untied", 2, 3e-3, seed] = (0.6, 0.6)
    write_depth_runs(out, runs)
    r = sweep_made_up("--mode=depth", f"--out_dir={out}", "--schemes=preln,deeploop,untied", "--loops=1,2",
                      "--learning_rates=1e-3,3e-3", "--seeds=0,1")
    assert r.returncode == 0, r.stderr
    table = (out / "results.md").read_text()
    assert table.endswith("--learning_rates=1e-3,3e-3 --seeds=0,1 --max_iters=0`\n") and table in r.stdout
    best = table.split("Each scheme at its best learning rate")[1].split("Every run")[0]
    assert "| best shortcut | | | 0.40 | 0.25 | | |" in best
    # 3e-3 had a diverged run; learned: accuracy at k = 1 >= 0.9
    assert "| preln | 2 | 0.001 | 0.90 ± 0.00 | 0.55 ± 0.07 | 1.00 ± 0.00 | 2/2 |" in best
    assert "| deeploop | 1 | 0.003 | 0.80 ± 0.00 | 0.20 ± 0.00 | 0.50 ± 0.00 | 0/2 |" in best
    assert "| untied | 2 | 0.001 | 1.00 ± 0.00 | 0.80 ± 0.00 | 1.00 ± 0.00 | 2/2 |" in best
    assert "| untied | 1 |" not in table  # the same as Pre-LN at R = 1: not run
    assert "| preln | 1 | 0.003 | 1 | diverged | | |" in table
    assert "| deeploop | 2 | 0.003 | 0 | 0.40 | 0.60 | 1.00 |" in table
    test_time = table.split("Test-time depth")[1]
    assert "| scheme | trained R | run at 1 | run at 2 | run at 4 |" in test_time
    assert f"| preln | 2 | {(0.45 + 0.3) / 2:.2f} | **{(0.9 + 0.3) / 2:.2f}** | {(0.9 + 0.3) / 2:.2f} |" in test_time
    assert "| untied |" not in test_time
    assert (out / "depth.png").stat().st_size > 10000


def test_depth_mode_counts_the_seeds_that_learned_the_task_by_exponent_at_the_rate_where_most_did(tmp_path):
    """The paper's Appendix C on the task: a run has learned when its accuracy at k = 1 is at least learned_accuracy;
    each (p, R) at the rate where most seeds learned, then the best mean accuracy (which alone would pick 1e-3)."""
    out = tmp_path / "appendix-c"
    runs = {}
    for seed in range(5):
        runs["deeploop", 2, 1e-3, seed] = (0.89, 0.89)  # just below the line at every seed
        runs["deeploop", 2, 3e-3, seed] = (0.95, 0.1) if seed < 3 else (0.5, 0.1)  # 3 of 5 learned
        runs["deeploop", 4, 1e-3, seed] = (0.2, 0.2)
        runs["deeploop", 4, 3e-3, seed] = (0.3, 0.2)
    write_depth_runs(out, runs)
    for name in os.listdir(out / "runs"):  # the same runs as p = 0.75 too, with another name and exponent
        result = json.loads((out / "runs" / name / "result.json").read_text())
        result.update(name=name.replace("_p0_", "_p0.75_"), exponent=0.75)
        os.makedirs(out / "runs" / result["name"])
        (out / "runs" / result["name"] / "result.json").write_text(json.dumps(result))
    r = sweep_made_up("--mode=depth", f"--out_dir={out}", "--schemes=deeploop", "--loops=2,4", "--exponents=0,0.75",
                      "--learning_rates=1e-3,3e-3", "--seeds=0,1,2,3,4")
    assert r.returncode == 0, r.stderr
    table = (out / "results.md").read_text()
    assert "| deeploop | 2 | 0.003 | 0.77 ± 0.25 | 0.10 ± 0.00 | 1.00 ± 0.00 | 3/5 |" in table
    learned = table.split("Seeds that learned the task (val accuracy at k = 1 at least 0.9)")[1]
    assert "| scheme | R=2 | R=4 |" in learned
    assert "| deeploop | 3/5 (lr 0.003) | 0/5 (lr 0.003) |" in learned
    assert "| deeploop p=0.75 | 3/5 (lr 0.003) | 0/5 (lr 0.003) |" in learned
    r = sweep_made_up("--mode=depth", f"--out_dir={out}", "--schemes=deeploop", "--loops=2", "--exponents=0",
                      "--learning_rates=1e-3,3e-3", "--seeds=0,1,2,3,4", "--learned_accuracy=0.85")
    assert "| deeploop | 5/5 (lr 0.001) |" in (out / "results.md").read_text()


def test_depth_mode_gives_schemes_rates_of_their_own(tmp_path):
    """--scheme_rates: postln runs at 3e-4 and 1e-4 only (a grid it would have to train at 1e-3 fails the test)."""
    out = tmp_path / "own-rates"
    write_depth_runs(out, {("preln", 2, 1e-3, 0): (1.0, 1.0), ("postln", 2, 3e-4, 0): (0.95, 0.5),
                           ("postln", 2, 1e-4, 0): (0.5, 0.3)})
    r = sweep_made_up("--mode=depth", f"--out_dir={out}", "--schemes=preln,postln", "--loops=2", "--seeds=0",
                      "--learning_rates=1e-3", "--scheme_rates=postln:3e-4,1e-4")
    assert r.returncode == 0, r.stderr
    table = (out / "results.md").read_text()
    assert "learning rates 0.001 (postln: 0.0003, 0.0001);" in table
    assert "| postln | 2 | 0.0003 | 0.95 ± 0.00 | 0.50 ± 0.00 | 1.00 ± 0.00 | 1/1 |" in table
    assert "| preln | 2 | 0.001 | 1.00 ± 0.00 |" in table


def test_variants_combine_and_each_reaches_its_runs_settings(tmp_path, forked_runs):
    """--schemes=postln+add+curriculum+warmup: one real (1-step) run gets every variant's settings, later ones
    winning; at R = 1 a scheme with an injected input is not run."""
    out = tmp_path / "combined"
    r = sweep("--mode=depth", f"--out_dir={out}", "--schemes=postln+add+curriculum+warmup+relative+paper",
              "--loops=1,2", "--learning_rates=1e-3", "--seeds=0", "--max_iters=1", "--batch_size=4",
              "--eval_iters=1")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out / "runs")) == ["postln+add+curriculum+warmup+relative+paper_R2_p0_lr0.001_seed0"]
    config = read_metrics(out / "runs" / os.listdir(out / "runs")[0] / "metrics.jsonl")[0]["config"]
    assert (config["loop_input"], config["chain_curriculum"], config["warmup_iters"], config["chain_pointers"],
            config["norm"], config["position_encoding"], config["norm_branch_input"]) == (
        "add", 750, 500, "relative", "rmsnorm", "rope", True)


def test_transfer_mode_on_the_depth_task_ranks_rates_by_accuracy_at_the_hardest_k(tmp_path):
    out = tmp_path / "transfer-chains"
    # accuracy at k = 2 (the hardest; the shortcut scores 0.25 there) by rate 1e-3, 2e-3, 4e-3; k = 1 says otherwise
    at_k2 = {("preln", 1): [0.3, 0.5, 0.4], ("preln", 2): [0.3, 0.4, 0.6], ("deeploop", 1): [0.2, 0.2, 0.2],
             ("deeploop", 2): [0.1, None, 0.7]}
    write_depth_runs(out, {(s, r, lr, seed): None if v is None else (1 - v, v + seed / 10)
                           for (s, r), vs in at_k2.items() for lr, v in zip((1e-3, 2e-3, 4e-3), vs) for seed in (0, 1)},
                     settings={})
    # the mode's own budget (BUDGETS), not --max_iters=0: every run exists, so nothing is trained
    r = sweep("--mode=transfer", "--dataset=chains", f"--out_dir={out}", "--schemes=preln,deeploop", "--loops=1,2",
              "--learning_rates=1e-3,2e-3,4e-3", "--seeds=0,1")
    assert r.returncode == 0, r.stderr
    assert " s)\n" not in r.stdout and "unigram floor" not in r.stdout
    assert "288 runs" not in r.stdout and "24 runs of config/depth_cpu.py with batch_size=32, max_iters=200, " \
                                         "warmup_iters=50" in r.stdout
    table = (out / "results.md").read_text()
    assert table.startswith("# python -m lab.sweep --mode=transfer --dataset=chains\n")
    assert "| preln | 1 | — | 0.002 | 2/2 | 0.5500 ± 0.0707 | 0.5500 ± 0.0707 | 0.50 ± 0.00 |" in table
    assert "| deeploop | 1 | 0.5 | 0.001 | 1/2 | 0.2500 ± 0.0707 | 0.3000 ± 0.0000 | 0.50 ± 0.00 |" in table
    assert "| deeploop | 2 | 0.5 | 0.002 | 0/2 (2 diverged) | — | — | — |" in table
    best = table.split("Each scheme at its best learning rate (highest mean accuracy k=2 over all seeds)")[1]
    assert "| scheme | R | best lr | accuracy k=2 | above shortcut |" in best
    assert "| preln | 2 | 0.004 (grid edge) | 0.6500 ± 0.0707 | 2/2 |" in best
    assert "| deeploop | 1 | — | no best rate: rates 0.001, 0.002, 0.004 tie | — |" in best
    assert "- preln: R=1 0.002, R=2 0.004: moves by a factor 2" in table
    assert "- deeploop: R=1 —, R=2 0.004: no best rate at R=1" in table
    assert "- R=1: preln 0.5500 (lr 0.002); no best rate: deeploop" in table
    assert "- R=2: preln 0.6500 (lr 0.004), deeploop 0.7500 (lr 0.004)" not in table  # best first, by accuracy
    assert "- R=2: deeploop 0.7500 (lr 0.004), preln 0.6500 (lr 0.004)" in table
    assert (out / "transfer.png").stat().st_size > 10000 and not (out / "curves.png").exists()


def test_transfer_verdict_says_no_best_rate_where_the_rates_tie_or_no_run_beats_the_shortcut(tmp_path):
    out = tmp_path / "transfer-collapsed"
    # accuracy at k = 2 (the shortcut: 0.25) by rate 1e-3, 2e-3, 4e-3, the same for both seeds
    at_k2 = {("preln", 1): [0.3, 0.4, 0.35], ("preln", 2): [0.3, 0.35, 0.4],
             ("deeploop", 1): [0.16, 0.14, 0.14],  # a best rate, but no run above the shortcut
             ("deeploop", 2): [0.3, 0.3, 0.2],  # above the shortcut, but two rates share the best score
             ("deepnorm", 1): [0.14, 0.14, 0.14], ("deepnorm", 2): [0.14, 0.14, 0.14]}  # collapsed: a constant guess
    write_depth_runs(out, {(s, r, lr, seed): (0.5, v) for (s, r), vs in at_k2.items()
                           for lr, v in zip((1e-3, 2e-3, 4e-3), vs) for seed in (0, 1)}, settings={})
    r = sweep("--mode=transfer", "--dataset=chains", f"--out_dir={out}", "--schemes=preln,deeploop,deepnorm",
              "--loops=1,2", "--learning_rates=1e-3,2e-3,4e-3", "--seeds=0,1")
    assert r.returncode == 0, r.stderr
    table = (out / "results.md").read_text()
    best = table.split("Each scheme at its best learning rate")[1]
    assert "| deeploop | 1 | — | no best rate: no run beat the shortcut | — |" in best
    assert "| deeploop | 2 | — | no best rate: rates 0.001, 0.002 tie | — |" in best
    assert "| deepnorm | 2 | — | no best rate: no run beat the shortcut | — |" in best
    assert "- preln: R=1 0.002, R=2 0.004: moves by a factor 2" in table
    assert "- deeploop: R=1 —, R=2 —: no best rate" in table
    assert "- deepnorm: R=1 —, R=2 —: no best rate" in table
    assert "stays put" not in table
    assert "- R=2: preln 0.4000 (lr 0.004); no best rate: deeploop, deepnorm" in table


def test_settings_from_a_config_file_override_the_modes_budget_and_reach_the_depth_tasks_runs(tmp_path, floor):
    out = tmp_path / "transfer"
    write_runs(out, {("preln", r, 0.0, 1e-3, 0): 2.9 for r in (1, 2)}, settings={"max_iters": 7, "batch_size": 8})
    settings = tmp_path / "budget.py"
    settings.write_text("max_iters = 7\nbatch_size = 8\n")  # batch_size as sweep.py's default: still given
    r = sweep(str(settings), "--mode=transfer", f"--out_dir={out}", "--schemes=preln", "--loops=1,2",
              "--learning_rates=1e-3", "--seeds=0")
    assert r.returncode == 0, r.stderr
    assert " s)\n" not in r.stdout  # nothing trained: the runs are the ones above
    assert "after 3,584 training tokens (7 steps of 8x64, " in (out / "results.md").read_text()  # BUDGETS: 300 of 4
    out = tmp_path / "transfer-chains"
    write_depth_runs(out, {("preln", r, 1e-3, 0): (0.5, 0.3) for r in (1, 2)},
                     settings={"n_embd": 48, "block_size": 24})
    settings.write_text("n_embd = 48\nblock_size = 24\n")
    r = sweep(str(settings), "--mode=transfer", "--dataset=chains", f"--out_dir={out}", "--schemes=preln",
              "--loops=1,2", "--learning_rates=1e-3", "--seeds=0")
    assert r.returncode == 0, r.stderr
    assert "2 runs of config/depth_cpu.py with batch_size=32, max_iters=200, warmup_iters=50, n_embd=48, " \
           "block_size=24, " in r.stdout


TINY_REAL = ["--mode=loops", "--schemes=deeploop,preln", "--loops=1,2", "--seeds=0", "--max_iters=4",
             "--warmup_iters=1", "--eval_iters=2", "--n_embd=32", "--block_size=32"]
# one Pre-LN run at R = 2 on the depth task, 80 steps: far enough that float32 breaks some of the near ties between
# values the other way than bfloat16 does (at this seed; at seed 2, say, none)
TINY_DEPTH = ["--mode=depth", "--schemes=preln", "--loops=2", "--seeds=1337", "--learning_rates=3e-3",
              "--max_iters=80", "--warmup_iters=2", "--eval_iters=4", "--batch_size=8", "--n_embd=32"]
# started with the session (conftest.py): its four train.py processes take ~10 s; the depth task's two, ~15 s
EARLY = {"test_a_tiny_real_sweep_records_kappa_and_resumes":
         lambda folder: [["-m", "lab.sweep", f"--out_dir={folder / 'real'}", *TINY_REAL]],
         "test_depth_task_runs_are_tested_in_their_precision_measured_at_their_shapes": lambda folder: [
             ["-m", "lab.sweep", f"--out_dir={folder / 'bfloat16'}", *TINY_DEPTH, "--dtype=bfloat16"],
             ["-m", "lab.sweep", f"--out_dir={folder / 'auto'}", *TINY_DEPTH, "--max_iters=2", "--batch_size=4"]]}


def test_a_tiny_real_sweep_records_kappa_and_resumes(early):
    r, folder = early
    out = folder / "real"
    args = [f"--out_dir={out}", *TINY_REAL]
    assert r.returncode == 0, r.stderr
    result = json.loads((out / "runs" / "deeploop_R2_p0_lr0.001_seed0" / "result.json").read_text())
    assert result["n_loop"] == 2 and result["exponent"] == 0 and 0 <= result["kappa"] <= 2
    assert 0 < result["val_loss"] < 10 and [i for i, _ in result["curve"]] == [0, 1, 2, 3]
    preln = json.loads((out / "runs" / "preln_R1_p0_lr0.001_seed0" / "result.json").read_text())
    assert preln["kappa"] == pytest.approx(1.0)  # one visit per block: nothing to align
    assert r.stdout.count(" s)\n") == 4
    # one precision for all runs, measured once by the sweep (which one depends on this CPU)
    dtype = result["dtype"]
    assert f"dtype {dtype} for every run: training steps of this model on " in r.stdout or \
        f"dtype float32 for every run: this CPU has no bfloat16 instructions" in r.stdout  # then not measured
    assert {records[0]["config"]["dtype"] for records in (read_metrics(out / "runs" / name / "metrics.jsonl")
                                                          for name in os.listdir(out / "runs"))} == {dtype}
    r = sweep(*args)  # finished runs are not trained again, and the sweep keeps their precision
    assert r.returncode == 0 and " s)\n" not in r.stdout
    assert f"dtype {dtype} for every run: the precision of the runs in {out}" in r.stdout
    # a run the sweep interrupted (its folder holds a checkpoint, no result.json) resumes from that checkpoint: here
    # the last step's, so it trains nothing more and reads the same final evaluation
    run_dir = out / "runs" / "preln_R1_p0_lr0.001_seed0"
    (run_dir / "result.json").unlink()
    r = sweep(*args)
    assert r.returncode == 0 and r.stdout.count(" s)\n") == 1, r.stderr
    assert json.loads((run_dir / "result.json").read_text())["val_loss"] == preln["val_loss"]
    starts = [record for record in read_metrics(run_dir / "metrics.jsonl") if record["type"] == "start"]
    assert [start["resumed"] for start in starts] == [False, True] and not (run_dir / "previous-1").exists()
    assert result["machines"] == [starts[0]["machine"]] and result["machines"][0]["threads"] == 1
    other = "bfloat16" if dtype == "float32" else "float32"
    r = sweep(*args, f"--dtype={other}", "--loops=1,2,3")
    assert r.returncode == 2 and r.stderr == f"error: {out} holds runs in {dtype}; a sweep keeps one precision: " \
                                             f"leave --dtype at auto or choose another --out_dir\n"


def test_depth_task_runs_are_tested_in_their_precision_measured_at_their_shapes(early):
    r, folder = early
    assert r.returncode == 0, r.stderr
    result = json.loads((folder / "bfloat16" / "runs" / "preln_R2_p0_lr0.003_seed1337" / "result.json").read_text())
    assert result["dtype"] == "bfloat16" and set(result["test_time"]) == {"2", "4"}
    assert result["test_time"]["2"] == result["accuracy"]  # at its own loop count, what train.py evaluated
    # the precision measured on the runs' model and batch: 4 sequences of config/depth_cpu.py's 16 cells (not of
    # sweep.py's block_size 64)
    assert re.search(r"for every run: training steps of this model on \d of the batch's 4 sequences of 16 tokens",
                     r.stdout) or "for every run: this CPU has no bfloat16 instructions" in r.stdout, r.stdout


@pytest.mark.parametrize("args,message", [
    (["--loops=1,two"], "loops must be comma-separated ints like 1,3,5,7, got '1,two'"),
    (["--mode=width"], "unknown mode 'width'; use --mode=exponent, --mode=lr, --mode=loops, --mode=transfer, "
                       "--mode=depth or --mode=budget"),
    (["--schemes=rival"], "unknown scheme 'rival' in --schemes; use deeploop, deepnorm, postln, preln, "
                          "preln_scaled"),
    (["--mode=loops", "--schemes=untied"],
     "unknown scheme 'untied' in --schemes; use deeploop, deepnorm, postln, preln, preln_scaled"),
    (["--mode=lr", "--dataset=chains"], "--dataset=chains (the depth task) applies to --mode=depth and "
                                        "--mode=transfer, not --mode=lr; use a text dataset such as builtin_bytes"),
    (["--mode=lr", "--schemes=preln", "--exponents=0.3"],
     "--exponents apply to deeploop and deepnorm only, not preln; drop it from --schemes"),
    (["--mode=depth", "--schemes=untied", "--loops=1"],
     "the grid has no runs: untied at R = 1 would be Pre-LN at R = 1, and an injected input is never read at R = 1, so "
     "they run at loop counts above 1 only; add one to --loops"),
    (["--dataset=nonexistent"], "dataset data/nonexistent not found (no data/nonexistent/meta.json): prepare it "
                                "with: python prepare_data.py <files> --out=data/nonexistent"),
    (["--schemes=deeploop+add+gate"], "unknown variant 'gate' in --schemes=deeploop+add+gate; use add, concat, 121, "
                                      "huginn, paper, relative, curriculum, warmup after a +"),
    (["--mode=loops", "--schemes=deeploop+curriculum"],
     "variant 'curriculum' in --schemes=deeploop+curriculum is for the depth task: use it with --mode=depth"),
    (["--mode=depth", "--schemes=preln", "--scheme_rates=postln:1e-3"],
     "scheme_rates names 'postln', which is not in --schemes=preln"),
    (["--mode=depth", "--schemes=preln", "--scheme_rates=preln:fast"],
     "scheme_rates must be scheme:rates entries separated by ';', like \"postln:3e-4,1e-3;deeploop:1e-3\", got "
     "'preln:fast'"),
    (["--mode=lr", "--scheme_rates=preln:1e-3"],
     "scheme_rates apply to --mode=depth, not --mode=lr; give every scheme --learning_rates"),
    (["--mode=depth", "--schemes=untied+add"], "the untied control takes no variant: use --schemes=untied, not "
                                               "untied+add"),
])
def test_bad_settings_are_one_line_errors(args, message):
    r = sweep(*args)
    assert r.returncode == 2
    assert r.stderr == f"error: {message}\n"


def test_a_variant_runs_its_model_settings_and_labels_its_rows(tmp_path, forked_runs):
    """--schemes=preln+huginn: one real (2-step) run on the depth task trains Huginn's layout, and the tables name it"""
    out = tmp_path / "variant"
    r = sweep("--mode=depth", f"--out_dir={out}", "--schemes=preln+huginn", "--loops=2", "--learning_rates=1e-3",
              "--seeds=0", "--max_iters=2", "--batch_size=4", "--eval_iters=1")
    assert r.returncode == 0, r.stderr
    start = read_metrics(out / "runs" / "preln+huginn_R2_p0_lr0.001_seed0" / "metrics.jsonl")[0]
    assert (start["config"]["n_prelude"], start["config"]["n_coda"], start["config"]["loop_input"]) == (1, 1, "concat")
    assert start["config"]["residual"] == "preln"
    assert "| preln+huginn | 2 | 0.001 |" in (out / "results.md").read_text()
    # at R = 1 an injected input is never read: the sweep does not run it
    r = sweep_made_up("--mode=depth", f"--out_dir={out}", "--schemes=preln+add", "--loops=1", "--seeds=0",
                      "--learning_rates=1e-3")
    assert r.returncode == 2 and r.stderr.startswith("error: the grid has no runs: untied at R = 1 would be Pre-LN")


def write_budget_runs(out, runs, settings={"dataset": "builtin_bytes"}):
    """runs: {(scheme, R, lr, seed, steps): final val loss} -> result.json files like the budget mode's, made with
    settings (BUDGET_ARGS')"""
    for (scheme, n_loop, lr, seed, steps), val_loss in runs.items():
        name = f"{scheme}_R{n_loop}_p0_lr{lr:g}_seed{seed}_it{steps}"
        os.makedirs(out / "runs" / name)
        result = dict(name=name, scheme=scheme, n_loop=n_loop, exponent=0.0, lr=lr, seed=seed, steps=steps,
                      seconds=2.0, val_loss=val_loss, kappa=1.0, curve=[(0, 5.6), (steps, val_loss)],
                      val_curve=[(steps, val_loss)], settings=settings)
        (out / "runs" / name / "result.json").write_text(json.dumps(result))


BUDGET_ARGS = ["--mode=budget", "--dataset=builtin_bytes", "--schemes=preln,deeploop", "--loops=1,3",
               "--learning_rates=1e-3,3e-3", "--seeds=0,1", "--budgets=10,100,1000", "--full_grid_until=100",
               "--long_schemes=preln,deeploop", "--long_seeds=0"]


def test_budget_mode_reports_the_gap_to_preln_its_trend_and_the_gain_from_loops(tmp_path):
    """Made-up runs: Pre-LN at R = 1 loses 3.0 / 2.5 / 2.0 over the budgets, DeepLoop 0.3 / 0.2 / 0.1 more (a gap
    that shrinks by 0.1 per tenfold budget, so that its line reaches zero at 10^3 times the first budget's tokens);
    R = 3 takes 0.05 off Pre-LN and 0.15 off DeepLoop; the rate 1e-3 is 0.5 worse everywhere; seed 1 is 0.02 worse
    than seed 0. The grid's best rate, 3e-3, is the only one the longer budgets run."""
    out = tmp_path / "budget"
    runs = {}
    for s, gap, gain in (("preln", (0.0, 0.0, 0.0), 0.05), ("deeploop", (0.3, 0.2, 0.1), 0.15)):
        for r in (1, 3):
            for i, steps in enumerate((10, 100, 1000)):
                for seed in ((0, 1) if steps <= 100 else (0,)):
                    loss = 3.0 - 0.5 * i + gap[i] - (gain if r == 3 else 0) + 0.02 * seed
                    runs[s, r, 3e-3, seed, steps] = loss
                    if steps == 10:
                        runs[s, r, 1e-3, seed, steps] = loss + 0.5
    write_budget_runs(out, runs)
    r = sweep(*BUDGET_ARGS, f"--out_dir={out}", "--report_only=True")
    assert r.returncode == 0, r.stderr
    assert " s)\n" not in r.stdout  # nothing trained
    table = (out / "results.md").read_text()
    assert "| preln | 1 | 3.5100 | **3.0100** |" in table  # the grid at 10 steps, mean over seeds 0 and 1
    assert "| deeploop | 1 | 0.003 | 3.3100 ± 0.0141 (2) | 2.7100 ± 0.0141 (2) | 2.1000 ± 0.0000 (1) |" in table
    gap = table.split("The gap to Pre-LN")[1]
    # 10 steps of 512 tokens is 5,120 tokens: the line through +0.3, +0.2, +0.1 reaches zero at 5.12e6 tokens
    # (differences without spread: p 0; one seed: no interval)
    assert "| deeploop | 1 | +0.300 ± 0.000 (2, p 0) | +0.200 ± 0.000 (2, p 0) | +0.100 (1 seed) | -0.100 | 5.1e+06 " \
           "tokens |" in gap
    assert "| deeploop | 3 | +0.200 ± 0.000 (2, p 0) | +0.100 ± 0.000 (2, p 0) | +0.000 (1 seed) |" in gap
    gain = table.split("The gain from loops: ")[1]
    assert "| preln | +0.050 ± 0.000 (2, p 0) | +0.050 ± 0.000 (2, p 0) | +0.050 (1 seed) | +0.000 |" in gain
    assert "| deeploop | +0.150 ± 0.000 (2, p 0) | +0.150 ± 0.000 (2, p 0) | +0.150 (1 seed) | +0.000 |" in gain
    assert "| deeploop | +0.100 ± 0.000 (2, p 0) | +0.100 ± 0.000 (2, p 0) | +0.100 (1 seed) |" in table.split(
        "against Pre-LN's on the same block")[1]
    # the rate walk at the longest budget, 1,000 steps, asks for the grid's neighbours, not run yet
    assert "| preln | 1 | 1,000 | 0.001: not run yet; 0.003: 2.0000; 0.009: not run yet | 0.003 (walk not " \
           "finished) |" in table
    assert (out / "budget.png").stat().st_size > 20000
    # long_rate moves the long schemes' rate past full_grid_until: 1,000 steps read 1e-3, its check 3e-3 above it
    r = sweep(*BUDGET_ARGS, f"--out_dir={out}", "--report_only=True", "--long_rate=1e-3")
    assert r.returncode == 0, r.stderr
    assert "| preln | 1 | 0.003; 0.001 past 100 | 3.0100 ± 0.0141 (2) | 2.5100 ± 0.0141 (2) | — |" in r.stdout
    assert "| preln | 1 | 1,000 | 0.000333: not run yet; 0.001: not run yet; 0.003: 2.0000 | 0.001 (walk not " \
           "finished) |" in r.stdout
    r = sweep(*BUDGET_ARGS, f"--out_dir={out}", "--report_only=True")
    # one run of the walk arrives: it is read, and the walk waits for the other
    write_budget_runs(out, {("preln", 1, 9e-3, 0, 1000): 1.95})
    r = sweep(*BUDGET_ARGS, f"--out_dir={out}", "--report_only=True")
    assert "| preln | 1 | 1,000 | 0.001: not run yet; 0.003: 2.0000; 0.009: 1.9500 | 0.003 (walk not finished) |" \
        in r.stdout
    # the study goes on elsewhere from its runs.jsonl: the same tables, and a run of that machine's own is kept
    runs_file = out / "runs.jsonl"
    assert len(runs_file.read_text().splitlines()) == len(runs) + 1
    elsewhere = tmp_path / "elsewhere"
    write_budget_runs(elsewhere, {("preln", 1, 3e-3, 0, 1000): 1.9})
    r = sweep(*BUDGET_ARGS, f"--out_dir={elsewhere}", f"--results_from={runs_file}", "--report_only=True")
    assert r.returncode == 0, r.stderr
    assert f"{runs_file}: {len(runs)} of its {len(runs) + 1} runs taken as done" in r.stdout
    assert "| preln | 1 | 1,000 | 0.001: not run yet; 0.003: 1.9000; 0.009: 1.9500 | 0.003 (walk not finished) |" \
        in r.stdout
    bad = sweep(*BUDGET_ARGS, f"--out_dir={elsewhere}", f"--results_from={tmp_path / 'none.jsonl'}")
    assert (bad.returncode, bad.stderr) == (2, f"error: --results_from={tmp_path / 'none.jsonl'} is not a readable "
                                               f"runs.jsonl (FileNotFoundError): name the file a budget study wrote, "
                                               f"e.g. docs/runs/budget_study_runs.jsonl\n")


def test_budget_mode_trains_its_plan_in_order_and_resumes(tmp_path, forked_runs):
    """A real budget study of 2-step runs: the grid, then the best rate at the longer budget, then the neighbours;
    a second invocation trains nothing."""
    out = tmp_path / "budget_real"
    args = ["--mode=budget", "--dataset=builtin_bytes", "--schemes=preln", "--loops=1", "--learning_rates=1e-3,3e-3",
            "--seeds=0", "--budgets=2,3", "--full_grid_until=2", "--long_schemes=preln", "--long_seeds=0",
            "--warmup_iters=1", "--eval_iters=1", f"--out_dir={out}", "--workers=1"]
    r = sweep(*args)
    assert r.returncode == 0, r.stderr
    trained = [line.split()[0] for line in r.stdout.splitlines() if line.endswith(" s)")]
    best = float(trained[2].split("_lr")[1].split("_")[0])
    assert trained[:2] == ["preln_R1_p0_lr0.001_seed0_it2", "preln_R1_p0_lr0.003_seed0_it2"]
    assert best in (1e-3, 3e-3) and trained[2] == f"preln_R1_p0_lr{best:g}_seed0_it3"
    around = ["0.000333", "0.003"] if best == 1e-3 else ["0.001", "0.009"]  # lower side first; past the grid's edge,
    #                                                                             its spacing
    assert trained[3:] == [f"preln_R1_p0_lr{lr}_seed0_it3" for lr in around]
    meta = json.loads((out / "runs" / trained[2] / "result.json").read_text())
    assert meta["steps"] == 3 and meta["dtype"] == "float32" and meta["val_curve"][-1][0] == 3
    r = sweep(*args)
    assert r.returncode == 0 and " s)\n" not in r.stdout


@pytest.mark.parametrize("args,message", [
    (["--budgets=100,10"], "budgets must be distinct positive step counts, shortest first, like "
                           "400,1350,4300,13500,43000; got 100,10"),
    (["--long_schemes=postln", "--schemes=preln,deeploop"], "long_schemes must be among --schemes=preln,deeploop; "
                                                             "got postln"),
    (["--long_rate=5e-3"], "long_rate must be one of --learning_rates=0.0003,0.001,0.003,0.01, so that its rate "
                           "check has the grid's neighbours; got 0.005"),
    (["--schemes=deeploop", "--long_schemes=deeploop"], "the budget mode measures every scheme against preln: keep "
                                                        "preln in --schemes"),
])
def test_budget_mode_bad_settings_are_one_line_errors(args, message):
    r = sweep("--mode=budget", "--dataset=builtin_bytes", *args)
    assert (r.returncode, r.stderr) == (2, f"error: {message}\n")


def test_report_only_is_for_the_budget_mode():
    r = sweep("--mode=loops", "--report_only=True")
    assert r.returncode == 2 and r.stderr.startswith("error: report_only applies to --mode=budget")


def test_t_interval_and_p_on_made_up_differences_match_hand_values():
    """Differences 1, 2, 3: mean 2, s = 1, se = 1/sqrt(3); t(0.975, 2 df) = 4.3027, so the half-width is 2.4841;
    t = 2 sqrt(3) = 3.4641, and with 2 degrees of freedom P(T <= t) = 1/2 + t / (2 sqrt(2 + t^2)) exactly, so
    p = 1 - t / sqrt(14) = 0.07418."""
    from lab.sweep_budget import fmt, t_interval
    m, half, n, p = t_interval([1.0, 2.0, 3.0])
    assert (m, n) == (2.0, 3) and half == pytest.approx(4.302653 / 3 ** 0.5, rel=1e-6)
    assert p == pytest.approx(1 - 2 * 3 ** 0.5 / 14 ** 0.5, rel=1e-9)
    assert fmt((m, half, n, p)) == "+2.000 ± 2.484 (3, p 0.074)"
    m, half, n, p = t_interval([0.0361, 0.0378, 0.0322])  # DeepLoop's gap at R = 1 and 43,000 steps: 4 df fewer
    assert m - half > 0 and p < 0.01  # a finding: the interval excludes zero
    assert t_interval([]) is None and fmt(t_interval([0.5])) == "+0.500 (1 seed)"
    assert t_interval([0.1, 0.1, 0.1])[3] == 0.0  # no spread: a nonzero mean is certain


def test_the_rate_walk_brackets_the_lowest_mean_on_every_seed():
    from lab.sweep_budget import rate_walk
    rates = [1e-3, 3e-3, 1e-2]
    means = {1e-3: 2.0, 3e-3: 1.9, 1e-2: 1.8, 3e-2: 1.85}.get
    assert rate_walk(3e-3, rates, means) == (1e-2, [3e-3, 1e-3, 1e-2, 3e-2], True)  # on past the grid, then stops
    assert rate_walk(3e-3, rates, lambda lr: None if lr == 1e-2 else 1.0) == (3e-3, [3e-3, 1e-3, 1e-2], False)
    assert rate_walk(3e-3, rates, lambda lr: 1.5) == (3e-3, [3e-3, 1e-3, 1e-2], True)  # a tie keeps the chosen
    assert rate_walk(3e-3, rates, lambda lr: math.inf if lr != 3e-3 else 2.0)[0] == 3e-3  # diverged: never best
    # past the grid's edge one step of its spacing and no further: 3e-2 is off the grid, its neighbours not asked for
    assert rate_walk(1e-2, rates, lambda lr: 1.0 / lr) == (3e-2, [1e-2, 3e-3, 3e-2], True)
    # a start off the grid is bracketed: the grid's nearest rate below, one spacing step above; there it stops
    assert rate_walk(0.03, rates, lambda lr: 1.0) == (0.03, [0.03, 1e-2, 0.09], True)
    assert rate_walk(0.03, rates, lambda lr: 1.0 / lr) == (0.09, [0.03, 1e-2, 0.09], True)
    assert rate_walk(5e-3, rates, lambda lr: abs(lr - 1e-2)) == (1e-2, [5e-3, 3e-3, 1e-2, 3e-2], True)


def test_budget_mode_walks_each_long_rate_on_every_long_seed_and_tables_it(tmp_path, forked_runs):
    """Made-up runs: at the longest budget Pre-LN at R = 1 is best at 1e-3 (the chosen rate's lower neighbour) on the
    mean of seeds 0 and 1 though seed 1 alone prefers 3e-3, and DeepLoop at R = 1 at 3e-3; the study trains exactly
    the runs the walks still ask for (the neighbours on seed 1, and 3.33e-4, past Pre-LN's winner), and the verdict
    table takes each at its walk's rate with the paired statistics."""
    out = tmp_path / "walk"
    at_longest = {("preln", 1): {3e-3: (2.00, 1.95), 1e-3: (1.90,), 1e-2: (2.10,)},
                  ("deeploop", 1): {3e-3: (2.05, 2.07), 1e-3: (2.20,), 1e-2: (None,)}}  # 1e-2 diverged
    runs = {}
    for (s, r), by_rate in at_longest.items():
        for lr in (1e-3, 3e-3, 1e-2):
            for seed in (0, 1):
                runs[s, r, lr, seed, 2] = 3.0 if lr == 3e-3 else 3.5
        for lr, losses in by_rate.items():
            runs.update({(s, r, lr, seed, 3): loss for seed, loss in enumerate(losses)})
    made = {"dataset": "builtin_bytes", "warmup_iters": 1, "eval_iters": 1}  # the settings args give the real runs
    write_budget_runs(out, runs, made)
    args = ["--mode=budget", "--dataset=builtin_bytes", "--schemes=preln,deeploop", "--loops=1",
            "--learning_rates=1e-3,3e-3,1e-2", "--seeds=0,1", "--budgets=2,3", "--full_grid_until=2",
            "--long_schemes=preln,deeploop", "--long_seeds=0,1", "--warmup_iters=1", "--eval_iters=1",
            f"--out_dir={out}", "--workers=1"]
    r = sweep(*args, "--report_only=True")
    assert r.returncode == 0, r.stderr
    assert "| preln | 1 | 3 | 0.001: not run yet; 0.003: 1.9750; 0.01: not run yet | 0.003 (walk not finished) |" \
        in r.stdout
    r = sweep(*args)
    assert r.returncode == 0, r.stderr
    trained = [line.split()[0] for line in r.stdout.splitlines() if line.endswith(" s)")]
    assert trained[:4] == ["preln_R1_p0_lr0.001_seed1_it3", "preln_R1_p0_lr0.01_seed1_it3",
                           "deeploop_R1_p0_lr0.001_seed1_it3", "deeploop_R1_p0_lr0.01_seed1_it3"]
    made_up = {("preln", 1e-3, 1): 1.96, ("preln", 1e-2, 1): 2.2, ("deeploop", 1e-3, 1): 2.3,
               ("deeploop", 1e-2, 1): 2.4, ("preln", 3.33e-4, 0): 2.5, ("preln", 3.33e-4, 1): 2.6}
    for (s, lr, seed), loss in made_up.items():  # in place of the real 3-step runs' losses, for the walk and table
        path = out / "runs" / f"{s}_R1_p0_lr{lr:g}_seed{seed}_it3" / "result.json"
        if path.exists():
            result = json.loads(path.read_text())
            path.write_text(json.dumps({**result, "val_loss": loss}))
        else:
            write_budget_runs(out, {(s, 1, lr, seed, 3): loss}, made)
    r = sweep(*args, "--report_only=True")
    assert "| preln | 1 | 3 | 0.000333: 2.5500; 0.001: **1.9300**; 0.003: 1.9750; 0.01: 2.1500 | 0.001 |" in r.stdout
    assert "| deeploop | 1 | 3 | 0.001: 2.2500; 0.003: **2.0600**; 0.01: diverged | 0.003 |" in r.stdout
    verdict = r.stdout.split("At 3 steps")[1]
    assert "| preln | 1 | 0.001 | 1.9300 ± 0.0424 (2) | — | — | — | — |" in verdict
    # 2.05 - 1.90 and 2.07 - 1.96: mean 0.13, s 0.0283, se 0.02, t(0.975, 1 df) = 12.706, t = 6.5 and, with one
    # degree of freedom, p = 1 - 2 atan(t) / pi = 0.097; one step lower, 1e-3: 0.30 and 0.34, t = 16, p = 0.040; one
    # step higher, 1e-2: the seed that diverged drops out
    assert "| deeploop | 1 | 0.003 | 2.0600 ± 0.0141 (2) | +0.130 ± 0.254 (2, p 0.097) | — | — | " \
           "+0.320 ± 0.254 (2, p 0.04) / +0.440 (1 seed) |" in verdict
