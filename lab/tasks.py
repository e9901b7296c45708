"""
A built-in task where depth is the bottleneck: pointer chains, made on the fly from a seed (no files, no download).

A sequence of block_size cells. A cell holds either a value (token v, 0 <= v < n_values) or a pointer to an earlier
cell (token n_values + p: "look at cell p"; relative pointers, below: n_values + d, "look d cells back"). The cells
form chains: a value, then cells each pointing at the previous cell of its chain, interleaved at random with the
other chains of the sequence. The answer at a pointer cell is the
value its chain starts with, and k = the number of pointers to follow to get there (its hops). Every pointer cell is
supervised, so one sequence measures every k from 1 to max_hops:

    x:  3  5  8+0  8+1  6  8+4  8+2 ...      (n_values = 8: tokens 0-7 are values, 8 + p points at cell p)
    y:  -  -   3    5   -   6    3  ...      (value cells have no answer: -1)
    k:  0  0   1    1   0   1    2  ...

Why depth: a layer can follow a pointer by attending to the cell it names and reading what that cell knows, so a
network of depth D resolves chains of about D hops following one pointer a layer, or up to 2^D when it learns to
jump along pointers that it has already followed (pointer doubling); either way, more loops reach larger k. Nothing
but following the pointers tells the answer: the chains of a sequence start from distinct values (while there are
enough; beyond n_values chains, each further n_values chains again take distinct values), so a model that does not
follow the chain of a cell can only guess among the values it has seen (the shortcuts below measure how well such
guesses do). Every answer is uniform over the values, so chance, 1 / n_values, is also what a constant guess scores.

Chains have 1 to max_hops pointers (uniform), so k = j has a share proportional to max_hops + 1 - j.

Relative pointers (pointers="relative"): token n_values + d means "look d cells back" instead of "look at cell p".
Rotary position encodings (RoPE) show attention only the distance between two cells, never a cell's index, so an
absolute pointer asks a RoPE model to work out where cell p is; a relative one names what RoPE can see.

    task = PointerChains(n_values=8, max_hops=16, block_size=64, seed=0, split="train")
    x, y = task.batch(index, batch_size)    # like dataset.TokenWindows.batch: a function of (seed, split, index)
    x, y = task.batch(index, batch_size, max_hops=2)   # chains of 1-2 pointers only (a curriculum, curriculum_hops)
    k = task.hops(x)                        # the hops of every cell, from x alone

A library module: bad settings raise ValueError naming the fix.
"""

from contextlib import nullcontext

import numpy as np
import torch

from runtime import precision
from lab.decode import exit_logits

SPLITS = ("train", "val")
POINTERS = ("absolute", "relative")


class PointerChains:

    def __init__(self, n_values, max_hops, block_size, seed, split, pointers="absolute"):
        if pointers not in POINTERS:
            raise ValueError(f"unknown chain_pointers {pointers!r}: use absolute (cell p) or relative (d cells back)")
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: use train or val")
        if n_values < 2:
            raise ValueError(f"chain_values must be >= 2 (a chain's value is one of them), got {n_values}")
        if max_hops < 1:
            raise ValueError(f"chain_hops must be >= 1 (pointers in the longest chain), got {max_hops}")
        if block_size < max_hops + 1:
            raise ValueError(f"block_size={block_size} cannot hold a chain of chain_hops={max_hops} pointers and its "
                             f"value: use block_size >= {max_hops + 1}")
        self.n_values, self.max_hops, self.block_size, self.seed, self.split = (n_values, max_hops, block_size, seed,
                                                                                split)
        self.relative = pointers == "relative"
        self.vocab_size = n_values + block_size
        # what a checkpoint names where a text run names its tokenizer (resuming with other pointers: another task)
        self.name = f"chains(values={n_values}, hops={max_hops}, cells={block_size}" + (
            ", pointers=relative)" if self.relative else ")")

    def batch(self, index, batch_size, max_hops=None):
        """(x, y), int64 tensors (batch_size, block_size): cells and answers (-1 at value cells); chains of at most
        max_hops pointers (None: the task's max_hops)."""
        max_hops = min(max_hops or self.max_hops, self.max_hops)
        # train and val are disjoint generator streams: the split is part of the seed
        rng = np.random.default_rng([self.seed, SPLITS.index(self.split), index])
        T, V = self.block_size, self.n_values
        x, y = np.empty((batch_size, T), dtype=np.int64), np.empty((batch_size, T), dtype=np.int64)
        for row in range(batch_size):
            # chains of 2 .. max_hops + 1 cells until the row is full (the last one cut short), shuffled together
            cells = rng.integers(2, max_hops + 2, size=T)
            n_chains = np.searchsorted(np.cumsum(cells), T) + 1
            chain = rng.permutation(np.repeat(np.arange(n_chains), cells[:n_chains])[:T])
            # distinct first values (while there are enough): a value seen twice would hint at the answer. More
            # chains than values take a fresh permutation for each V chains, so that every chain's value, and with
            # it every answer, is uniform over the values (permutation(n_chains) % V gave the low ones an extra copy)
            value = np.concatenate([rng.permutation(V) for _ in range(-(-n_chains // V))])[:n_chains]
            # cells in chain order: each one's predecessor in the chain is the cell before it in this order
            order = np.argsort(chain, kind="stable")
            first = np.r_[True, chain[order[1:]] != chain[order[:-1]]]
            parent = np.r_[0, order[:-1]]  # of each cell in chain order (at a first cell: unused)
            x[row, order] = np.where(first, value[chain[order]], V + (order - parent if self.relative else parent))
            y[row, order] = np.where(first, -1, value[chain[order]])
        return torch.from_numpy(x), torch.from_numpy(y)

    def describe(self, cells, cell):
        """The chain of a cell of one sequence (cells: (T,)) as text: 'cell 9 -> cell 4 -> cell 0 = 3'."""
        path = [cell]
        while cells[path[-1]] >= self.n_values:
            path.append(self.parent(cells[path[-1]].item(), path[-1]))
        return " -> ".join(f"cell {c}" for c in path) + f" = {cells[path[-1]].item()}"

    def parent(self, token, cell):
        """The cell that a pointer token at this cell names (int or tensor)."""
        return cell - (token - self.n_values) if self.relative else token - self.n_values

    def hops(self, x):
        """k of every cell of x (B, T): 0 at a value, 1 + the k of the cell it points at."""
        k = torch.zeros_like(x)
        pointer = x >= self.n_values
        for t in range(1, x.size(1)):  # a pointer names an earlier cell, whose k is known by then
            parent = self.parent(x[:, t], t).clamp(0, t - 1)
            k[:, t] = torch.where(pointer[:, t], k.gather(1, parent[:, None])[:, 0] + 1, 0)
        return k


def hits_by_k(task, prediction, x, y):
    """(hits, counts): float64 tensors (max_hops + 1,) of the right predictions and the answers at each k (index 0:
    value cells, never counted). prediction: (B, T) token ids."""
    k = task.hops(x).flatten()
    max_hops = task.max_hops
    answered = (y >= 0).flatten()
    right = (prediction == y).flatten() & answered
    counts = torch.bincount(k[answered], minlength=max_hops + 1)[:max_hops + 1].double()
    hits = torch.bincount(k[right], minlength=max_hops + 1)[:max_hops + 1].double()
    return hits, counts


def accuracy_by_k(hits, counts):
    """{"1": accuracy, ...} for every k >= 1 that has answers; the keys are strings, as JSON needs them."""
    return {str(k): hits[k].item() / counts[k].item() for k in range(1, len(counts)) if counts[k] > 0}


def shortcuts(task, x, y):
    """Expected accuracy by k of guesses that do not follow the chains, on the batch (x, y), as
    {name: {"1": accuracy, ...}}:
        chance        1 / n_values
        latest value  the value of the nearest value cell before the answer
        most seen     the value seen most often before the answer (ties shared out evenly)"""
    k = task.hops(x).numpy()
    x, y, n_values = x.numpy(), y.numpy(), task.n_values
    B, T = x.shape
    is_value = x < n_values
    positions = np.where(is_value, np.arange(T), 0)
    latest = np.take_along_axis(x, np.maximum.accumulate(positions, axis=1), axis=1)  # cell 0 is always a value
    seen = np.cumsum(np.where(is_value[..., None], np.eye(n_values, dtype=np.int64)[np.minimum(x, n_values - 1)], 0),
                     axis=1)
    best = seen == seen.max(axis=2, keepdims=True)
    most_seen = np.take_along_axis(best, np.maximum(y, 0)[..., None], axis=2)[..., 0] / best.sum(axis=2)
    result = {}
    for name, score in (("chance", np.full((B, T), 1 / n_values)), ("latest value", latest == y),
                        ("most seen", most_seen)):
        result[name] = {str(j): float(score[k == j].mean()) for j in range(1, task.max_hops + 1) if (k == j).any()}
    return result


def best_shortcut(table):
    """{"1": the best accuracy among the shortcuts at k = 1, ...} from shortcuts()'s table."""
    return {j: max(scores[j] for scores in table.values()) for j in table["chance"]}


def format_by_k(by_k):
    """A {"1": accuracy, ...} dict as one line of two-digit figures, k = 1 first."""
    return " ".join(f"{by_k[j]:.2f}" for j in sorted(by_k, key=int))


def describe_accuracy(accuracy, n_loop):
    """An evaluation's lines on a task, from its {loops: {"1": accuracy, ...}}: the accuracy by k at n_loop, and at the
    hardest k at every loop count evaluated when there are several."""
    by_k = accuracy[n_loop]
    lines = [f"  val accuracy by k = 1..{len(by_k)}: {format_by_k(by_k)}"]
    if len(accuracy) > 1:
        hardest = max(by_k, key=int)
        lines.append(f"  val accuracy at k = {hardest} at {'/'.join(map(str, accuracy))} loops: "
                     f"{'/'.join(f'{at_loops[hardest]:.2f}' for at_loops in accuracy.values())}")
    return "\n".join(lines)


TASKS = {"chains": PointerChains}


def require_text(checkpoint, out_dir):
    """For the scripts that need a model of text (sample.py, eval_downstream.py): raises ValueError, pointing to
    depth_eval.py, when the checkpoint in out_dir is of a run on a task."""
    if checkpoint["config"].get("dataset") in TASKS:
        raise ValueError(f"{out_dir} was trained on the {checkpoint['config']['dataset']} task, not on text: show its "
                         f"answers with python -m lab.depth_eval --out_dir={out_dir}")


def make_task(config, split, seed):
    """The task of a run from its settings (train.py's globals, or a checkpoint's "config"; one older than
    chain_pointers had absolute pointers)."""
    if config.get("chain_curriculum", 0) < 0:
        raise ValueError(f"chain_curriculum must be >= 0 (steps over which chains grow to chain_hops; 0: off), got "
                         f"{config['chain_curriculum']}")
    return TASKS[config["dataset"]](config["chain_values"], config["chain_hops"], config["block_size"], seed, split,
                                    config.get("chain_pointers", "absolute"))


def curriculum_hops(step, curriculum_iters, max_hops):
    """The longest chain a training batch has at this step under a curriculum over k: from 1 pointer at step 0 up,
    linearly, to max_hops at step curriculum_iters and after (0: max_hops from the start). Why: a model that has not
    learnt to follow one pointer gets little signal from chains of six; evaluations keep every k."""
    if curriculum_iters <= 0:
        return max_hops
    return min(max_hops, 1 + step * (max_hops - 1) // curriculum_iters)


def run_precision(checkpoint, device):
    """(dtype, autocast context) to evaluate a train.py checkpoint in as its run evaluated: train.py evaluates under
    the autocast it trains in (bfloat16 on any recent GPU), where an answer that two tokens nearly tie for can go the
    other way than in float32, so only the run's own dtype reproduces its logged accuracy; and on CUDA with TF32
    matmuls allowed, as train.py allows them (runtime.precision). The run's dtype on any device: a bfloat16 run from a
    GPU evaluates in bfloat16 on a CPU too, close to what it logged rather than equal (other kernels round
    differently), and slower where the CPU emulates bfloat16; the task models are small. Checkpoints older than the
    dtype setting trained in float32."""
    dtype, _, autocast = precision(device, checkpoint["config"].get("dtype", "float32"))
    return dtype, autocast


@torch.no_grad()
def evaluate(model, task, n_batches, batch_size, n_loop=None, autocast=nullcontext()):
    """Accuracy by k ({"1": accuracy, ...}) of a model.GPT on batches 0 .. n_batches - 1 of the task, run at n_loop
    loops (None: as trained) in the autocast context given (run_precision's, to reproduce a run); the answer is the
    most likely token."""
    model.eval()
    hits = counts = 0
    for index in range(n_batches):
        x, y = task.batch(index, batch_size)
        with autocast:
            logits, _ = model(x.to(model.lm_head.weight.device), n_loop=n_loop)
        batch_hits, batch_counts = hits_by_k(task, logits.argmax(-1).cpu(), x, y)
        hits, counts = hits + batch_hits, counts + batch_counts
    return accuracy_by_k(hits, counts)


@torch.no_grad()
def evaluate_exit(model, task, n_batches, batch_size, exit_threshold, n_loop=None, autocast=nullcontext()):
    """evaluate() with adaptive exit (lab.decode.exit_logits: all positions in parallel, at most n_loop loops) ->
    (accuracy by k, loops by k: {"1": a float tensor of the loops each answer at k took, ...})."""
    model.eval()
    hits = counts = 0
    loops_at = {str(j): [] for j in range(1, task.max_hops + 1)}
    for index in range(n_batches):
        x, y = task.batch(index, batch_size)
        with autocast:
            logits, _, loops = exit_logits(model, x.to(model.lm_head.weight.device), exit_threshold, n_loop)
        batch_hits, batch_counts = hits_by_k(task, logits.argmax(-1).cpu(), x, y)
        hits, counts = hits + batch_hits, counts + batch_counts
        k = task.hops(x)
        for j in loops_at:
            loops_at[j].append(loops.cpu()[(k == int(j)) & (y >= 0)].float())
    return accuracy_by_k(hits, counts), {j: torch.cat(v) for j, v in loops_at.items() if sum(map(len, v))}
