"""lab/model_update.py: the untied copy is the looped model unrolled, bit for bit; the visits' gradients sum to the
looped block's and give visit_diagnostics' kappa_R; on blocks that pass their input through, one step's first-order
change is known in closed form (SGD: looped R^2, untied R; AdamW: both R); the linearization is exact at a tiny
rate; the training mode takes train.py's steps on train.py's schedule; the script's outputs and its one-line errors."""

import ast
import json
import math
import os

import pytest
import torch

from lab.model_update import get_lr, make_config, outputs, step_change, untied_copy, visit_kappa
from lab.probes import visit_diagnostics
from model import GPT
from scripts import ROOT, run_script

SECOND_PROCESS = True  # seconds of the probes' steps, run beside the rest of the session (conftest.py)

SMALL = dict(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)


def model(scheme, R, backbone="gpt2", seed=0):
    torch.manual_seed(seed)
    return GPT(make_config(scheme, R, backbone=backbone, **SMALL)).double()


def batch(seed=0, rows=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (rows, 8), generator=g), torch.randint(0, 64, (rows, 8), generator=g)


@pytest.mark.parametrize("scheme,backbone", [("postln", "gpt2"), ("deeploop:0.25", "gpt2"), ("preln", "gpt2"),
                                             ("deeploop", "paper")])
def test_the_untied_copy_computes_the_looped_function_and_at_R_1_takes_the_same_step(scheme, backbone):
    x, y = batch()
    tied = model(scheme, 3, backbone)
    untied = untied_copy(tied)
    assert untied.config.n_layer == 6 and untied.config.n_loop == 1 and (untied.alpha, untied.beta) == \
        (tied.alpha, tied.beta)
    for a, b in zip(outputs(tied, x), outputs(untied, x)):
        assert torch.equal(a, b)
    one = model(scheme, 1, backbone)
    for optimizer, lr in (("sgd", 0.1), ("adamw", 3e-3)):
        assert step_change(one, x, y, optimizer, lr, "all") == step_change(untied_copy(one), x, y, optimizer, lr, "all")


def test_the_looped_gradient_sums_the_visits_and_their_kappa_is_visit_diagnostics():
    x, y = batch()
    tied = model("deeploop", 3)
    untied = untied_copy(tied)
    loss = tied(x, y)[1]
    loss.backward()
    untied(x, y)[1].backward()
    for b, block in enumerate(tied.transformer.h):
        for name, p in block.named_parameters():
            visits = sum(dict(untied.transformer.h[r * 2 + b].named_parameters())[name].grad for r in range(3))
            torch.testing.assert_close(p.grad, visits, rtol=1e-10, atol=1e-14)
    kappa, pooled = visit_kappa(untied, 2, x, y)
    assert kappa == pytest.approx(visit_diagnostics(tied, x, y)["kappa"], rel=1e-9)
    assert 1 < min(kappa) and max(kappa) < 3
    # pooled kappa_R is what a looped SGD step gains to first order over the untied one, on the blocks' loss
    looped, unlooped = (step_change(m, x, y, "sgd", 1e-3, "blocks") for m in (tied, untied))
    assert looped["loss_lin"] / unlooped["loss_lin"] == pytest.approx(pooled, rel=1e-9)


def pass_through(R):
    """Pre-LN blocks whose attention and MLP outputs are zero: every visit passes its input on, so every visit sees
    the same input and sends back the same gradient (kappa_R = R), and only the output projections get one."""
    m = model("preln", R)
    with torch.no_grad():
        for block in m.transformer.h:
            block.attn.c_proj.weight.zero_()
            block.mlp.c_proj.weight.zero_()
    return m


@pytest.mark.parametrize("R", [2, 3])
def test_aligned_visits_one_step_in_closed_form(R):
    x, y = batch()
    tied, once = pass_through(R), pass_through(1)
    untied = untied_copy(tied)
    kappa, pooled = visit_kappa(untied, 2, x, y)
    assert kappa == pytest.approx([R, R], rel=1e-12) and pooled == pytest.approx(R, rel=1e-12)
    # SGD: the looped block's step is R times a visit's, and R visits read it: R^2 times the unlooped change; each
    # untied block takes a visit's step: R times
    base = step_change(once, x, y, "sgd", 0.1, "blocks")["logits_lin"]
    assert step_change(tied, x, y, "sgd", 0.1, "blocks")["logits_lin"] == pytest.approx(R * R * base, rel=1e-9)
    assert step_change(untied, x, y, "sgd", 0.1, "blocks")["logits_lin"] == pytest.approx(R * base, rel=1e-9)
    # AdamW's first step is lr * g / |g| per parameter whatever the gradient's scale: the looped block moves as far as
    # each untied one, and the two changes agree (R times the unlooped one); up to AdamW's eps
    base = step_change(once, x, y, "adamw", 1e-3, "blocks")["logits_lin"]
    for m in (tied, untied):
        assert step_change(m, x, y, "adamw", 1e-3, "blocks")["logits_lin"] == pytest.approx(R * base, rel=1e-5)


def test_the_linearization_holds_at_a_tiny_rate_and_not_at_a_large_one():
    x, y = batch()
    tied = model("deeploop", 4)
    for optimizer, lr in (("sgd", 1e-6), ("adamw", 1e-8)):
        change = step_change(tied, x, y, optimizer, lr, "all")
        assert change["logits"] > 0 and change["logits_miss"] < 1e-4 * change["logits"]
        assert change["stream_miss"] < 1e-4 * change["stream"]
        assert change["loss_after"] - change["loss"] == pytest.approx(change["loss_lin"], rel=1e-3)
    large = step_change(tied, x, y, "adamw", 0.3, "all")
    assert large["logits_miss"] > 0.3 * large["logits"]
    assert step_change(tied, x, y, "sgd", 1e-6, "all") == step_change(tied, x, y, "sgd", 1e-6, "all")  # left as it was


def test_train_mode_takes_train_py_steps(tmp_path):
    common = ["--max_iters=3", "--seed=0"]
    r = run_script("-m lab.train", os.path.join(ROOT, "config", "depth_cpu.py"), "--out_dir=run", "--residual=postln",
                   "--n_loop=2", "--log_interval=1", "--eval_interval=10", "--eval_iters=1", *common, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        logged = [record["loss"] for record in map(json.loads, f) if record["type"] == "train"]
    r = run_script("lab/model_update.py", "--mode=train", "--schemes=postln", "--loops=2", "--warmups=100",
                   "--seeds=0", "--max_iters=3", "--kappa_interval=2", "--json_out=train.json", "--png=train.png",
                   cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    run, = json.loads((tmp_path / "train.json").read_text())["records"]
    assert [x["loss"] for x in run["records"]] == logged
    assert [x["iter"] for x in run["records"] if "kappa" in x] == [0, 2]
    assert all(x["logits"] > 0 for x in run["records"])
    assert r.stdout.startswith("| scheme | R | warmup | model | steps 0-2 |")
    assert "| postln | 2 | 100 | tied |" in r.stdout
    assert (tmp_path / "train.png").stat().st_size > 10000


def test_its_schedule_is_train_py_get_lr_through_warmup_decay_and_after():
    # train.py's get_lr reads its module's settings: run its own source with those set
    with open(os.path.join(ROOT, "train.py")) as f:
        train_py = f.read()
    source, = [ast.get_source_segment(train_py, node) for node in ast.parse(train_py).body
               if isinstance(node, ast.FunctionDef) and node.name == "get_lr"]
    schedule = dict(learning_rate=3e-3, warmup_iters=10, lr_decay_iters=100, min_lr=3e-4)
    namespace = dict(math=math, **schedule)
    exec(source, namespace)
    its = [0, 5, 9, 10, 11, 50, 99, 100, 150]
    assert [get_lr(it, **schedule) for it in its] == [namespace["get_lr"](it) for it in its]
    assert get_lr(150, **schedule) == 3e-4 and get_lr(10, **schedule) == 3e-3


def test_step_mode_tables_outputs_and_no_overwrite(tmp_path):
    args = ["--dataset=chains", "--schemes=postln,preln", "--loops=1,2", "--seeds=0", "--optimizers=sgd",
            "--moving=matrices", "--n_embd=16", "--batch_size=4", "--json_out=steps.json", "--png=steps.png"]
    r = run_script("lab/model_update.py", *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    records = json.loads((tmp_path / "steps.json").read_text())["records"]
    assert len(records) == 4 and {r["R"] for r in records} == {1, 2}
    at_1 = [r for r in records if r["R"] == 1]
    assert all(r["looped"] == r["untied"] and r["kappa"] == [1.0, 1.0] for r in at_1)
    assert "**sgd lr 0.1, the blocks' matrices moving**" in r.stdout and "| postln | kappa_R | 1.00 |" in r.stdout
    written = (tmp_path / "steps.json").read_text()
    r = run_script("lab/model_update.py", *args, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == "error: steps.json exists; delete it or choose another path\n"
    assert (tmp_path / "steps.json").read_text() == written


@pytest.mark.parametrize("setting,message", [
    ("--mode=walk", "unknown mode 'walk'; choose one of step, train"),
    ("--dataset=web", "unknown dataset 'web'; choose one of builtin_bytes, chains"),
    ("--schemes=preln_scaled", "unknown scheme 'preln_scaled': use postln, preln, deeploop, deepnorm or deeploop:p"),
    ("--schemes=deeploop:x", "scheme 'deeploop:x': the exponent after ':' must be a number"),
    ("--schemes=deeploop:-1", "residual_exponent must be >= 0"),
    ("--seeds=", "seeds must be ints, comma-separated, got ''"),
    ("--loops=0", "loops must be >= 1"),
    ("--loops=two", "loops must be ints, comma-separated, got 'two'"),
    ("--optimizers=lion", "optimizers must be one or more of sgd, adamw, comma-separated, got 'lion'"),
    ("--moving=heads", "moving must be one or more of matrices, blocks, all"),
    ("--sgd_lrs=-1", "learning rates must be > 0"),
    ("--backbone=llama", "unknown backbone 'llama'; choose one of gpt2, paper"),
    ("--control=twin", "control must be copy or fresh"),
    ("--dtype=float16", "dtype must be float64 or float32"),
    ("--models=both", "models must be one or more of tied, untied"),
    ("--n_embd=0", "n_layer, n_head, n_embd, block_size, batch_size and max_iters must be >= 1"),
    ("--n_embd=30", "n_embd=30 is not divisible by n_head=4"),
])
def test_bad_settings_are_one_line_errors(tmp_path, setting, message):
    r = run_script("lab/model_update.py", setting, cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, (setting, r.stderr)
    assert r.stderr.startswith(f"error: {message}"), r.stderr
