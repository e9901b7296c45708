"""train.py end to end on CPU: it is a script, so every test runs it in a subprocess with --key=value overrides, on a
tiny model and a small bytes-tokenized dataset that the tests prepare themselves."""

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from model import GPT
from prepare_data import prepare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
# one thread per process: the machine's cores are shared, and the DDP test runs two processes at once
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
TINY = ["--dataset=fixture", "--device=cpu", "--dtype=float32", "--compile=False", "--peak_flops=1e12",
        "--n_layer=2", "--n_loop=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
        "--gradient_accumulation_steps=2", "--eval_interval=4", "--eval_iters=2", "--log_interval=1",
        "--learning_rate=3e-3", "--warmup_iters=2", "--lr_decay_iters=12", "--min_lr=3e-4"]
HALF = 6  # the resume test stops at step HALF and carries on to 2 * HALF


def train(cwd, *overrides, nproc=1, expect_rc=0):
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc_per_node={nproc}"]
    result = subprocess.run([*launcher, TRAIN, *TINY, *overrides], cwd=cwd, env=ENV, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == expect_rc, result.stderr[-3000:]
    return result


def records(out_dir, kind=None):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if kind is None or r["type"] == kind]


def load(out_dir):
    return torch.load(os.path.join(out_dir, "ckpt.pt"), map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder with data/fixture: 150 short made-up documents in the bytes tokenizer (vocab 257)."""
    root = tmp_path_factory.mktemp("train")
    rng = random.Random(0)
    words = "the loop runs every block again and its residual stream grows unless alpha keeps it in check".split()
    with open(root / "docs.jsonl", "w") as f:
        for _ in range(150):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(40, 80)))}) + "\n")
    prepare([str(root / "docs.jsonl")], tokenizer="bytes", out_dir=str(root / "data" / "fixture"), quiet=True)
    return root


@pytest.fixture(scope="module")
def first_half(workdir):
    """A run stopped at step HALF, with dropout so that resuming must restore the random generators too."""
    result = train(workdir, "--out_dir=half", f"--max_iters={HALF}", "--dropout=0.1")
    return workdir / "half", result


def test_run_writes_checkpoint_and_metrics(first_half):
    out_dir, result = first_half
    ckpt = load(out_dir)
    assert set(ckpt) == {"program", "model", "model_args", "tokenizer", "optimizer", "scaler", "iter_num",
                         "best_val_loss", "config", "rng"}
    assert ckpt["program"] == "deeploop-train" and ckpt["iter_num"] == HALF and ckpt["scaler"] is None
    assert not [k for k in ckpt["model"] if k.startswith(("_orig_mod.", "module."))]
    # the vocab comes from the dataset: the bytes tokenizer's 257 ids padded up to a multiple of 64
    assert ckpt["tokenizer"] == "bytes" and ckpt["model_args"]["vocab_size"] == 320
    assert ckpt["config"]["dataset"] == "fixture" and ckpt["config"]["max_iters"] == HALF
    model, _ = GPT.from_checkpoint(os.path.join(out_dir, "ckpt.pt"))
    assert model.lm_head.weight.shape == (320, 32)

    assert [r["iter"] for r in records(out_dir, "train")] == list(range(HALF))
    for r in records(out_dir, "train"):
        assert set(r) >= {"iter", "loss", "lr", "tokens_per_sec", "mfu", "grad_norm", "tokens"}
    evals = records(out_dir, "eval")
    assert [r["iter"] for r in evals] == [0, 4, HALF]  # every eval_interval steps and at the end
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    for r in evals:
        loop = r["loop"]
        assert len(loop["residual_rms"]) == 4  # one per unrolled visit: 2 blocks x 2 loops
        assert len(loop["grad_norm"]) == 2 and all(len(g) == 2 for g in loop["grad_norm"])
        # kappa_R = ||sum_r g_r||^2 / sum_r ||g_r||^2 lies in [0, R]; below 1 would mean that the visits cancel
        assert all(0 <= k <= 2 for k in loop["kappa"]) and len(loop["kappa"]) == 2
    assert re.search(rf"step {HALF}: train loss [\d.]+, val loss [\d.]+, kappa_R", result.stdout)


def test_residual_exponent_travels_in_the_checkpoint_and_old_checkpoints_load(workdir):
    train(workdir, "--out_dir=exponent", "--max_iters=1", "--residual_exponent=0.35")
    path = os.path.join(workdir, "exponent", "ckpt.pt")
    ckpt = load(workdir / "exponent")
    assert ckpt["model_args"]["residual_exponent"] == 0.35
    model, _ = GPT.from_checkpoint(path)
    assert model.alpha == pytest.approx(8 ** 0.35)  # N = 2 blocks x 2 loops
    # a checkpoint written before the setting existed loads with the scheme's own exponent
    del ckpt["model_args"]["residual_exponent"]
    torch.save(ckpt, path)
    model, _ = GPT.from_checkpoint(path)
    assert model.alpha == pytest.approx(8 ** 0.5)
    result = train(workdir, "--out_dir=exponent_preln", "--max_iters=1", "--residual=preln",
                   "--residual_exponent=0.3", expect_rc=2)
    assert result.stderr == ("error: residual_exponent=0.3 only applies to deeploop and deepnorm, not preln; leave "
                             "it at 0 or use --residual=deeploop\n")


def test_resume_is_exact(workdir, first_half):
    half_dir, _ = first_half
    train(workdir, "--out_dir=whole", f"--max_iters={2 * HALF}", "--dropout=0.1")
    shutil.copytree(half_dir, workdir / "resumed")
    train(workdir, "--out_dir=resumed", f"--max_iters={2 * HALF}", "--dropout=0.1", "--init_from=resume")
    whole, resumed = load(workdir / "whole"), load(workdir / "resumed")
    assert resumed["iter_num"] == 2 * HALF
    for key, tensor in whole["model"].items():
        assert torch.equal(tensor, resumed["model"][key]), key
    for a, b in zip(whole["optimizer"]["state"].values(), resumed["optimizer"]["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    losses = {r["iter"]: r["loss"] for r in records(workdir / "whole", "train")}
    resumed_losses = {r["iter"]: r["loss"] for r in records(workdir / "resumed", "train")}
    assert resumed_losses == losses  # bit for bit, from step 0 (first run) to 2 * HALF - 1 (resumed run)
    assert records(workdir / "resumed", "eval")[-1]["val_loss"] == records(workdir / "whole", "eval")[-1]["val_loss"]
    # metrics.jsonl was appended to: the first run's records stay, then a start record marks the resume
    starts = records(workdir / "resumed", "start")
    assert [(s["iter"], s["resumed"]) for s in starts] == [(0, False), (HALF, True)]


def test_nan_loss_stops_and_keeps_the_last_checkpoint(workdir, first_half):
    half_dir, _ = first_half
    shutil.copytree(half_dir, workdir / "diverged")
    with open(workdir / "diverged" / "ckpt.pt", "rb") as f:
        before = f.read()
    result = train(workdir, "--out_dir=diverged", f"--max_iters={2 * HALF}", "--init_from=resume",
                   "--dropout=0.1", "--learning_rate=1e6", expect_rc=2)
    last_line = result.stderr.strip().splitlines()[-1]
    match = re.fullmatch(r"error: train loss is (nan|inf|-inf) at step (\d+): training diverged; .*", last_line)
    assert match, last_line
    assert int(match.group(2)) > HALF  # step HALF still runs on the good weights; its huge update breaks the next
    assert f"(step {HALF})" in last_line
    with open(workdir / "diverged" / "ckpt.pt", "rb") as f:
        assert f.read() == before


def test_sigkill_leaves_a_loadable_checkpoint(workdir):
    """A checkpoint at every step, the process killed at some moment of it: ckpt.pt is always a whole file (written
    under another name and renamed), and the run resumes from it."""
    cmd = [sys.executable, TRAIN, *TINY, "--out_dir=killed", "--max_iters=1000", "--eval_interval=1"]
    proc = subprocess.Popen(cmd, cwd=workdir, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics, deadline = workdir / "killed" / "metrics.jsonl", time.time() + 120
    try:
        while not (metrics.exists() and metrics.read_text().count('"type": "eval"') >= 3):
            assert proc.poll() is None and time.time() < deadline, "the run ended or stalled before its third eval"
            time.sleep(0.05)
    finally:
        proc.kill()  # SIGKILL: no cleanup of any kind
        proc.wait()
    step = load(workdir / "killed")["iter_num"]
    assert step >= 2
    train(workdir, "--out_dir=killed", "--init_from=resume", f"--max_iters={step + 1}", "--eval_interval=1")
    assert load(workdir / "killed")["iter_num"] == step + 1


def test_two_ddp_processes_equal_one_with_twice_the_accumulation(workdir):
    # gradient_accumulation_steps counts micro-batches over all processes: 4 = 2 processes x 2 = 1 process x 4
    args = ["--gradient_accumulation_steps=4", "--max_iters=3", "--eval_interval=100"]
    train(workdir, "--out_dir=single", *args)
    train(workdir, "--out_dir=ddp", *args, nproc=2)
    single, ddp = load(workdir / "single"), load(workdir / "ddp")
    assert len(ddp["rng"]) == 2  # both processes' generator states
    for key, tensor in single["model"].items():
        torch.testing.assert_close(ddp["model"][key], tensor, rtol=1e-5, atol=1e-6, msg=key)
    single_losses = [r["loss"] for r in records(workdir / "single", "train")]
    ddp_losses = [r["loss"] for r in records(workdir / "ddp", "train")]
    assert ddp_losses == pytest.approx(single_losses, rel=1e-6) and len(ddp_losses) == 3
    assert records(workdir / "ddp", "eval")[-1]["val_loss"] == pytest.approx(
        records(workdir / "single", "eval")[-1]["val_loss"], rel=1e-6)


def test_builtin_data_is_prepared_on_demand_and_kappa_is_one_without_looping(tmp_path):
    result = train(tmp_path, "--dataset=builtin_bytes", "--out_dir=unlooped", "--n_loop=1", "--max_iters=1",
                   "--eval_interval=1")
    assert "preparing data/builtin_bytes" in result.stdout
    assert json.loads((tmp_path / "data" / "builtin_bytes" / "meta.json").read_text())["tokenizer"] == "bytes"
    assert load(tmp_path / "unlooped")["model_args"]["vocab_size"] == 320
    evals = records(tmp_path / "unlooped", "eval")
    assert len(evals) == 2
    for r in evals:  # one visit per block: its gradient is the block's whole gradient
        assert r["loop"]["kappa"] == pytest.approx([1.0, 1.0])
        assert [len(g) for g in r["loop"]["grad_norm"]] == [1, 1]


def test_missing_dataset_names_the_command_that_prepares_it(tmp_path):
    result = train(tmp_path, "--dataset=openwebtext", expect_rc=2)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: dataset data/openwebtext not found"), lines
    assert lines[0].endswith("python prepare_data.py openwebtext")
