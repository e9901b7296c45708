"""tasks.py: the pointer chains against a plain re-computation, determinism, disjoint splits, answers uniform over the
values, the loss mask, accuracy by k, the shortcuts, and the precision a checkpoint is evaluated in."""

import hashlib

import numpy as np
import pytest
import torch

from model import GPT, GPTConfig
from lab.tasks import (PointerChains, accuracy_by_k, best_shortcut, curriculum_hops, describe_accuracy, evaluate, hits_by_k,
                       make_task, require_text, run_precision, shortcuts)

V, K, T = 8, 6, 24


def task(split="train", seed=0):
    return PointerChains(n_values=V, max_hops=K, block_size=T, seed=seed, split=split)


def follow(cells, cell):
    """(value, hops) of a cell, by following its pointers one by one."""
    hops = 0
    while cells[cell] >= V:
        cell, hops = cells[cell] - V, hops + 1
    return cells[cell], hops


def test_every_answer_and_every_k_is_what_following_the_pointers_gives():
    t = task()
    x, y = t.batch(3, 16)
    k = t.hops(x)
    seen_k = set()
    for row in range(16):
        cells = x[row].tolist()
        for cell in range(T):
            if cells[cell] >= V:
                assert cells[cell] - V < cell  # pointers only look back
            value, hops = follow(cells, cell)
            assert k[row, cell] == hops
            assert y[row, cell] == (value if hops else -1)
            seen_k.add(hops)
    assert seen_k == set(range(K + 1))  # every k from 0 (a value) to the longest chain occurs


def test_relative_pointers_name_the_same_cells_as_distances_back():
    """The same chains as absolute pointers, each pointer token V + (cell - the cell it names) instead of V + that
    cell; answers, hops, shortcuts and descriptions unchanged."""
    absolute = task()
    relative = PointerChains(n_values=V, max_hops=K, block_size=T, seed=0, split="train", pointers="relative")
    (xa, ya), (xr, yr) = absolute.batch(3, 16), relative.batch(3, 16)
    pointer = xa >= V
    assert torch.equal(pointer, xr >= V) and torch.equal(xa[~pointer], xr[~pointer]) and torch.equal(ya, yr)
    cell = torch.arange(T).expand(16, T)
    assert torch.equal((cell - (xr - V))[pointer], (xa - V)[pointer])
    assert (xr[pointer] - V).min() >= 1 and (xr - V).max() < T  # within the vocabulary of n_values + block_size
    assert torch.equal(relative.hops(xr), absolute.hops(xa))
    assert shortcuts(relative, xr, yr) == shortcuts(absolute, xa, ya)
    assert relative.describe(xr[0], T - 1) == absolute.describe(xa[0], T - 1)
    assert relative.name == f"chains(values={V}, hops={K}, cells={T}, pointers=relative)"
    config = dict(dataset="chains", chain_values=V, chain_hops=K, block_size=T)
    assert make_task(config, "train", 0).name == absolute.name  # a checkpoint older than the setting: absolute
    assert torch.equal(make_task(dict(config, chain_pointers="relative"), "train", 0).batch(3, 16)[0], xr)


def test_a_curriculum_grows_the_chains_from_one_pointer_to_all_of_them():
    assert [curriculum_hops(step, 500, 6) for step in (0, 99, 100, 250, 499, 500, 10 ** 6)] == [1, 1, 2, 3, 5, 6, 6]
    assert curriculum_hops(0, 0, 6) == 6 and curriculum_hops(7, 100, 1) == 1
    t = task()
    for max_hops in (1, 3):
        x, y = t.batch(2, 32, max_hops=max_hops)
        assert t.hops(x).max() == max_hops
        assert torch.equal(y >= 0, x >= V)  # every pointer still answered
    assert torch.equal(t.batch(2, 8, max_hops=K)[0], t.batch(2, 8)[0])
    assert torch.equal(t.batch(2, 8, max_hops=99)[0], t.batch(2, 8)[0])  # never beyond the task's own


def test_batches_are_a_function_of_seed_split_and_index_and_the_splits_are_disjoint():
    x, y = task().batch(5, 8)
    assert torch.equal(x, task().batch(5, 8)[0]) and torch.equal(y, task().batch(5, 8)[1])
    assert not torch.equal(x, task().batch(6, 8)[0])
    assert not torch.equal(x, task(seed=1).batch(5, 8)[0])
    train = {tuple(row) for i in range(20) for row in task("train").batch(i, 32)[0].tolist()}
    val = {tuple(row) for i in range(20) for row in task("val").batch(i, 32)[0].tolist()}
    assert len(train) == len(val) == 640 and not train & val


def test_answers_are_uniform_over_the_values_also_with_more_chains_than_values():
    """At 64 cells a row holds about 15 chains of 8 values (permutation(n_chains) % 8 made 0 the answer 14.2% of the
    time and 7 8.6%, and this statistic about 390). The answers of one chain share its value, so the test is
    Pearson's over the chains: sum over values of (answers - expected)^2 / (sum over chains of their answers^2 / 8),
    about chi-square with 7 degrees of freedom for independent uniform values; 24.3 is its 0.1% tail. Values drawn
    without replacement within a row only make the counts more even."""
    t = PointerChains(n_values=V, max_hops=K, block_size=64, seed=0, split="train")
    counts, squares = np.zeros(V), 0.0
    for index in range(20):
        x, y = (a.numpy() for a in t.batch(index, 64))
        rows, root = np.arange(len(x)), np.zeros_like(x)  # the value cell each cell's chain starts at
        for cell in range(x.shape[1]):
            root[:, cell] = np.where(x[:, cell] >= V, root[rows, np.maximum(x[:, cell] - V, 0)], cell)
        answered = y >= 0
        counts += np.bincount(y[answered], minlength=V)
        squares += (np.bincount((rows[:, None] * 64 + root)[answered]).astype(float) ** 2).sum()
    assert ((counts - counts.sum() / V) ** 2).sum() / (squares / V) < 24.3
    assert counts.max() / counts.sum() < 1 / V + 0.01  # a constant guess does about as well as chance


@pytest.mark.parametrize("block_size", [16, 64])
def test_the_chains_of_a_row_take_distinct_values_while_there_are_enough(block_size):
    t = PointerChains(n_values=V, max_hops=K, block_size=block_size, seed=0, split="val")
    x, _ = t.batch(0, 64)
    for cells in x.tolist():
        values = [c for c in cells if c < V]  # one value cell per chain
        counts = np.bincount(values, minlength=V)
        assert counts.max() - (counts.min() if len(values) >= V else 0) <= 1, values


def test_config_depth_cpu_s_chains_are_the_ones_its_documented_runs_saw():
    """At 16 cells a row never holds more than 8 chains (of 2 cells at least), so the fix for more chains than
    values leaves config/depth_cpu.py's task as it was: the digest of its batches from before that fix."""
    digest = hashlib.sha256()
    for split in ("train", "val"):
        for index in range(4):
            x, y = PointerChains(n_values=8, max_hops=6, block_size=16, seed=1337, split=split).batch(index, 64)
            digest.update(x.numpy().tobytes())
            digest.update(y.numpy().tobytes())
    assert digest.hexdigest()[:16] == "393281fa818bfbae"


def test_the_loss_depends_on_the_answer_positions_only():
    x, y = task().batch(0, 4)
    model = GPT(GPTConfig(block_size=T, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    logits = torch.randn(4, T, 64)
    loss = model.loss(logits, y)
    changed = logits.clone()
    changed[y < 0] += torch.randn_like(changed[y < 0])  # every position without an answer
    assert model.loss(changed, y) == pytest.approx(loss.item(), abs=1e-6)
    changed[y >= 0] += 1.0 * torch.randn_like(changed[y >= 0])
    assert model.loss(changed, y) != pytest.approx(loss.item(), abs=1e-3)


def test_accuracy_is_one_for_an_oracle_and_chance_for_a_constant_guess():
    t = task("val")
    hits = counts = const = 0
    for i in range(10):
        x, y = t.batch(i, 32)
        h, c = hits_by_k(t, y, x, y)
        hits, counts = hits + h, counts + c
        const = const + hits_by_k(t, torch.full_like(y, 3), x, y)[0]
    assert accuracy_by_k(hits, counts) == {str(k): 1.0 for k in range(1, K + 1)}
    assert counts[0] == 0 and counts[1:].min() > 100  # value cells are not answers
    assert const[1:].sum() / counts[1:].sum() == pytest.approx(1 / V, abs=0.02)


def test_shortcuts_on_a_hand_made_sequence():
    # cells: 3, 5, ->1, ->2, 6, ->0, ->5: answers 5 (k=1), 5 (k=2), 3 (k=1), 3 (k=2)
    x = torch.tensor([[3, 5, V + 1, V + 2, 6, V + 0, V + 5]])
    y = torch.tensor([[-1, -1, 5, 5, -1, 3, 3]])
    t = PointerChains(n_values=V, max_hops=2, block_size=7, seed=0, split="val")
    table = shortcuts(t, x, y)
    assert table["chance"] == {"1": 1 / V, "2": 1 / V}
    assert table["latest value"] == {"1": 0.5, "2": 0.5}  # the nearest value before: 5, 5, 6, 6
    assert table["most seen"] == {"1": (1 / 2 + 1 / 3) / 2, "2": (1 / 2 + 1 / 3) / 2}  # ties among 2, then 3 values
    assert best_shortcut(table) == {"1": 0.5, "2": 0.5}


def test_evaluate_runs_a_model_at_any_loop_count():
    model = GPT(GPTConfig(block_size=T, vocab_size=64, n_layer=1, n_loop=2, n_head=2, n_embd=16))
    t = make_task(dict(dataset="chains", chain_values=V, chain_hops=K, block_size=T), "val", 0)
    for n_loop in (1, 3):
        accuracy = evaluate(model, t, 2, 8, n_loop)
        assert sorted(accuracy, key=int) == [str(k) for k in range(1, K + 1)]
        assert all(0 <= a <= 1 for a in accuracy.values())
    assert model.config.n_loop == 2



def test_a_checkpoint_is_evaluated_in_the_precision_its_run_trained_in():
    model = GPT(GPTConfig(block_size=T, vocab_size=64, n_layer=1, n_loop=2, n_head=2, n_embd=16))
    t = make_task(dict(dataset="chains", chain_values=V, chain_hops=K, block_size=T), "val", 0)
    dtype, autocast = run_precision(dict(config=dict(dtype="bfloat16")), "cpu")
    x, y = t.batch(0, 8)
    with autocast:
        logits = model(x)[0]
    assert dtype == "bfloat16" and logits.dtype == torch.bfloat16
    assert evaluate(model, t, 1, 8, autocast=autocast) == accuracy_by_k(*hits_by_k(t, logits.argmax(-1), x, y))
    dtype, autocast = run_precision(dict(config={}), "cpu")  # from before the dtype setting: float32
    with autocast:
        assert dtype == "float32" and model(t.batch(0, 2)[0])[0].dtype == torch.float32


def test_scripts_for_text_point_a_tasks_checkpoint_to_depth_eval():
    require_text(dict(config=dict(dataset="builtin_bytes")), "out")
    with pytest.raises(ValueError, match="^out-depth was trained on the chains task, not on text: show its answers "
                                         "with python -m lab.depth_eval --out_dir=out-depth$"):
        require_text(dict(config=dict(dataset="chains")), "out-depth")


@pytest.mark.parametrize("kwargs,message", [
    (dict(n_values=1), "chain_values must be >= 2"),
    (dict(max_hops=0), "chain_hops must be >= 1"),
    (dict(block_size=5),
     "block_size=5 cannot hold a chain of chain_hops=6 pointers and its value: use block_size >= 7"),
    (dict(split="test"), "unknown split 'test': use train or val"),
    (dict(pointers="near"), "unknown chain_pointers 'near': use absolute \\(cell p\\) or relative \\(d cells back\\)"),
])
def test_bad_settings_raise_naming_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PointerChains(**dict(dict(n_values=V, max_hops=K, block_size=T, seed=0, split="train"), **kwargs))


def test_describe_accuracy_gives_the_accuracy_by_k_then_the_hardest_k_at_each_loop_count():
    accuracy = {2: {"1": 1.0, "2": 0.5, "10": 0.25}, 1: {"1": 0.875, "2": 0.125, "10": 0.0}}
    assert describe_accuracy(accuracy, 2) == ("  val accuracy by k = 1..3: 1.00 0.50 0.25\n"
                                              "  val accuracy at k = 10 at 2/1 loops: 0.25/0.00")
    assert describe_accuracy({1: accuracy[1]}, 1) == "  val accuracy by k = 1..3: 0.88 0.12 0.00"
