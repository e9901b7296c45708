"""depth_eval.py on a tiny trained run: it reproduces train.py's last accuracy, runs other loop counts and shows
solved and failed answers (and sample.py, which has no text to show for such a run, points to it)."""

import json
import os

import pytest

from scripts import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args, cwd):
    return run_script(script, *args, cwd=cwd)


@pytest.fixture(scope="module")
def depth_run(tmp_path_factory):
    """A folder with run/: train.py's depth task, 3 steps of a tiny model at 2 loops."""
    tmp_path = tmp_path_factory.mktemp("depth")
    r = run("train.py", os.path.join(ROOT, "config", "depth_cpu.py"), "--out_dir=run", "--max_iters=3",
            "--eval_interval=3", "--eval_iters=2", "--batch_size=8", "--n_loop=2", "--n_embd=32", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return tmp_path


def test_depth_eval_reproduces_the_runs_accuracy_and_shows_examples(depth_run):
    tmp_path = depth_run
    last = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    r = run("depth_eval.py", "--out_dir=run", "--loops=1,2,3", "--examples=1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    trained = next(line for line in lines if "2 loops (trained): " in line)
    assert trained.split(": ")[1] == " ".join(f"{last['accuracy'][k]:.2f}" for k in sorted(last["accuracy"], key=int))
    assert any(line.strip().startswith("1 loops: ") for line in lines)
    assert any(line.strip().startswith("3 loops: ") for line in lines)
    examples = [line for line in lines if line.startswith("k=")]
    assert examples and all(" -> cell " in line and "; model: " in line for line in examples)
    r = run("sample.py", "--out_dir=run", cwd=tmp_path)  # no text to sample: it points here
    assert r.returncode == 2 and r.stderr == ("error: run was trained on the chains task, not on text: show its "
                                              "answers with python depth_eval.py --out_dir=run\n")



@pytest.mark.parametrize("loops", ["1,5000", "0"])
def test_a_loop_count_out_of_range_is_a_one_line_error(loops, depth_run):
    r = run("depth_eval.py", "--out_dir=run", f"--loops={loops}", cwd=depth_run)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"error: loop counts must be from 1 to 1024 (model.MAX_LOOPS), got {loops!r}\n"
