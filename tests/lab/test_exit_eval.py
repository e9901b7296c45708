"""exit_eval.py on a tiny trained depth-task run: its rows agree where they must (threshold 0 and the cache at fixed
depth change nothing; a threshold that every KL passes is one loop), it draws its figure, and bad settings are
one-line errors."""

import os
import shutil

from scripts import ROOT, run_script

SECOND_PROCESS = True  # seconds of exit_eval's runs, run beside the rest of the session (conftest.py)


def rows(stdout):
    """{name: (loops, sd, val loss, accuracy)} of exit_eval's lines, the parallel ones and then the cached ones."""
    parallel, cached, table = {}, {}, None
    for line in stdout.splitlines()[1:-1]:  # between the heading and "wrote exit.png"
        if line.startswith("through the KV cache"):
            table = cached
            continue
        table = parallel if table is None else table
        name, figures = line.split(": ", 1)
        loops, rest = figures.split(" (sd ")
        sd, rest = rest.split("), val loss ")
        loss, accuracy = rest.split(", accuracy by k ")
        table[name.strip()] = (float(loops.split()[1]), float(sd), float(loss), accuracy)
    return parallel, cached


def test_exit_eval_rows_agree_where_they_must_and_the_figure_is_drawn(tmp_path):
    r = run_script("-m lab.train", os.path.join(ROOT, "config", "depth_sampled_cpu.py"), "--out_dir=run", "--max_iters=3",
                   "--eval_interval=3", "--eval_iters=2", "--batch_size=8", "--n_embd=32", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_script("lab/exit_eval.py", "--out_dir=run", "--loops=1,3", "--exit_thresholds=0,1e30,1e-2",
                   "--cached_batches=1", "--png=exit.png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    parallel, cached = rows(r.stdout)
    assert parallel["exit at KL 0 (<= 3)"] == parallel["3 loops"]
    assert parallel["exit at KL 1e+30 (<= 3)"] == parallel["1 loops"]
    assert parallel["1 loops"][:2] == (1.0, 0.0)
    assert 1 <= parallel["exit at KL 0.01 (<= 3)"][0] <= 3
    # through the cache at the trained 4 loops, and at threshold 0 (3 loops, the most): per_visit is exact,
    # last_loop is not
    for fixed in ("4 loops", "3 loops"):
        assert cached[f"per_visit, {fixed}"] == cached[f"parallel, {fixed}"]
        assert cached[f"last_loop, {fixed}"][2] != cached[f"parallel, {fixed}"][2]
    assert cached["per_visit, exit at KL 1e+30"] == cached["last_loop, exit at KL 1e+30"] == \
        cached["parallel, exit at KL 1e+30"]
    assert r.stdout.splitlines()[-1] == "wrote exit.png" and (tmp_path / "exit.png").stat().st_size > 10000


def test_bad_settings_are_one_line_errors(tmp_path):
    r = run_script("lab/exit_eval.py", "--out_dir=nothing", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: no checkpoint at nothing/ckpt.pt")
    r = run_script("-m lab.train", os.path.join(ROOT, "config", "depth_cpu.py"), "--out_dir=run", "--max_iters=1",
                   "--eval_interval=1", "--eval_iters=1", "--batch_size=4", "--n_embd=32", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for setting in ("--exit_thresholds=-1", "--max_loops=-2", "--loops=0,2"):
        r = run_script("lab/exit_eval.py", "--out_dir=run", setting, cwd=tmp_path)
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, (setting, r.stderr)
        assert r.stderr.startswith("error: need loops from 1 to 1024 (model.MAX_LOOPS), exit_thresholds >= 0 "
                                   "(0 = off), max_loops from 0 (the largest of loops) to 1024 and cached_batches "
                                   ">= 0, got ")
    r = run_script("lab/exit_eval.py", "--out_dir=run", "--device=gpu", cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith("error: --device=gpu is not usable here (the devices here: cpu"), r.stderr
    r = run_script("lab/exit_eval.py", "--out_dir=run", "--loops=two", cwd=tmp_path)
    assert r.stderr == ("error: loops must be comma-separated ints and exit_thresholds numbers, got 'two' and "
                        "'1e-3,1e-2,1e-1'\n")


def test_loop_counts_past_max_loops_none_and_an_unwritable_figure_are_one_line_errors_before_any_work(tmp_path):
    """Every setting is checked before the checkpoint is read: the checkpoint here is fine, but its dataset is not
    in tmp_path, so that an evaluation (or data loading) started before a check would end otherwise."""
    os.mkdir(tmp_path / "run")
    shutil.copy(os.path.join(ROOT, "tests", "fixtures", "ckpt_plain_before_lab.pt"), tmp_path / "run" / "ckpt.pt")
    need = "error: need loops from 1 to 1024 (model.MAX_LOOPS), exit_thresholds >= 0 (0 = off), max_loops from 0"
    for settings, message in [(("--loops=1,2000",), need), (("--max_loops=2000",), need),
                              (("--max_loops=None",), "error: "), (("--cached_batches=None",), "error: "),
                              (("--png=missing/exit.png",), "error: --png=missing/exit.png: cannot write a file "
                               "there (no writable folder missing); create the folder or name another file"),
                              (("--png=run",), "error: --png=run: cannot write a file there"),
                              (("--png=exit.xyz",), "error: --png=exit.xyz: matplotlib does not write .xyz files; "
                               "name a file ending in one of avif, eps, ")]:
        r = run_script("lab/exit_eval.py", "--out_dir=run", *settings, cwd=tmp_path)
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, (settings, r.stderr)
        assert r.stderr.startswith(message), (settings, r.stderr)
    assert os.listdir(tmp_path) == ["run"]
