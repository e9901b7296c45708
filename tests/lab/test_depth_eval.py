"""depth_eval.py on a tiny trained run: it reproduces train.py's last accuracy, runs other loop counts and shows
solved and failed answers (and sample.py, which has no text to show for such a run, points to it)."""

import json
import os

import pytest
import torch

from dataset import EVAL_SEED
from scripts import run_script
from lab.tasks import make_task
from agreeing_loops import agree_after

from scripts import ROOT

SECOND_PROCESS = True  # seconds of depth_eval's runs, run beside the rest of the session (conftest.py)


def run(script, *args, cwd):
    return run_script(script, *args, cwd=cwd)


@pytest.fixture(scope="module")
def depth_run(tmp_path_factory):
    """A folder with run/: train.py's depth task, 3 steps of a tiny model at 2 loops."""
    tmp_path = tmp_path_factory.mktemp("depth")
    r = run("-m lab.train", os.path.join(ROOT, "config", "depth_cpu.py"), "--out_dir=run", "--max_iters=3",
            "--eval_interval=3", "--eval_iters=2", "--batch_size=8", "--n_loop=2", "--n_embd=32", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return tmp_path


def test_depth_eval_reproduces_the_runs_accuracy_and_shows_examples(depth_run):
    tmp_path = depth_run
    last = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    r = run("lab/depth_eval.py", "--out_dir=run", "--loops=1,2,3", "--examples=1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    trained = next(line for line in lines if "2 loops (trained): " in line)
    assert trained.split(": ")[1] == " ".join(f"{last['accuracy'][k]:.2f}" for k in sorted(last["accuracy"], key=int))
    assert any(line.strip().startswith("1 loops: ") for line in lines)
    assert any(line.strip().startswith("3 loops: ") for line in lines)
    examples = [line for line in lines if line.startswith("k=")]
    assert examples and all(" -> cell " in line and "; model: " in line for line in examples)
    r = run("sample.py", "--out_dir=run", cwd=tmp_path)  # no text to sample: it points here
    assert r.returncode == 2 and r.stderr == ("error: run was trained on chains(values=8, hops=6, cells=16), not "
                                              "on text: show its answers with python -m lab.depth_eval --out_dir=run\n")



@pytest.mark.parametrize("loops", ["1,5000", "0"])
def test_a_loop_count_out_of_range_is_a_one_line_error(loops, depth_run):
    r = run("lab/depth_eval.py", "--out_dir=run", f"--loops={loops}", cwd=depth_run)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"error: loop counts must be from 1 to 1024 (model.MAX_LOOPS), got {loops!r}\n"


def test_a_device_this_machine_lacks_is_a_one_line_error(depth_run):
    r = run("lab/depth_eval.py", "--out_dir=run", "--device=gpu", cwd=depth_run)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith("error: --device=gpu is not usable here (the devices here: cpu"), r.stderr


def trained_line(stdout):
    return next(line for line in stdout.splitlines() if " loops (trained): " in line).split(": ")[1]


def test_a_bfloat16_run_is_evaluated_in_bfloat16_and_a_negative_examples_count_is_an_error(tmp_path):
    # 80 steps: the answers are near ties between values, some of which float32 breaks the other way (it printed
    # 0.13 0.15 0.14 0.15 0.21 0.18 for this run's 0.14 0.14 0.10 0.15 0.18 0.18)
    r = run("-m lab.train", os.path.join(ROOT, "config", "depth_cpu.py"), "--out_dir=run", "--max_iters=80",
            "--eval_interval=80", "--lr_decay_iters=80", "--warmup_iters=2", "--eval_iters=4", "--batch_size=8",
            "--n_loop=2", "--n_embd=32", "--dtype=bfloat16", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    last = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    r = run("lab/depth_eval.py", "--out_dir=run", "--examples=0", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].endswith(" over 32 sequences, in bfloat16 as the run evaluated")
    assert trained_line(r.stdout) == " ".join(f"{last['accuracy'][k]:.2f}"
                                              for k in sorted(last["accuracy"], key=int))
    r = run("lab/depth_eval.py", "--out_dir=run", "--examples=-1", cwd=tmp_path)  # not every answer there is
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "error: --examples must be >= 0 (answers shown at each k; 0: none), got -1\n"


def test_adaptive_exit_rows_and_the_loops_they_report(tmp_path, monkeypatch):
    r = run("-m lab.train", os.path.join(ROOT, "config", "depth_cpu.py"), "--out_dir=run", "--max_iters=3",
            "--eval_interval=3", "--eval_iters=2", "--batch_size=8", "--n_loop=2", "--n_embd=32", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run("lab/depth_eval.py", "--out_dir=run", "--loops=1,3", "--examples=0", "--exit_thresholds=0,1e30", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = {line.split(":")[0].strip(): line.split(": ", 1)[1] for line in r.stdout.splitlines()[2:]}
    # threshold 0 is off (every answer at the most loops, 3); one that every KL passes is one loop
    assert rows["exit at KL 0"].split(";")[0] == rows["3 loops"]
    assert rows["exit at KL 1e+30"].split(";")[0] == rows["1 loops"]
    assert rows["exit at KL 0"].endswith("; loops by k 3.00 3.00 3.00 3.00 3.00 3.00, sd 0.00 0.00 0.00 0.00 0.00 "
                                         "0.00; mean 3.00 of at most 3")
    assert rows["exit at KL 1e+30"].endswith("; mean 1.00 of at most 3")

    # a model whose loops agree after 1, 2 or 3 loops by position: the loops by k are those of its answers' positions
    m = 1 + torch.arange(16) % 3
    agree_after(monkeypatch, m)
    r = run("lab/depth_eval.py", "--out_dir=run", "--loops=8", "--examples=0", "--exit_thresholds=1e-9", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    task = make_task(torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)["config"], "val", EVAL_SEED)
    x, y = zip(*(task.batch(index, 8) for index in range(2)))
    x, y = torch.cat(x), torch.cat(y)
    k, loops = task.hops(x), (m + 1).expand_as(x).float()
    means = [loops[(k == j) & (y >= 0)].mean().item() for j in range(1, 7)]
    sds = [loops[(k == j) & (y >= 0)].std(correction=0).item() for j in range(1, 7)]
    line = next(line for line in r.stdout.splitlines() if "exit at KL 1e-09: " in line)
    assert line.endswith(f"; loops by k {' '.join(f'{v:.2f}' for v in means)}, sd {' '.join(f'{v:.2f}' for v in sds)}"
                         f"; mean {loops[y >= 0].mean():.2f} of at most 8")

    r = run("lab/depth_eval.py", "--out_dir=run", "--exit_thresholds=1e-3,-1", cwd=tmp_path)
    assert (r.returncode, r.stderr) == (2, "error: exit thresholds must be >= 0 (0 = off), got '1e-3,-1'\n")
