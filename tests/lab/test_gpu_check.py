"""gpu_check.py's dry run: every check of the GPU script, on a tiny model on CPU, with two gloo processes for the
torchrun check."""

import re

import torch

from scripts import run_script

DRY = ["--dry=True", "--device=cpu", "--dtype=float32", "--compile=False", "--dataset=builtin_bytes"]


def gpu_check(cwd, *args):
    return run_script("lab/gpu_check.py", *DRY, *args, cwd=cwd)  # its runs of train.py and torchrun are subprocesses


def broken_config(folder):
    (folder / "broken.py").write_text('residual = "deepnet"\n')
    return [["-m", "lab.gpu_check", *DRY, f"--config_file={folder / 'broken.py'}", "--nproc=1",
             f"--out_dir={folder / 'out-gpu-check'}"]]


# started with the session (conftest.py): their train.py, bench.py and torchrun processes take 5-30 s
EARLY = {"test_dry_run_passes_every_check_and_refuses_to_write_over_it":
         lambda folder: [["-m", "lab.gpu_check", *DRY, "--nproc=2", f"--out_dir={folder / 'out-gpu-check'}"]],
         "test_a_failing_check_fails_the_script_and_the_checks_that_need_it": broken_config}


def test_dry_run_passes_every_check_and_refuses_to_write_over_it(early):
    result, tmp_path = early
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("gpu_check: config/paper_small.py R=3 (dry: tiny model), float32, on cpu")
    patterns = [
        r"check +result",
        r"train +ok +[0-9,]+ tokens/s, MFU [0-9.]+% \(median of steps 3-5\), \d+ s with compilation and evaluation",
        r"eval +ok +val loss [0-9.]+ -> [0-9.]+ over 2 batches, kappa_R mean [0-9.]+, ckpt.pt at step 6",
        r"resume +ok +step 6 -> 8, train loss [0-9.]+ -> [0-9.]+, \d+ s",
        r"generate +ok +8 new tokens x 8 sequences: cached [0-9,]+ tokens/s, uncached [0-9,]+ tokens/s \([0-9.]+x\), "
        r"\d+ s",
        r"torchrun +ok +2 processes: [0-9,]+ tokens/s, MFU [0-9.]+% of 2 devices, \d+% of 2 x one process, \d+ s",
    ]
    assert len(lines) == 1 + len(patterns), result.stdout
    for line, pattern in zip(lines[1:], patterns):
        assert re.fullmatch(pattern, line), line
    run_dir = tmp_path / "out-gpu-check"
    ckpt = torch.load(run_dir / "train" / "ckpt.pt", map_location="cpu", weights_only=True)
    assert ckpt["iter_num"] == 8 and ckpt["model_args"]["position_encoding"] == "rope"
    assert ckpt["model_args"]["n_loop"] == 3 and ckpt["model_args"]["norm"] == "rmsnorm"
    assert (run_dir / "torchrun" / "ckpt.pt").exists()

    again = gpu_check(tmp_path)
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr.splitlines() == ["error: out-gpu-check exists; remove it or pass another --out_dir (the check "
                                         "does not write over earlier runs)"]


def test_a_failing_check_fails_the_script_and_the_checks_that_need_it(early):
    result, _ = early
    assert result.returncode == 1
    rows = result.stdout.splitlines()[2:]
    assert rows == ["train     FAIL  exit code 2",
                    "eval      FAIL  not run: the train check failed",
                    "resume    FAIL  not run: the train check failed",
                    "generate  FAIL  not run: the train check failed",
                    "torchrun  skip  nproc=1: needs 2 or more devices"]
    assert "error: unknown residual scheme 'deepnet'" in result.stderr
