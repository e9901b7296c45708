import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sweep_writes_table_plot_marks_divergence_and_resumes(tmp_path):
    out = tmp_path / "sweep"
    data_dir = os.path.join(ROOT, "data", "builtin_bytes")  # train.py prepares it when missing
    args = [sys.executable, "sweep.py", f"--out_dir={out}", "--schemes=deeploop,postln", "--loops=1,2",
            "--seeds=0,1", "--max_iters=4", "--warmup_iters=1", "--eval_iters=2", "--n_embd=32", "--block_size=32",
            "--stability_n_loop=3", "--stability_max_iters=3", "--stability_learning_rate=1e6",
            "--stability_block_size=16"]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert os.path.isdir(data_dir)
    table = (out / "results.md").read_text()
    assert "| scheme | n_loop=1 (N=2) | n_loop=2 (N=4) |" in table
    assert table.count("| deeploop |") == 3 and table.count("| postln |") == 3
    # a learning rate of a million makes every stability run diverge, and the table says so
    assert "| deeploop | " in table and table.rstrip().count("| yes |") == 2
    assert (out / "val_loss_vs_n_loop.png").stat().st_size > 1000
    result = json.loads((out / "runs" / "deeploop_loop2_seed1" / "result.json").read_text())
    assert result["n_loop"] == 2 and len(result["kappa"]) == 2 and not result["diverged"]
    assert result["val_loss"] < result["initial_val_loss"]
    # finished runs are not trained again
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "val " not in r.stdout.split("runs, 2 at a time")[1].split("Val loss")[0]


def test_bad_list_is_a_one_line_error():
    r = subprocess.run([sys.executable, "sweep.py", "--loops=1,two"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr == "error: loops must be comma-separated integers like 1,2,4, got '1,two'\n"
