"""tasks.py: the pointer chains against a plain re-computation, determinism, disjoint splits, the loss mask, accuracy
by k and the shortcuts."""

import pytest
import torch

from model import GPT, GPTConfig
from tasks import PointerChains, accuracy_by_k, best_shortcut, evaluate, hits_by_k, make_task, shortcuts

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


def test_batches_are_a_function_of_seed_split_and_index_and_the_splits_are_disjoint():
    x, y = task().batch(5, 8)
    assert torch.equal(x, task().batch(5, 8)[0]) and torch.equal(y, task().batch(5, 8)[1])
    assert not torch.equal(x, task().batch(6, 8)[0])
    assert not torch.equal(x, task(seed=1).batch(5, 8)[0])
    train = {tuple(row) for i in range(20) for row in task("train").batch(i, 32)[0].tolist()}
    val = {tuple(row) for i in range(20) for row in task("val").batch(i, 32)[0].tolist()}
    assert len(train) == len(val) == 640 and not train & val


def test_the_loss_depends_on_the_answer_positions_only():
    x, y = task().batch(0, 4)
    model = GPT(GPTConfig(block_size=T, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    logits = torch.randn(4, T, 64)
    loss = model._loss(logits, y)
    changed = logits.clone()
    changed[y < 0] += torch.randn_like(changed[y < 0])  # every position without an answer
    assert model._loss(changed, y) == pytest.approx(loss.item(), abs=1e-6)
    changed[y >= 0] += 1.0 * torch.randn_like(changed[y >= 0])
    assert model._loss(changed, y) != pytest.approx(loss.item(), abs=1e-3)


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


@pytest.mark.parametrize("kwargs,message", [
    (dict(n_values=1), "chain_values must be >= 2"),
    (dict(max_hops=0), "chain_hops must be >= 1"),
    (dict(block_size=5),
     "block_size=5 cannot hold a chain of chain_hops=6 pointers and its value: use block_size >= 7"),
    (dict(split="test"), "unknown split 'test': use train or val"),
])
def test_bad_settings_raise_naming_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PointerChains(**dict(dict(n_values=V, max_hops=K, block_size=T, seed=0, split="train"), **kwargs))
