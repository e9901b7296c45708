"""train.py end to end on CPU: it is a script, so every test runs it in a subprocess with --key=value overrides, on a
tiny model and a small bytes-tokenized dataset that the tests prepare themselves."""

import fcntl
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from dataset import EVAL_SEED, TokenWindows
from model import GPT, GPTConfig
from guard import load_checkpoint
from runtime import flops_per_token
from lab.loops import TrainLoops
from lab.plot import read_metrics
from prepare_data import prepare
from scripts import Started, run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
# one thread per process: the machine's cores are shared, and the DDP test runs two processes at once
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
TINY = ["--dataset=fixture", "--device=cpu", "--dtype=float32", "--compile=False", "--peak_flops=1e12",
        "--n_layer=2", "--n_loop=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
        "--gradient_accumulation_steps=2", "--eval_interval=4", "--eval_iters=2", "--log_interval=1",
        "--learning_rate=3e-3", "--warmup_iters=2", "--lr_decay_iters=12", "--min_lr=3e-4"]
HALF = 6  # the resume test stops at step HALF and carries on to 2 * HALF
SAMPLED = ["--loop_sampling=uniform", "--loop_min=1", "--loop_max=3"]  # loop counts drawn per step, mean n_loop


def train(cwd, *overrides, nproc=1, expect_rc=0, lab=False):
    """train.py TINY overrides in cwd (lab: under python -m lab.train, with the lab's settings and records): in this
    process, or in processes of its own for DDP and torch.compile (whose caches would outlive the run here)."""
    if nproc == 1 and "--compile=True" not in overrides:
        result = run_script("-m lab.train" if lab else "train.py", *TINY, *overrides, cwd=cwd)
    else:
        launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                         f"--nproc_per_node={nproc}"]
        script = ["-m", "lab.train"] if lab else [TRAIN]
        result = subprocess.run([*launcher, *script, *TINY, *overrides], cwd=cwd, env={**ENV, "PYTHONPATH": ROOT},
                                capture_output=True, text=True, timeout=300)
    assert result.returncode == expect_rc, result.stderr[-3000:]
    return result


def records(out_dir, kind=None):
    return [r for r in read_metrics(os.path.join(out_dir, "metrics.jsonl")) if kind is None or r["type"] == kind]


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
                         "best_val_loss", "evaluated", "config", "rng", "lab"}
    assert ckpt["lab"] == {} and "loop_sampling" not in ckpt["config"]  # the lesson alone: no setting of the lab's
    assert ckpt["program"] == "deeploop-train" and ckpt["iter_num"] == HALF and ckpt["scaler"] is None
    assert ckpt["evaluated"]  # written by the evaluation at step HALF
    assert not [k for k in ckpt["model"] if k.startswith(("_orig_mod.", "module."))]
    # the vocab comes from the dataset: the bytes tokenizer's 257 ids padded up to a multiple of 64
    assert ckpt["tokenizer"] == "bytes" and ckpt["model_args"]["vocab_size"] == 320
    assert ckpt["config"]["dataset"] == "fixture" and ckpt["config"]["max_iters"] == HALF
    model, _ = load_checkpoint(os.path.join(out_dir, "ckpt.pt"))
    assert model.lm_head.weight.shape == (320, 32)

    assert [r["iter"] for r in records(out_dir, "train")] == list(range(HALF))
    for r in records(out_dir, "train"):
        assert set(r) >= {"iter", "loss", "lr", "tokens_per_sec", "mfu", "grad_norm", "tokens"}
    evals = records(out_dir, "eval")
    assert [r["iter"] for r in evals] == [0, 4, HALF]  # every eval_interval steps and at the end
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] and not [r for r in evals if "loop" in r]
    assert re.search(rf"step {HALF}: train loss [\d.]+, val loss [\d.]+\n", result.stdout)


def test_the_lab_records_the_loop_diagnostics_and_the_same_losses(workdir, first_half):
    """python -m lab.train is train.py with the lab's records added: the loop diagnostics at every evaluation, and
    losses equal to the lesson's run (the diagnostics draw no random numbers)."""
    half_dir, _ = first_half
    result = train(workdir, "--out_dir=half-lab", f"--max_iters={HALF}", "--dropout=0.1", lab=True)
    assert [r["val_loss"] for r in records(workdir / "half-lab", "eval")] == \
        [r["val_loss"] for r in records(half_dir, "eval")]
    assert load(workdir / "half-lab")["lab"] == {}  # nothing the lab changed: the lesson resumes it
    for r in records(workdir / "half-lab", "eval"):
        loop = r["loop"]
        assert len(loop["residual_rms"]) == 4  # one per unrolled visit: 2 blocks x 2 loops
        assert len(loop["grad_norm"]) == 2 and all(len(g) == 2 for g in loop["grad_norm"])
        # kappa_R = ||sum_r g_r||^2 / sum_r ||g_r||^2 lies in [0, R]; below 1 would mean that the visits cancel
        assert all(0 <= k <= 2 for k in loop["kappa"]) and len(loop["kappa"]) == 2
    assert re.search(rf"step {HALF}: train loss [\d.]+, val loss [\d.]+, kappa_R", result.stdout)


def test_a_run_the_lab_changed_resumes_under_the_lab_only(workdir):
    """The checkpoint names the lab's settings off their defaults; train.py alone refuses to resume it (it would
    train another way), also a checkpoint from before the seam, whose config held train.py's own loop settings."""
    train(workdir, "--out_dir=lab-only", "--max_iters=2", *SAMPLED, lab=True)
    assert load(workdir / "lab-only")["lab"] == dict(loop_sampling="uniform", loop_min=1, loop_max=3)
    message = ("error: lab-only/ckpt.pt was trained with the lab's loop_sampling='uniform', loop_min=1, loop_max=3; "
               "resume it with python -m lab.train and the run's settings\n")
    assert train(workdir, "--out_dir=lab-only", "--init_from=resume", "--max_iters=3", expect_rc=2).stderr == message
    ckpt = load(workdir / "lab-only")
    del ckpt["lab"]
    torch.save(ckpt, workdir / "lab-only" / "ckpt.pt")
    result = train(workdir, "--out_dir=lab-only", "--init_from=resume", "--max_iters=3", expect_rc=2)
    assert result.stderr == "error: lab-only/ckpt.pt was trained with the lab's loop_sampling='uniform'; resume it " \
                            "with python -m lab.train and the run's settings\n"
    train(workdir, "--out_dir=lab-only", "--init_from=resume", "--max_iters=3", *SAMPLED, lab=True)
    assert load(workdir / "lab-only")["iter_num"] == 3


def test_residual_exponent_travels_in_the_checkpoint_and_old_checkpoints_load(workdir):
    train(workdir, "--out_dir=exponent", "--max_iters=1", "--residual_exponent=0.35")
    path = os.path.join(workdir, "exponent", "ckpt.pt")
    ckpt = load(workdir / "exponent")
    assert ckpt["model_args"]["residual_exponent"] == 0.35
    model, _ = load_checkpoint(path)
    assert model.alpha == pytest.approx(8 ** 0.35)  # N = 2 blocks x 2 loops
    # a checkpoint written before the setting existed loads with the scheme's own exponent
    del ckpt["model_args"]["residual_exponent"]
    torch.save(ckpt, path)
    model, _ = load_checkpoint(path)
    assert model.alpha == pytest.approx(8 ** 0.5)
    result = train(workdir, "--out_dir=exponent_preln", "--max_iters=1", "--residual=preln",
                   "--residual_exponent=0.3", expect_rc=2)
    assert result.stderr == ("error: residual_exponent=0.3 only applies to deeploop and deepnorm, not preln; leave "
                             "it at 0 or use --residual=deeploop\n")


def test_residual_lambda_travels_in_the_checkpoint_and_a_bad_one_is_a_one_line_error(workdir):
    train(workdir, "--out_dir=rival", "--max_iters=1", "--residual=preln_scaled", "--residual_lambda=2")
    path = os.path.join(workdir, "rival", "ckpt.pt")
    ckpt = load(workdir / "rival")
    assert ckpt["model_args"]["residual_lambda"] == 2.0
    model, _ = load_checkpoint(path)
    assert model.epsilon == pytest.approx(2 / (2 * 2 ** 0.5))  # 2 loops over 2 blocks
    del ckpt["model_args"]["residual_lambda"]  # a checkpoint from before the setting: lambda 1
    torch.save(ckpt, path)
    assert load_checkpoint(path)[0].epsilon == pytest.approx(1 / (2 * 2 ** 0.5))
    result = train(workdir, "--out_dir=rival", "--max_iters=1", "--residual=preln_scaled", "--residual_lambda=-1",
                   expect_rc=2)
    assert result.stderr == ("error: residual_lambda must be a positive number (the paper's lambda, 1 by default), "
                             "got -1.0\n")
    assert load_checkpoint(path)[0].epsilon == pytest.approx(1 / (2 * 2 ** 0.5))  # nothing overwritten


@pytest.fixture(scope="module")
def whole(workdir):
    """The run that first_half and the stopped runs below are resumed to match: 2 * HALF steps without a stop."""
    train(workdir, "--out_dir=whole", f"--max_iters={2 * HALF}", "--dropout=0.1")
    return workdir / "whole"


def assert_same_run(a, b):
    """Runs a (uninterrupted) and b ended with the same weights and optimizer state, and logged the same losses and
    evaluations, bit for bit (b may hold one evaluation more: where a run that it resumed ended)."""
    ckpt_a, ckpt_b = load(a), load(b)
    assert ckpt_a["iter_num"] == ckpt_b["iter_num"]
    for key, tensor in ckpt_a["model"].items():
        assert torch.equal(tensor, ckpt_b["model"][key]), key
    for state_a, state_b in zip(ckpt_a["optimizer"]["state"].values(), ckpt_b["optimizer"]["state"].values()):
        assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert {r["iter"]: r["loss"] for r in records(a, "train")} == {r["iter"]: r["loss"] for r in records(b, "train")}
    evals_b = {r["iter"]: r["val_loss"] for r in records(b, "eval")}
    assert {r["iter"]: r["val_loss"] for r in records(a, "eval")} == \
        {r["iter"]: evals_b.get(r["iter"]) for r in records(a, "eval")}


def test_resume_is_exact(workdir, first_half, whole):
    half_dir, _ = first_half
    shutil.copytree(half_dir, workdir / "resumed")
    train(workdir, "--out_dir=resumed", f"--max_iters={2 * HALF}", "--dropout=0.1", "--init_from=resume")
    assert_same_run(whole, workdir / "resumed")  # losses bit for bit from step 0 (first run) to 2 * HALF - 1
    # metrics.jsonl was appended to: the first run's records stay, then a start record marks the resume
    starts = records(workdir / "resumed", "start")
    assert [(s["iter"], s["resumed"]) for s in starts] == [(0, False), (HALF, True)]


def test_a_resume_with_another_seed_or_batch_says_that_its_batches_are_not_the_runs(workdir, first_half):
    half_dir, _ = first_half
    shutil.copytree(half_dir, workdir / "reseeded")
    result = train(workdir, "--out_dir=reseeded", f"--max_iters={HALF + 1}", "--dropout=0.1", "--init_from=resume",
                   "--seed=5", "--batch_size=2")
    assert "note: resuming with seed=5 (the run's: 1337), batch_size=2 (the run's: 4): the batches from here on are " \
           "not an uninterrupted run's" in result.stdout.splitlines()
    assert [r["iter"] for r in records(workdir / "reseeded", "train")] == list(range(HALF + 1))
    assert "note: resuming" not in train(workdir, "--out_dir=reseeded", f"--max_iters={HALF + 2}", "--dropout=0.1",
                                         "--init_from=resume", "--seed=5", "--batch_size=2").stdout


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_float32_run_resumes_in_half_precision(dtype, workdir, first_half):
    """Weights and optimizer state are float32 whatever the dtype (autocast casts per operation): a checkpoint
    resumes in any precision, float16 starting its loss scaling afresh."""
    half_dir, _ = first_half
    shutil.copytree(half_dir, workdir / f"resumed_{dtype}")
    result = train(workdir, f"--out_dir=resumed_{dtype}", f"--max_iters={HALF + 2}", "--dropout=0.1",
                   "--init_from=resume", f"--dtype={dtype}")
    assert f"dtype {dtype}: as set" in result.stdout.splitlines()
    ckpt = load(workdir / f"resumed_{dtype}")
    assert ckpt["iter_num"] == HALF + 2 and ckpt["config"]["dtype"] == dtype
    assert {t.dtype for t in ckpt["model"].values()} == {torch.float32}
    assert (ckpt["scaler"] is not None) == (dtype == "float16")
    losses = [r["loss"] for r in records(workdir / f"resumed_{dtype}", "train")]
    assert len(losses) == HALF + 2 and all(0 < loss < 6 for loss in losses)
    first = {r["iter"]: r["loss"] for r in records(half_dir, "train")}
    assert abs(losses[HALF] - first[HALF - 1]) < 0.5  # carries on from where the float32 run stopped


def test_a_resumed_run_keeps_its_checkpoints_precision_without_measuring(workdir, first_half):
    """dtype=auto on a CPU measures, and a measurement may pick differently on a busy machine: a resumed run keeps
    the precision its checkpoint was trained in, so that no run changes precision halfway."""
    half_dir, _ = first_half
    shutil.copytree(half_dir, workdir / "resumed_auto")
    result = train(workdir, "--out_dir=resumed_auto", f"--max_iters={HALF + 1}", "--dropout=0.1", "--init_from=resume",
                   "--dtype=auto")
    assert "dtype float32: the precision its checkpoint was trained in on a CPU (a measurement could differ)" in \
        result.stdout.splitlines()


def test_a_gpu_checkpoint_resumed_on_a_cpu_gets_the_cpus_precision(workdir, first_half):
    """A CUDA run's bfloat16 kept on a CPU that emulates bfloat16 ran 3.1x slower than float32: a checkpoint trained
    on another kind of device gets this device's rule, on a CPU a measurement."""
    half_dir, _ = first_half
    shutil.copytree(half_dir, workdir / "from_gpu")
    ckpt = load(workdir / "from_gpu")
    ckpt["config"].update(device="cuda:0", dtype="bfloat16")
    torch.save(ckpt, workdir / "from_gpu" / "ckpt.pt")
    result = train(workdir, "--out_dir=from_gpu", f"--max_iters={HALF + 1}", "--dropout=0.1", "--init_from=resume",
                   "--dtype=auto")
    reason = next(line for line in result.stdout.splitlines() if line.startswith("dtype "))
    # a CPU without bfloat16 instructions is not measured
    assert re.fullmatch(r"dtype (float32|bfloat16): training steps of this model on \d+ of the batch's \d+ sequences "
                        r"of 32 tokens, measured in [0-9.]+ s: the fastest of \d+ steps: .*", reason) or \
        reason.startswith("dtype float32: this CPU has no bfloat16 instructions"), reason


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
    assert f"ckpt.pt keeps step {HALF} (the last good state)" in last_line
    with open(workdir / "diverged" / "ckpt.pt", "rb") as f:
        assert f.read() == before


def test_sigkill_leaves_a_loadable_checkpoint(workdir):
    """A checkpoint at every step, the process killed at some moment of it: ckpt.pt is always a whole file (written
    under another name and renamed), and the run resumes from it."""
    proc = start(workdir, "--out_dir=killed", "--max_iters=1000", "--eval_interval=1")
    metrics, deadline = workdir / "killed" / "metrics.jsonl", time.time() + 120
    try:
        # an evaluation's record comes before its checkpoint: the fourth record (step 3) follows step 2's checkpoint
        while not (metrics.exists() and metrics.read_text().count('"type": "eval"') >= 4):
            assert proc.poll() is None and time.time() < deadline, "the run ended or stalled before its fourth eval"
            time.sleep(0.05)
    finally:
        proc.kill()  # SIGKILL: no cleanup of any kind
        proc.wait()
    step = load(workdir / "killed")["iter_num"]
    assert step >= 2
    # the dead run's lock file stays, naming it, and blocks nothing: the OS dropped its lock with the process
    assert (workdir / "killed" / "train.lock").read_text().startswith(f"pid {proc.pid} ")
    train(workdir, "--out_dir=killed", "--init_from=resume", f"--max_iters={step + 1}", "--eval_interval=1")
    assert load(workdir / "killed")["iter_num"] == step + 1


def test_two_ddp_processes_equal_one_with_twice_the_accumulation(workdir):
    # gradient_accumulation_steps counts micro-batches over all processes: 4 = 2 processes x 2 = 1 process x 4; with
    # sampled loop counts, which every process and micro-batch of a step must share, and backprop through the last
    # loop only, which leaves the position embedding without a gradient
    # eval_iters=3: the second process has one batch fewer to evaluate, and agrees as often as the first
    args = ["--gradient_accumulation_steps=4", "--max_iters=3", "--eval_interval=100", *SAMPLED, "--backprop_loops=1",
            "--eval_iters=3"]
    train(workdir, "--out_dir=single", *args, lab=True)
    train(workdir, "--out_dir=ddp", *args, nproc=2, lab=True)
    single, ddp = load(workdir / "single"), load(workdir / "ddp")
    assert len(ddp["rng"]) == 2  # both processes' generator states
    for key, tensor in single["model"].items():
        torch.testing.assert_close(ddp["model"][key], tensor, rtol=1e-5, atol=1e-6, msg=key)
    single_losses = [r["loss"] for r in records(workdir / "single", "train")]
    ddp_losses = [r["loss"] for r in records(workdir / "ddp", "train")]
    assert ddp_losses == pytest.approx(single_losses, rel=1e-6) and len(ddp_losses) == 3
    assert [r["loops"] for r in records(workdir / "ddp", "train")] == [2, 3, 3]  # TrainLoops.draw(1337, 0..2)
    by_loops = records(workdir / "ddp", "eval")[-1]["val_loss_by_loops"]  # sampled: 1, n_loop and 2 * n_loop
    assert list(by_loops) == ["1", "2", "4"]
    assert list(by_loops.values()) == pytest.approx(
        list(records(workdir / "single", "eval")[-1]["val_loss_by_loops"].values()), rel=1e-6)
    assert records(workdir / "ddp", "eval")[-1]["val_loss"] == pytest.approx(
        records(workdir / "single", "eval")[-1]["val_loss"], rel=1e-6)


def test_ddp_trains_a_loop_input_that_a_step_of_one_loop_leaves_unused(workdir):
    """The injected input enters from the second loop on (model.LoopInput): a step of one loop leaves its parameters
    without a gradient, and DDP, unless told, fails at the next step (Expected to have finished reduction ...).
    Huginn's log-normal Poisson draws 1 loop at step 0 here; concat at a fixed n_loop=1 runs one at every step."""
    args = ["--gradient_accumulation_steps=4", "--max_iters=3", "--eval_interval=100", "--loop_input=concat",
            "--loop_sampling=lognormal_poisson", "--loop_mean=2.0"]
    train(workdir, "--out_dir=inject-single", *args, lab=True)
    train(workdir, "--out_dir=inject-ddp", *args, nproc=2, lab=True)
    assert [r["loops"] for r in records(workdir / "inject-ddp", "train")] == [1, 2, 4]  # TrainLoops.draw(1337, 0..2)
    single, ddp = load(workdir / "inject-single"), load(workdir / "inject-ddp")
    for key, tensor in single["model"].items():
        torch.testing.assert_close(ddp["model"][key], tensor, rtol=1e-5, atol=1e-6, msg=key)
    train(workdir, "--out_dir=inject-one", "--loop_input=concat", "--n_loop=1", "--max_iters=2", nproc=2)
    assert load(workdir / "inject-one")["iter_num"] == 2


def test_sampled_loop_counts_continue_on_resume_and_evaluations_report_several_depths(workdir):
    train(workdir, "--out_dir=sampled", "--max_iters=4", "--eval_loops=1,3", *SAMPLED, lab=True)
    result = train(workdir, "--out_dir=sampled", "--max_iters=8", "--init_from=resume", "--eval_loops=1,3", *SAMPLED,
                   lab=True)
    loops = [r["loops"] for r in records(workdir / "sampled", "train")]
    assert loops == [TrainLoops("uniform", 1, 3).draw(1337, step) for step in range(8)] and set(loops) == {1, 2, 3}
    assert load(workdir / "sampled")["config"]["loop_sampling"] == "uniform"
    for r in records(workdir / "sampled", "eval"):
        assert list(r["val_loss_by_loops"]) == ["1", "2", "3"] and r["val_loss_by_loops"]["2"] == r["val_loss"]
    assert re.search(r"step 8: train loss .*; val loss at 1/2/3 loops [\d.]+/[\d.]+/[\d.]+\n", result.stdout)
    result = train(workdir, "--out_dir=sampled", "--max_iters=9", "--init_from=resume", "--loop_sampling=uniform",
                   "--loop_min=1", "--loop_max=4", expect_rc=2, lab=True)
    assert result.stderr == ("error: resuming sampled/ckpt.pt with another model: loop_max=4 (checkpoint: 3); use the "
                             "run's config unchanged\n")
    result = run_script("lab/plot.py", "sampled", "--png=sampled.png", cwd=workdir)
    by_loops = records(workdir / "sampled", "eval")[-1]["val_loss_by_loops"]
    depth_table = result.stdout.split("val loss at the last evaluation, by loop count at test time:")[1]
    assert depth_table.split("\n\n")[1].splitlines()[-1] == "| deeploop, n_loop=2 (trained at uniform 1..3) | " + \
        " | ".join(f"{by_loops[loops]:.3f}" for loops in "123") + " |"


def test_builtin_data_is_prepared_on_demand_and_kappa_is_one_without_looping(tmp_path):
    result = train(tmp_path, "--dataset=builtin_bytes", "--out_dir=unlooped", "--n_loop=1", "--max_iters=1",
                   "--eval_interval=1", lab=True)
    assert "preparing data/builtin_bytes" in result.stdout
    assert json.loads((tmp_path / "data" / "builtin_bytes" / "meta.json").read_text())["tokenizer"] == "bytes"
    assert load(tmp_path / "unlooped")["model_args"]["vocab_size"] == 320
    evals = records(tmp_path / "unlooped", "eval")
    assert len(evals) == 2
    for r in evals:  # one visit per block: its gradient is the block's whole gradient
        assert r["loop"]["kappa"] == pytest.approx([1.0, 1.0])
        assert [len(g) for g in r["loop"]["grad_norm"]] == [1, 1]


@pytest.mark.parametrize("overrides,message", [
    (["--loop_sampling=uniform", "--loop_min=1", "--loop_max=5000"],
     "loop_sampling=uniform needs 1 <= loop_min <= loop_max <= 1024 (model.MAX_LOOPS), got loop_min=1 loop_max=5000"),
    (["--eval_loops=1,5000"], 'eval_loops must be loop counts from 1 to 1024 separated by commas, like "1,2,4", got '
                              "'1,5000'"),
    (["--loop_sampling=lognormal_poisson", "--loop_mean=1e400"],
     "loop_sampling=lognormal_poisson needs 1 <= loop_mean <= 1024 (model.MAX_LOOPS), got inf"),
    (["--n_loop=5000"], "n_loop must be a loop count from 1 to 1024 (model.MAX_LOOPS), got 5000"),
    (["--seed=-1"], "seed must be from 0 to 2**31 - 1, got -1"),
])
def test_a_loop_count_or_seed_out_of_range_is_a_one_line_error(overrides, message, workdir, tmp_path):
    """A typo in a loop count (--loop_max=1000000000000) ran a step that never ended, growing its memory, or crashed
    after the first checkpoint (loop_mean=inf); a negative seed ended in numpy's traceback. Each stops before
    training writes anything. 5000, not the typo itself, and max_iters=0: code without the bound ends too."""
    result = train(workdir, f"--out_dir={tmp_path / 'typo'}", "--max_iters=0", *overrides, expect_rc=2,
                   lab=any(o.startswith("--loop_") for o in overrides))
    assert result.stderr == f"error: {message}\n"
    assert not (tmp_path / "typo" / "metrics.jsonl").exists() and not (tmp_path / "typo" / "ckpt.pt").exists()


def test_chain_settings_on_text_are_a_one_line_error_and_a_loop_input_no_step_reads_a_warning(workdir, tmp_path):
    """chain_* settings mean something on dataset=chains only: on text they stop the run before it writes anything
    (at their defaults, as a task's config file run on text sets them, they pass). A loop_input at one loop a step
    is merely useless (it is fed into loops 2 on): the run trains, with a warning."""
    for overrides, changed in [(["--chain_curriculum=100"], "chain_curriculum=100"),
                               (["--chain_pointers=foo", "--chain_hops=3"], "chain_hops=3, chain_pointers='foo'")]:
        result = train(workdir, f"--out_dir={tmp_path / 'chains'}", "--max_iters=0", *overrides, expect_rc=2, lab=True)
        assert result.stderr == f"error: chain settings only apply to dataset=chains, not fixture ({changed}); leave " \
                                f"them at their defaults or use --dataset=chains\n"
        assert not (tmp_path / "chains").exists()
    train(workdir, f"--out_dir={tmp_path / 'defaults'}", "--max_iters=0", "--chain_hops=6", "--chain_values=8", lab=True)
    warning = ("warning: loop_input=concat never trains: every step runs one loop, and the input is fed into loops 2 on "
               "(model.LoopInput); use --loop_input=none or more loops")
    for i, (overrides, warned) in enumerate([(["--n_loop=1"], True), (["--n_loop=1", *SAMPLED], False),
                                             (["--loop_sampling=uniform", "--loop_min=1", "--loop_max=1"], True)]):
        result = train(workdir, f"--out_dir={tmp_path / f'unread{i}'}", "--max_iters=1", "--loop_input=concat",
                       *overrides, lab=True)
        assert (warning in result.stderr.splitlines()) == warned, result.stderr


def test_mfu_counts_the_loops_each_step_ran(workdir):
    """MFU over tokens/s is FLOPs per token over peak_flops: the FLOPs of the loops each logged step ran, its backward
    pass over the tracked loops only. 4 loops sampled on a model built for 1 count as 4 loops."""
    train(workdir, "--out_dir=mfu", "--max_iters=6", "--n_loop=1", *SAMPLED, "--backprop_loops=2", lab=True)
    model = load_checkpoint(str(workdir / "mfu" / "ckpt.pt"))[0]
    steps = records(workdir / "mfu", "train")
    assert {r["loops"] for r in steps} == {1, 2, 3}
    for r in steps:
        assert r["mfu"] * 1e12 / r["tokens_per_sec"] == pytest.approx(flops_per_token(model, r["loops"], 2), rel=1e-9)
    train(workdir, "--out_dir=mfu4", "--max_iters=2", "--n_loop=1", "--loop_sampling=uniform", "--loop_min=4",
          "--loop_max=4", lab=True)
    for r in records(workdir / "mfu4", "train"):
        assert r["mfu"] * 1e12 / r["tokens_per_sec"] == pytest.approx(
            flops_per_token(GPT(GPTConfig(**{**load(workdir / "mfu4")["model_args"], "n_loop": 4}))), rel=1e-9)


def test_missing_dataset_names_the_command_that_prepares_it(tmp_path):
    result = train(tmp_path, "--dataset=openwebtext", expect_rc=2)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: dataset data/openwebtext not found"), lines
    assert lines[0].endswith("python prepare_data.py openwebtext")
    assert os.listdir(tmp_path) == []  # no out_dir made, no lock file left


@pytest.mark.parametrize("overrides,message", [
    (["--init_from=resume"], "no checkpoint at {out}/ckpt.pt to resume: leave out --init_from=resume to start a run "
                             "there, or point --out_dir at the run's folder"),
    (["--device=cuda"], "--device=cuda is not usable here (the devices here: cpu"),
    (["--device=cuda:1"], "--device=cuda:1 is not usable here (the devices here: cpu"),
    (["--device=gpu"], "--device=gpu is not usable here (the devices here: cpu"),
    (["--EVAL_SEED=5"], "unknown config key 'EVAL_SEED' in --EVAL_SEED; known keys: batch_size, "),
    (["--out_dir="], "--out_dir is empty: name the run's folder, e.g. --out_dir=out-smoke"),
    # ValueErrors of AdamW and of nn.Dropout, once out_dir and train.lock were made
    *[([arg], f"{arg[2:]}: learning_rate, min_lr and weight_decay must be >= 0, beta1, beta2 and dropout from 0 to "
              f"below 1") for arg in ("--learning_rate=-1.0", "--beta1=5.0", "--dropout=2.0", "--weight_decay=-0.1")],
    (["--beta2=1.0", "--min_lr=-1e-05"], "min_lr=-1e-05, beta2=1.0: learning_rate, min_lr and weight_decay must be"),
    # a negative max_iters would run no step and write a checkpoint of step 0
    (["--max_iters=-5"], "max_iters=-5: step numbers must be >= 0 (max_iters=0 evaluates the initial model only)"),
    (["--lr_decay_iters=-1", "--warmup_iters=-2"], "warmup_iters=-2, lr_decay_iters=-1: step numbers must be >= 0"),
    # a block_size of 0 trained on to a nan loss at step 0
    (["--block_size=0"], "block_size=0: counts and sizes must be >= 1"),
    (["--n_embd=0", "--n_head=0"], "n_head=0, n_embd=0: counts and sizes must be >= 1"),
    (["--n_embd=33"], "n_embd=33 is not divisible by n_head=2"),
    (["--position_encoding=rope", "--n_head=32"], "rope rotates pairs of channels: the head size n_embd/n_head=1 must "
                                                  "be even"),
])
def test_a_start_that_fails_is_one_line_and_leaves_no_out_dir_or_lock(overrides, message, workdir, tmp_path):
    """Each stops before anything is made: no out_dir (where it is missing), no train.lock in one that exists. A
    device that is not here failed in a traceback at GPT(...).to(device), leaving train.lock; EVAL_SEED, which
    train.py imports, changed the evaluation windows that every run on a dataset shares."""
    if torch.cuda.device_count() > (1 if "--device=cuda:1" in overrides else 0):
        pytest.skip("this machine has that GPU")
    for out in (tmp_path / "missing", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        result = train(workdir, f"--out_dir={out}", "--max_iters=1", *overrides, expect_rc=2)
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: " + message.format(out=out)), result.stderr
        assert sorted(os.listdir(tmp_path)) == ["empty"] and os.listdir(tmp_path / "empty") == []


def test_a_rerun_from_scratch_changes_nothing_and_start_over_moves_the_run_aside(workdir, first_half):
    """The same command twice, without --init_from=resume, truncated metrics.jsonl at once and replaced ckpt.pt at
    the first evaluation."""
    half_dir, _ = first_half
    out_dir = workdir / "rerun"
    shutil.copytree(half_dir, out_dir)
    before = {name: (out_dir / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl", "train.lock")}
    result = train(workdir, "--out_dir=rerun", f"--max_iters={HALF}", "--dropout=0.1", expect_rc=2)
    assert result.stderr == ("error: rerun holds an earlier run (ckpt.pt, metrics.jsonl), which a run from scratch "
                             "would overwrite: continue it with --init_from=resume, choose another --out_dir, or set "
                             "--start_over=True to move its files aside (into rerun/previous-N) and start afresh\n")
    assert {name: (out_dir / name).read_bytes() for name in before} == before and len(os.listdir(out_dir)) == 3
    result = train(workdir, "--out_dir=rerun", "--max_iters=2", "--dropout=0.1", "--start_over=True")
    assert "start_over: moved rerun's ckpt.pt and metrics.jsonl into rerun/previous-1" in result.stdout.splitlines()
    assert {name: (out_dir / "previous-1" / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl")} == \
        {name: before[name] for name in ("ckpt.pt", "metrics.jsonl")}
    assert load(out_dir)["iter_num"] == 2 and [r["iter"] for r in records(out_dir, "train")] == [0, 1]


def test_a_damaged_checkpoint_on_resume_says_that_it_is_damaged(workdir, first_half):
    half_dir, _ = first_half
    out_dir = workdir / "damaged"
    shutil.copytree(half_dir, out_dir)
    whole_file = (out_dir / "ckpt.pt").read_bytes()
    (out_dir / "ckpt.pt").write_bytes(whole_file[:len(whole_file) // 2])  # a copy cut short
    result = train(workdir, "--out_dir=damaged", "--init_from=resume", f"--max_iters={2 * HALF}", "--dropout=0.1",
                   expect_rc=2)
    assert re.fullmatch(r"error: damaged/ckpt.pt is damaged: a checkpoint that does not load whole \(\w+\), cut short "
                        r"or corrupted after it was written, e.g. by an interrupted copy; copy it again from where it "
                        r"came from\n", result.stderr), result.stderr


def start(cwd, *overrides, wrapper=(), env=None):
    """train.py started in the background, its output to a file (a pipe that nobody reads could fill and stall it):
    forked from this process, or a new process with env (the DDP ranks: their start and end are under test). A
    wrapper script, when given, runs train.py."""
    log = open(os.path.join(cwd, f"train-{time.monotonic_ns()}.log"), "w+")
    if env is None:
        return Started(*wrapper, TRAIN, *TINY, *overrides, cwd=cwd, log=log)
    proc = subprocess.Popen([sys.executable, *wrapper, TRAIN, *TINY, *overrides], cwd=cwd, env=env, stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    proc.log = log
    return proc


def start_ranks(cwd, *overrides):
    """Two DDP processes (gloo), started as a launcher that sets RANK but not LOCAL_RANK would start them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [start(cwd, *overrides, env=dict(ENV, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT=str(port))) for rank in range(2)]


def wait_for(condition, proc, what, timeout=120):
    deadline = time.time() + timeout
    while True:
        ended = proc.poll() is not None
        if condition():
            return
        assert not ended, f"the run ended before {what}: " + output(proc)[-3000:]
        assert time.time() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.01)


def output(proc):
    proc.log.seek(0)
    return proc.log.read()


def logged_steps(out_dir, kind="train"):
    """Steps of the records of this kind in out_dir/metrics.jsonl so far (while a run writes it)."""
    path = os.path.join(out_dir, "metrics.jsonl")
    return [r["iter"] for r in read_metrics(path) if r["type"] == kind] if os.path.exists(path) else []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_the_step_and_resuming_equals_an_uninterrupted_run(workdir, whole, signum):
    out_dir = workdir / f"stopped-{signum.name}"
    proc = start(workdir, f"--out_dir={out_dir.name}", f"--max_iters={2 * HALF}", "--dropout=0.1")
    wait_for(lambda: logged_steps(out_dir), proc, "its first train record")
    proc.send_signal(signum)
    assert proc.wait(timeout=120) == 75, output(proc)[-3000:]
    text = output(proc)
    assert "Traceback" not in text
    last_line = text.strip().splitlines()[-1]
    match = re.fullmatch(rf"stopped by {signum.name}: {out_dir.name}/ckpt.pt holds step (\d+); resume with: python "
                         rf"\S*train.py .*--out_dir={out_dir.name} .*--dropout=0.1 --init_from=resume", last_line)
    assert match, last_line
    step = int(match.group(1))
    assert 0 < step < 2 * HALF and load(out_dir)["iter_num"] == step
    assert max(logged_steps(out_dir)) == step - 1  # the step under way when the signal came was finished
    train(workdir, f"--out_dir={out_dir.name}", f"--max_iters={2 * HALF}", "--dropout=0.1", "--init_from=resume")
    assert_same_run(whole, out_dir)


def test_a_stopped_lab_run_prints_the_command_that_resumes_it_under_the_lab(workdir):
    """python -m lab.train, started through its own entry (which runs train.py), stopped by SIGTERM: the command it
    prints, split as a shell splits it, is the run's own under -m lab.train (an out_dir with two spaces in it kept);
    run as printed, it resumes the run under the lab, to its end."""
    out_dir = workdir / "lab  stopped"
    args = [*TINY, f"--out_dir={out_dir.name}", "--max_iters=24", "--eval_interval=12", *SAMPLED]
    with open(workdir / f"train-{time.monotonic_ns()}.log", "w+") as log:
        proc = Started("-m lab.train", *args, cwd=workdir, log=log)
        proc.log = log
        wait_for(lambda: logged_steps(out_dir), proc, "its first train record")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 75, output(proc)[-3000:]
        line = output(proc).strip().splitlines()[-1]
    match = re.fullmatch(rf"stopped by SIGTERM: {out_dir.name}/ckpt.pt holds step (\d+); resume with: (.*)", line)
    assert match, line
    command = shlex.split(match.group(2))
    assert command == ["python", "-m", "lab.train", *args, "--init_from=resume"]
    with open(workdir / f"train-{time.monotonic_ns()}.log", "w+") as log:
        resumed = Started(" ".join(command[1:3]), *command[3:], cwd=workdir, log=log)
        assert resumed.wait(timeout=120) == 0, log.read()
    assert load(out_dir)["iter_num"] == 24 and load(out_dir)["lab"] == dict(loop_sampling="uniform", loop_min=1,
                                                                              loop_max=3)
    assert [(s["iter"], s["resumed"]) for s in records(out_dir, "start")] == [(0, False), (int(match.group(1)), True)]


def test_a_second_signal_while_saving_stops_at_once_and_keeps_the_previous_checkpoint(workdir, first_half):
    """The checkpoint write is made slow (a wrapper around open); a second SIGTERM during it ends the process at
    once, with the shell's code for SIGTERM, and ckpt.pt stays the previous one, whole."""
    half_dir, _ = first_half
    out_dir = workdir / "second-signal"
    shutil.copytree(half_dir, out_dir)
    before = (out_dir / "ckpt.pt").read_bytes()
    proc = start(workdir, f"--out_dir={out_dir.name}", "--max_iters=1000", "--init_from=resume", "--dropout=0.1",
                 "--eval_interval=100", wrapper=(disk_wrapper(workdir), "slow", "ckpt.pt.tmp", "60"))
    wait_for(lambda: logged_steps(out_dir)[-1] > HALF, proc, "a train record after the resume")
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: (out_dir / "ckpt.pt.tmp.slow").exists(), proc, "the checkpoint write")
    time.sleep(1.2)  # a repeat within a second counts as the same signal
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM and time.time() - t0 < 10
    assert output(proc).strip().splitlines()[-1] == "stopped by SIGTERM without saving (a second signal)"
    assert (out_dir / "ckpt.pt").read_bytes() == before and not (out_dir / "ckpt.pt.tmp").exists()


def test_a_signal_during_an_evaluation_stops_after_its_checkpoint(workdir, first_half, whole):
    """SIGTERM while the evaluation at step 8 writes ckpt.pt (made slow): the run stops once that write is done,
    without training step 8 and writing again; the resumed run skips the evaluation and ends as an uninterrupted one."""
    half_dir, _ = first_half
    out_dir = workdir / "eval-stopped"
    shutil.copytree(half_dir, out_dir)
    args = [f"--out_dir={out_dir.name}", f"--max_iters={2 * HALF}", "--dropout=0.1", "--init_from=resume"]
    proc = start(workdir, *args, wrapper=(disk_wrapper(workdir), "slow", "ckpt.pt.tmp", "2"))
    wait_for(lambda: (out_dir / "ckpt.pt.tmp.slow").exists(), proc, "the evaluation's checkpoint write")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 75, output(proc)[-3000:]
    ckpt = load(out_dir)
    assert (ckpt["iter_num"], ckpt["evaluated"]) == (8, True)
    assert max(logged_steps(out_dir)) == 7 and max(logged_steps(out_dir, "eval")) == 8
    assert output(proc).strip().splitlines()[-1].startswith(
        f"stopped by SIGTERM: {out_dir.name}/ckpt.pt holds step 8; resume with: python ")
    train(workdir, *args)
    assert_same_run(whole, out_dir)


def test_a_signal_during_a_long_evaluation_stops_it_at_once_and_resuming_is_exact(workdir, first_half, whole,
                                                                                 monkeypatch):
    """SIGTERM during the evaluation at step 8, made endless (eval_iters=10**9): the evaluation stops at its next
    batch instead of running to its end (then the diagnostics, then the write), ckpt.pt gets step 8 unevaluated, and
    the run resumed with the usual eval_iters evaluates step 8 and ends as an uninterrupted one, bit for bit."""
    half_dir, _ = first_half
    out_dir = workdir / "eval-cut"
    shutil.copytree(half_dir, out_dir)
    marker = workdir / "eval-cut.evaluating"
    batch = TokenWindows.batch

    def marked(self, index, batch_size):  # the second batch of an evaluation's train split: it is under way
        if self.seed == EVAL_SEED and index == 1:
            marker.touch()
        return batch(self, index, batch_size)
    monkeypatch.setattr(TokenWindows, "batch", marked)  # in the forked run as well
    args = [f"--out_dir={out_dir.name}", f"--max_iters={2 * HALF}", "--dropout=0.1", "--init_from=resume"]
    proc = start(workdir, *args, "--eval_iters=1000000000")
    monkeypatch.undo()
    try:
        wait_for(marker.exists, proc, "the evaluation at step 8")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 75, output(proc)[-3000:]
    finally:
        proc.kill()  # if it did not stop
        proc.wait()
    assert output(proc).strip().splitlines()[-1].startswith(
        f"stopped by SIGTERM: {out_dir.name}/ckpt.pt holds step 8; resume with: python ")
    ckpt = load(out_dir)
    assert (ckpt["iter_num"], ckpt["evaluated"]) == (8, False)
    assert max(logged_steps(out_dir)) == 7 and max(logged_steps(out_dir, "eval")) == HALF
    train(workdir, *args)
    assert_same_run(whole, out_dir)


def test_a_failed_first_checkpoint_write_says_to_start_over(workdir):
    """A full disk at the evaluation of step 0: nothing to resume; the run that the line proposes then works."""
    out_dir = workdir / "full-first"
    proc = start(workdir, f"--out_dir={out_dir.name}", "--max_iters=2",
                 wrapper=(disk_wrapper(workdir), "full", "ckpt.pt.tmp", "5000"))
    assert proc.wait(timeout=300) == 2 and "Traceback" not in output(proc)
    assert output(proc).strip().splitlines()[-1:] == [
        f"error: writing {out_dir.name}/ckpt.pt failed at step 0: No space left on device; this run wrote no "
        f"checkpoint yet; make room (or fix the folder) and run again with --start_over=True (a run from scratch "
        f"there moves this one's files aside)"]
    assert not (out_dir / "ckpt.pt").exists()
    train(workdir, f"--out_dir={out_dir.name}", "--max_iters=2", "--start_over=True")
    assert load(out_dir)["iter_num"] == 2 and (out_dir / "previous-1" / "metrics.jsonl").exists()


def test_a_second_run_on_a_held_out_dir_is_refused(workdir):
    first = start(workdir, "--out_dir=held", "--max_iters=100000")
    try:
        wait_for(lambda: logged_steps(workdir / "held"), first, "its first train record")
        result = train(workdir, "--out_dir=held", "--max_iters=2", expect_rc=2)
        assert result.stderr.strip().splitlines() == [
            f"error: held is in use by another train.py (pid {first.pid} on {socket.gethostname()}); wait for it "
            f"to end, stop it with kill -TERM, or choose another --out_dir"]
        assert first.poll() is None  # the first run goes on, and its log was not touched
        assert records(workdir / "held", "start")[0]["config"]["max_iters"] == 100000
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 75


def disk_wrapper(cwd):
    """A script that runs train.py with the writes of one file changed: "full": the disk fills after n bytes (the
    write that crosses them writes what fits, then fails with ENOSPC); "slow": the first write waits n seconds."""
    path = os.path.join(cwd, "disk_wrapper.py")
    with open(path, "w") as f:
        f.write('''import builtins, errno, os, runpy, sys, time
behaviour, suffix, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
real_open = builtins.open


class Disk:
    def __init__(self, f):
        self.f, self.room, self.slow = f, n, behaviour == "slow"

    def write(self, data):
        data = bytes(data)
        if self.slow:
            real_open(self.f.name + ".slow", "w").close()
            time.sleep(n)
            self.slow = False
        elif behaviour == "full" and len(data) > self.room:
            self.f.write(data[:self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def patched_open(file, mode="r", *args, **kwargs):
    f = real_open(file, mode, *args, **kwargs)
    return Disk(f) if str(file).endswith(suffix) and mode[0] in "wa" else f


builtins.open = patched_open
sys.argv = sys.argv[4:]
sys.path[0] = os.path.dirname(sys.argv[0])  # where train.py finds its modules, as when it is run itself
runpy.run_path(sys.argv[0], run_name="__main__")
''')
    return path


def test_a_full_disk_keeps_the_previous_checkpoint(workdir, first_half):
    half_dir, _ = first_half
    out_dir = workdir / "full-ckpt"
    shutil.copytree(half_dir, out_dir)
    before = (out_dir / "ckpt.pt").read_bytes()
    proc = start(workdir, f"--out_dir={out_dir.name}", f"--max_iters={2 * HALF}", "--init_from=resume",
                 "--dropout=0.1", wrapper=(disk_wrapper(workdir), "full", "ckpt.pt.tmp", "5000"))
    assert proc.wait(timeout=300) == 2 and "Traceback" not in output(proc)
    assert output(proc).strip().splitlines()[-1:] == [
        f"error: writing {out_dir.name}/ckpt.pt failed at step 8: No space left on device; {out_dir.name}/ckpt.pt "
        f"keeps step {HALF}; make room (or fix the folder) and resume with --init_from=resume"]
    assert (out_dir / "ckpt.pt").read_bytes() == before and not (out_dir / "ckpt.pt.tmp").exists()
    load_checkpoint(str(out_dir / "ckpt.pt"))


def test_a_full_disk_leaves_no_half_record_in_metrics(workdir):
    out_dir = workdir / "full-metrics"
    proc = start(workdir, f"--out_dir={out_dir.name}", "--max_iters=1000",
                 wrapper=(disk_wrapper(workdir), "full", "metrics.jsonl", "4000"))
    assert proc.wait(timeout=300) == 2 and "Traceback" not in output(proc)
    lines = [line for line in output(proc).strip().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and re.fullmatch(rf"error: writing {out_dir.name}/metrics.jsonl failed at step \d+: No "
                                            rf"space left on device; {out_dir.name}/ckpt.pt keeps step \d+; .*",
                                            lines[0]), lines
    text = (out_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines())
    assert len(text) < 4000  # the record that did not fit was cut off again


def test_a_record_cut_short_is_removed_on_resume(workdir, first_half):
    half_dir, _ = first_half
    out_dir = workdir / "torn"
    shutil.copytree(half_dir, out_dir)
    with open(out_dir / "metrics.jsonl", "a") as f:
        f.write('{"type": "train", "iter": 6, "lo')  # what a run killed in the middle of a write could leave
    result = train(workdir, f"--out_dir={out_dir.name}", f"--max_iters={HALF + 1}", "--init_from=resume",
                   "--dropout=0.1")
    assert f"note: {out_dir.name}/metrics.jsonl ended in a record cut short; removed it" in result.stdout
    assert [r["iter"] for r in records(out_dir, "train")] == list(range(HALF + 1))


def test_a_resume_drops_what_a_run_killed_after_its_checkpoint_logged(workdir, first_half, whole):
    """A run killed (SIGKILL) after its checkpoint of step HALF had logged the steps after it: the resumed run logs
    them again, and metrics.jsonl holds each step's records once, as the uninterrupted run's does."""
    half_dir, _ = first_half
    out_dir = workdir / "killed-later"
    shutil.copytree(half_dir, out_dir)
    later = [line for line in (whole / "metrics.jsonl").read_text().splitlines(keepends=True)
             if json.loads(line)["iter"] > HALF or json.loads(line)["type"] == "train" and json.loads(line)["iter"] == HALF]
    with open(out_dir / "metrics.jsonl", "a") as f:  # what the killed run logged: the uninterrupted run's later records
        f.writelines(later[:-1])
    result = train(workdir, f"--out_dir={out_dir.name}", f"--max_iters={2 * HALF}", "--init_from=resume",
                   "--dropout=0.1")
    assert f"note: {out_dir.name}/metrics.jsonl held {len(later) - 1} record(s) from after step {HALF}'s checkpoint " \
           f"(a run killed later than it), which this run writes again; removed them" in result.stdout.splitlines()
    assert [r["iter"] for r in records(out_dir, "train")] == list(range(2 * HALF))
    assert [r["iter"] for r in records(out_dir, "eval")] == [0, 4, HALF, 8, 12]
    assert_same_run(whole, out_dir)


def test_a_run_killed_as_it_logs_an_evaluation_evaluates_that_step_again_on_resume(workdir, first_half, whole):
    """A run that dies (no cleanup) in the write of its evaluation record of step 8: the checkpoint of that step comes
    after the record, so ckpt.pt still holds step HALF, and the resumed run evaluates step 8 again. Had the checkpoint
    come first, it would say "evaluated" and the record would be missing for good."""
    half_dir, _ = first_half
    out_dir = workdir / "killed-at-eval"
    shutil.copytree(half_dir, out_dir)
    wrapper = workdir / "eval_kill_wrapper.py"
    wrapper.write_text('''import os, runpy, sys
sys.path[0] = os.path.dirname(sys.argv[2])  # where train.py finds its modules, as when it is run itself
import guard
write, step = guard.MetricsLog.write, int(sys.argv[1])


def dying_write(self, record):
    if record["type"] == "eval" and record["iter"] == step:
        os._exit(137)
    return write(self, record)


guard.MetricsLog.write = dying_write
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
''')
    args = [f"--out_dir={out_dir.name}", f"--max_iters={2 * HALF}", "--dropout=0.1", "--init_from=resume"]
    proc = start(workdir, *args, wrapper=(str(wrapper), "8"))
    assert proc.wait(timeout=300) == 137, output(proc)[-3000:]
    assert load(out_dir)["iter_num"] == HALF and 8 not in logged_steps(out_dir, "eval")
    train(workdir, *args)
    assert [r["iter"] for r in records(out_dir, "eval")] == [0, 4, HALF, 8, 12]
    assert_same_run(whole, out_dir)


def test_ten_sigkills_at_random_moments_then_the_same_final_weights(workdir, whole):
    """A checkpoint at every step; ten times the run is killed (SIGKILL: no cleanup) at a random moment after it
    wrote a checkpoint of its own (so that every attempt gets further, however slow a loaded machine makes a step),
    and restarted from whatever ckpt.pt holds. It always loads, and the run ends as one that never stopped."""
    out_dir, rng = workdir / "chaos", random.Random(0)
    args = [f"--out_dir={out_dir.name}", f"--max_iters={2 * HALF}", "--dropout=0.1", "--eval_interval=1"]

    def checkpoint_step():
        return load(out_dir)["iter_num"] if (out_dir / "ckpt.pt").exists() else -1

    for attempt in range(10):
        resume = ["--init_from=resume"] if (out_dir / "ckpt.pt").exists() else []
        step_before = checkpoint_step()
        proc = start(workdir, *args, *resume)
        try:
            wait_for(lambda: checkpoint_step() > step_before or proc.poll() is not None, proc, "a checkpoint")
            time.sleep(rng.uniform(0, 0.05))  # about one step: the kill falls in its training, evaluation or write
        finally:
            proc.kill()
            proc.wait()
        if (out_dir / "ckpt.pt").exists():
            load_checkpoint(str(out_dir / "ckpt.pt"))
    assert 0 < load(out_dir)["iter_num"]
    train(workdir, *args, "--init_from=resume")
    ckpt, expected = load(out_dir), load(whole)
    assert ckpt["iter_num"] == 2 * HALF
    for key, tensor in expected["model"].items():
        assert torch.equal(tensor, ckpt["model"][key]), key
    assert [r["iter"] for r in records(out_dir, "train")] == list(range(2 * HALF))  # each step's record once


def test_losses_are_read_only_at_log_steps_and_come_out_the_same(workdir, whole):
    """log_interval=3: the loss stays on the device between log lines; the logged ones equal those of whole (read at
    every step). The output is not a terminal: one plain line per log step, no progress bar."""
    result = train(workdir, "--out_dir=every3", f"--max_iters={2 * HALF}", "--dropout=0.1", "--log_interval=3")
    logged = {r["iter"]: (r["loss"], r["grad_norm"]) for r in records(workdir / "every3", "train")}
    assert sorted(logged) == [0, 3, 6, 9]
    assert logged == {r["iter"]: (r["loss"], r["grad_norm"]) for r in records(whole, "train") if r["iter"] in logged}
    assert re.findall(r"^step (\d+)/12: loss [\d.]+ lr \S+ tok/s [\d,]+ mfu", result.stdout, re.M) == \
        ["0", "3", "6", "9"]
    assert "\r" not in result.stdout + result.stderr


def test_time_based_checkpoints(workdir):
    result = train(workdir, "--out_dir=timed", "--max_iters=4", "--eval_interval=100", "--checkpoint_minutes=1e-9")
    # after every step: the evaluation at step 0 wrote one, step 4 is the end (an evaluation again)
    assert re.findall(r"^step (\d+): wrote timed/ckpt.pt", result.stdout, re.M) == ["1", "2", "3"]
    assert load(workdir / "timed")["iter_num"] == 4


def test_diagnostics_do_not_run_in_float16(workdir):
    """Under float16 autocast the per-visit gradients would underflow without loss scaling; the diagnostics run in
    float32 instead and equal a float32 run's at step 0 (the same initial weights, the same batch)."""
    train(workdir, "--out_dir=diag-float32", "--max_iters=1", "--eval_interval=1", lab=True)
    train(workdir, "--out_dir=diag-float16", "--dtype=float16", "--max_iters=1", "--eval_interval=1", lab=True)
    assert records(workdir / "diag-float16", "eval")[0]["loop"] == records(workdir / "diag-float32", "eval")[0]["loop"]


def test_plot_draws_any_number_of_runs(workdir, first_half):
    half_dir, _ = first_half
    train(workdir, "--out_dir=half-probed", f"--max_iters={HALF}", "--dropout=0.1", lab=True)
    train(workdir, "--out_dir=deepnorm", "--residual=deepnorm", "--n_loop=1", "--max_iters=4", lab=True)
    result = run_script("lab/plot.py", "half-probed", "deepnorm", "--png=both.png", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "wrote both.png: deeploop, n_loop=2; deepnorm, n_loop=1"
    # the probes of both runs' last evaluations, a row each: 2 x 2 visits, or 2 blocks once, and the core's input
    assert re.search(r"\| deeploop, n_loop=2 \|( [\d.]+ \|){5}\n\| deepnorm, n_loop=1 \|( [\d.]+ \|){3}  \|  \|\n",
                     result.stdout), result.stdout
    assert (workdir / "both.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failure_on_rank_0_only_stops_every_rank(workdir):
    """Rank 0 cannot lock out_dir (this test holds the lock); rank 1 must not wait for it in a collective."""
    os.makedirs(workdir / "rank0-fails", exist_ok=True)
    with open(workdir / "rank0-fails" / "train.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write("pid 4242 on elsewhere\n")
        lock.flush()
        procs = start_ranks(workdir, "--out_dir=rank0-fails")
        assert [p.wait(timeout=120) for p in procs] == [2, 2]
    assert output(procs[0]).strip().startswith("error: rank0-fails is in use by another train.py (pid 4242 on "
                                               "elsewhere)")
    assert output(procs[1]) == ""


def test_a_signal_to_one_ddp_process_stops_both_at_the_same_step(workdir):
    out_dir = workdir / "ddp-stopped"
    procs = start_ranks(workdir, f"--out_dir={out_dir.name}", "--max_iters=100000", "--dropout=0.1")
    wait_for(lambda: logged_steps(out_dir), procs[0], "its first train record")
    procs[1].send_signal(signal.SIGTERM)  # the other process learns of it at the start of the next step
    assert [p.wait(timeout=120) for p in procs] == [75, 75]
    ckpt = load(out_dir)
    assert len(ckpt["rng"]) == 2 and not ckpt["evaluated"]
    assert max(logged_steps(out_dir)) == ckpt["iter_num"] - 1
    assert re.fullmatch(rf"stopped by SIGTERM: {out_dir.name}/ckpt.pt holds step {ckpt['iter_num']}; resume with: "
                        rf"python .* --init_from=resume \(launched as this run was\)",
                        output(procs[0]).strip().splitlines()[-1])
    assert output(procs[1]) == ""
    # resumed as it says, the two processes train on to the end and both exit cleanly
    end = ckpt["iter_num"] + 2
    procs = start_ranks(workdir, f"--out_dir={out_dir.name}", f"--max_iters={end}", "--dropout=0.1",
                        "--init_from=resume")
    assert [p.wait(timeout=120) for p in procs] == [0, 0], output(procs[0])[-3000:] + output(procs[1])[-3000:]
    assert load(out_dir)["iter_num"] == end and max(logged_steps(out_dir)) == end - 1
    assert "Traceback" not in output(procs[0]) and output(procs[1]) == ""


PAPER = ["--norm=rmsnorm", "--position_encoding=rope", "--norm_branch_input=True"]  # config/paper_*.py's backbone


@pytest.fixture(scope="module")
def paper_fp32(workdir):
    """4 eager float32 steps of the paper's backbone, evaluated every 2 steps."""
    train(workdir, "--out_dir=paper_fp32", "--max_iters=4", "--eval_interval=2", *PAPER)
    return workdir / "paper_fp32"


def test_bfloat16_autocast_trains_the_paper_backbone_on_cpu(workdir, paper_fp32):
    """The GPU recipe's precision, through CPU autocast: the rotary q/k keep v's dtype and the run stays finite."""
    train(workdir, "--out_dir=paper_bf16", "--dtype=bfloat16", "--max_iters=4", "--eval_interval=2", *PAPER)
    ckpt = load(workdir / "paper_bf16")
    assert {k: ckpt["model_args"][k] for k in ("norm", "position_encoding", "norm_branch_input")} == dict(
        norm="rmsnorm", position_encoding="rope", norm_branch_input=True)
    fp32 = [r["loss"] for r in records(paper_fp32, "train")]
    bf16 = [r["loss"] for r in records(workdir / "paper_bf16", "train")]
    assert bf16 == pytest.approx(fp32, rel=2e-2) and bf16 != fp32  # close, but computed in another precision
    assert records(workdir / "paper_bf16", "eval")[-1]["val_loss"] == pytest.approx(
        records(paper_fp32, "eval")[-1]["val_loss"], rel=2e-2)


def compiled_and_eager(folder):
    """An eager run of 4 steps, and the same 4 steps compiled, resumed eager after 2, compiled again after 3: started
    with the session (conftest.py), on the builtin bytes, since compiling takes ~30 s. Loop counts sampled, with
    truncated backprop, and evaluated at 9 counts: more than dynamo's recompile_limit (8)."""
    run = ["-m", "lab.train", *TINY, "--dataset=builtin_bytes", "--max_iters=4", "--eval_interval=2", *PAPER,
           "--loop_sampling=lognormal_poisson", "--loop_mean=3.0", "--backprop_loops=1", "--eval_loops=1,3,4,5,6,7,8,9"]
    compiled = f"--out_dir={folder / 'compiled'}"
    return [[*run, f"--out_dir={folder / 'eager'}"], [*run, compiled, "--max_iters=2", "--compile=True"],
            [*run, compiled, "--max_iters=3", "--init_from=resume"],
            [*run, compiled, "--init_from=resume", "--compile=True"]]


EARLY = {"test_compiled_checkpoints_resume_uncompiled_and_back": compiled_and_eager}


def test_compiled_checkpoints_resume_uncompiled_and_back(early):
    """torch.compile on CPU (inductor): a compiled run trains like an eager one, and its checkpoint (no _orig_mod.
    prefixes) resumes into an eager run, whose checkpoint resumes into a compiled run again. Every loop count runs
    compiled: none of them reaches dynamo's recompile_limit, past which it warns and runs the rest uncompiled."""
    result, folder = early
    assert result.returncode == 0, result.stderr[-3000:]
    assert "recompile_limit" not in result.stderr, result.stderr[-3000:]
    assert [r["loops"] for r in records(folder / "compiled", "train")] == [2, 4, 5, 5]  # TrainLoops.draw(1337, 0..3)
    compiled_evals = {r["iter"]: r["val_loss_by_loops"] for r in records(folder / "compiled", "eval")}
    for r in records(folder / "eager", "eval"):  # steps 0, 2, 4 (the compiled run evaluates at 3 too, its end)
        assert list(compiled_evals[r["iter"]]) == [str(loops) for loops in range(1, 10)]
        assert list(compiled_evals[r["iter"]].values()) == pytest.approx(list(r["val_loss_by_loops"].values()),
                                                                         rel=1e-4)
    assert not [k for k in load(folder / "compiled")["model"] if k.startswith("_orig_mod.")]
    assert load(folder / "compiled")["iter_num"] == 4
    eager = {r["iter"]: r["loss"] for r in records(folder / "eager", "train")}
    mixed = {r["iter"]: r["loss"] for r in records(folder / "compiled", "train")}
    assert list(mixed) == [0, 1, 2, 3] and list(mixed.values()) == pytest.approx(list(eager.values()), rel=1e-4)
    starts = records(folder / "compiled", "start")
    assert [(r["resumed"], r["config"]["compile"]) for r in starts] == [(False, True), (True, False), (True, True)]
    for key, tensor in load(folder / "eager")["model"].items():
        torch.testing.assert_close(load(folder / "compiled")["model"][key], tensor, rtol=1e-3, atol=1e-4, msg=key)


def test_checkpoint_from_before_the_backbone_settings_resumes_as_gpt2_blocks(workdir, first_half):
    half_dir, _ = first_half
    shutil.copytree(half_dir, workdir / "old")
    ckpt = load(workdir / "old")
    for key in ("norm", "position_encoding", "norm_branch_input", "n_prelude", "n_coda", "loop_input"):
        del ckpt["model_args"][key]
    torch.save(ckpt, workdir / "old" / "ckpt.pt")
    result = train(workdir, "--out_dir=old", "--init_from=resume", "--norm=rmsnorm", "--dropout=0.1", expect_rc=2)
    assert result.stderr.strip().splitlines() == [
        "error: resuming old/ckpt.pt with another model: norm='rmsnorm' (checkpoint: 'layernorm'); use the run's "
        "config unchanged"]
    train(workdir, "--out_dir=old", "--init_from=resume", f"--max_iters={HALF + 1}", "--dropout=0.1")
    assert load(workdir / "old")["iter_num"] == HALF + 1


def test_prelude_coda_and_loop_input_travel_in_the_checkpoint_and_bad_ones_are_one_line_errors(workdir):
    """Huginn's shape with sampled loop counts and truncated backprop: the checkpoint carries the settings, the loop
    diagnostics cover the core's visits, and resuming with another loop_input or a bad value stops with one line."""
    huginn = ["--n_prelude=1", "--n_coda=1", "--loop_input=concat", *SAMPLED, "--backprop_loops=1"]
    train(workdir, "--out_dir=huginn", "--max_iters=4", *huginn, lab=True)
    ckpt = load(workdir / "huginn")
    assert {k: ckpt["model_args"][k] for k in ("n_prelude", "n_coda", "loop_input")} == dict(
        n_prelude=1, n_coda=1, loop_input="concat")
    model, _ = load_checkpoint(os.path.join(workdir, "huginn", "ckpt.pt"))
    assert (len(model.transformer.prelude), len(model.transformer.coda), model.config.unrolled_depth) == (1, 1, 6)
    assert model.alpha == pytest.approx(12 ** 0.5)  # N = 1 + 2 x 2 + 1
    assert {r["loops"] for r in records(workdir / "huginn", "train")} <= {1, 2, 3}
    loop = records(workdir / "huginn", "eval")[-1]["loop"]
    assert len(loop["residual_rms"]) == 4 and len(loop["kappa"]) == 2  # 2 core blocks x 2 loops
    for override, message in [
        ("--loop_input=add", "resuming huginn/ckpt.pt with another model: loop_input='add' (checkpoint: 'concat'); "
                             "use the run's config unchanged"),
        ("--n_coda=-1", "n_prelude and n_coda must be >= 0 (0 = none), got n_prelude=1 n_coda=-1"),
        ("--loop_input=gate", "unknown loop_input 'gate'; choose one of none, add, concat")]:
        result = train(workdir, "--out_dir=huginn", "--init_from=resume", "--max_iters=5", *huginn, override,
                       expect_rc=2, lab=True)
        assert result.stderr == f"error: {message}\n"
    assert load(workdir / "huginn")["iter_num"] == 4  # nothing overwritten


def test_a_task_run_logs_accuracy_by_k_and_the_shortcuts(tmp_path):
    """--dataset=chains: no data folder; the start record holds the shortcuts, every eval record the val accuracy by
    k, the log line shows it, and a task run's checkpoint names the task where a text run names its tokenizer."""
    r = train(tmp_path, "--dataset=chains", "--chain_values=4", "--chain_hops=3", "--block_size=12", "--max_iters=4",
              "--out_dir=chains", lab=True)
    start, = records(tmp_path / "chains", "start")
    assert start["shortcuts"]["chance"] == {"1": 0.25, "2": 0.25, "3": 0.25}
    evals = records(tmp_path / "chains", "eval")
    assert [e["iter"] for e in evals] == [0, 4] and all(sorted(e["accuracy"]) == ["1", "2", "3"] for e in evals)
    assert all(0 <= a <= 1 for e in evals for a in e["accuracy"].values())
    assert r.stdout.count("val accuracy by k = 1..3: ") == 2 and "the best shortcut" in r.stdout
    assert load(tmp_path / "chains")["tokenizer"] == "chains(values=4, hops=3, cells=12)"
    assert not (tmp_path / "data").exists()


def test_relative_pointers_and_a_curriculum_reach_a_task_run_and_bad_ones_are_one_line_errors(tmp_path):
    """chain_pointers names the task in the checkpoint (resuming with the other one is a one-line error);
    chain_curriculum changes the training batches (chains of one pointer at step 0) but not the evaluations."""
    chains = ["--dataset=chains", "--chain_values=4", "--chain_hops=3", "--block_size=12", "--max_iters=2"]
    train(tmp_path, *chains, "--out_dir=relative", "--chain_pointers=relative", lab=True)
    assert load(tmp_path / "relative")["tokenizer"] == "chains(values=4, hops=3, cells=12, pointers=relative)"
    r = train(tmp_path, *chains, "--out_dir=relative", "--init_from=resume", "--max_iters=4", expect_rc=2, lab=True)
    assert r.stderr == ("error: relative/ckpt.pt was trained on chains(values=4, hops=3, cells=12, pointers=relative) "
                        "but these settings make chains(values=4, hops=3, cells=12); resume with the run's chain "
                        "settings\n")
    assert load(tmp_path / "relative")["iter_num"] == 2  # nothing overwritten
    train(tmp_path, *chains, "--out_dir=plain", lab=True)
    train(tmp_path, *chains, "--out_dir=curriculum", "--chain_curriculum=100", lab=True)
    plain, curriculum = (records(tmp_path / name) for name in ("plain", "curriculum"))
    first_loss = [next(r["loss"] for r in run if r["type"] == "train") for run in (plain, curriculum)]
    assert first_loss[0] != first_loss[1]  # the same weights at step 0, other chains
    evals = [[r for r in run if r["type"] == "eval"][0] for run in (plain, curriculum)]
    assert evals[0]["accuracy"] == evals[1]["accuracy"] and sorted(evals[1]["accuracy"]) == ["1", "2", "3"]
    for override, message in [
        ("--chain_curriculum=-1", "chain_curriculum must be >= 0 (steps over which chains grow to chain_hops; 0: off), "
                                  "got -1"),
        ("--chain_pointers=near", "unknown chain_pointers 'near': use absolute (cell p) or relative (d cells back)")]:
        r = train(tmp_path, *chains, "--out_dir=bad", override, expect_rc=2, lab=True)
        assert r.stderr == f"error: {message}\n"


def test_one_sequence_a_step_trains_through_its_evaluations_without_the_stream_probes(workdir):
    """The stream probes fit on half a batch's sequences and score on the other half: with batch_size=1 there is no
    other half, and the run says so once, evaluates, and records kappa_R without them."""
    r = train(workdir, "--out_dir=one_sequence", "--batch_size=1", "--max_iters=4", lab=True)
    assert "note: batch_size=1 leaves the stream probes (lab.probes) no sequence to score on: none are recorded" in \
        r.stdout.splitlines()
    evals = records(workdir / "one_sequence", "eval")
    assert [e["iter"] for e in evals] == [0, 4] and load(workdir / "one_sequence")["iter_num"] == 4
    for e in evals:
        assert len(e["loop"]["kappa"]) == 2 and "token_probe" not in e["loop"] and "position_probe" not in e["loop"]
