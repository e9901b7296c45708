"""
Loop counts drawn per training step, and backprop through the last loops only: how the recurrent-depth models train
for test-time depth. A model trained at one loop count gets worse at every other; one trained on counts drawn at
random runs more loops at test time (Geiping et al. 2025, "Scaling up Test-Time Compute with Latent Reasoning: A
Recurrent Depth Approach", the Huginn model). train.py takes both as settings:

    python -m lab.train config/smoke_sampled.py     # loop_sampling=lognormal_poisson, loop_mean=2
    python -m lab.train config/huginn_cpu.py --backprop_loops=1

A library module: bad settings raise ValueError naming the fix.
"""

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from model import MAX_LOOPS

LOOP_SAMPLINGS = ("fixed", "uniform", "lognormal_poisson")
LOOP_STREAM = 0x6C6F6F70  # "loop": the second word of TrainLoops.draw's seed; batches put their split's index there


@dataclass
class TrainLoops:
    """The loop count of each training step. The field names are train.py's settings.
        fixed              every step runs the model's n_loop
        uniform            loop_min..loop_max, each equally likely
        lognormal_poisson  Huginn's shape: r = 1 + Poisson(lambda), lambda log-normal with sigma 1/2 and mean
                           loop_mean - 1, so that r has mean loop_mean (Huginn's own draw has mean loop_mean + 1) and a
                           long right tail, cut at MAX_LOOPS (a draw above it runs MAX_LOOPS); Huginn trains at
                           mean 32 (with backprop through the last 8)
    backprop_loops > 0 keeps gradients through the last backprop_loops loops of a step only (TruncatedBackprop)."""
    loop_sampling: str = "fixed"
    loop_min: int = 0
    loop_max: int = 0
    loop_mean: float = 0.0
    backprop_loops: int = 0

    def __post_init__(self):
        if self.loop_sampling not in LOOP_SAMPLINGS:
            raise ValueError(f"unknown loop_sampling {self.loop_sampling!r}; choose one of {', '.join(LOOP_SAMPLINGS)}")
        uniform, lognormal = self.loop_sampling == "uniform", self.loop_sampling == "lognormal_poisson"
        if uniform and not 1 <= self.loop_min <= self.loop_max <= MAX_LOOPS:
            raise ValueError(f"loop_sampling=uniform needs 1 <= loop_min <= loop_max <= {MAX_LOOPS} (model.MAX_LOOPS), "
                             f"got loop_min={self.loop_min} loop_max={self.loop_max}")
        if lognormal and not 1 <= self.loop_mean <= MAX_LOOPS:
            raise ValueError(f"loop_sampling=lognormal_poisson needs 1 <= loop_mean <= {MAX_LOOPS} (model.MAX_LOOPS), "
                             f"got {self.loop_mean}")
        if not uniform and (self.loop_min or self.loop_max):
            raise ValueError(f"loop_min and loop_max only apply to loop_sampling=uniform, not {self.loop_sampling}")
        if not lognormal and self.loop_mean:
            raise ValueError(f"loop_mean only applies to loop_sampling=lognormal_poisson, not {self.loop_sampling}")
        if self.backprop_loops < 0:
            raise ValueError(f"backprop_loops must be >= 0 (0 = through every loop), got {self.backprop_loops}")

    @property
    def mean(self):
        """The mean loop count of a step; None for fixed (the model's n_loop)."""
        return {"fixed": None, "uniform": (self.loop_min + self.loop_max) / 2, "lognormal_poisson": self.loop_mean}[
            self.loop_sampling]

    def bounds(self, n_loop):
        """(fewest, most) loops a step may run, n_loop being the model's (what fixed runs): DDP must know whether a
        step can leave a loop input unused (one loop), and a loop input that no step can use is worth a warning."""
        if self.loop_sampling == "uniform":
            return self.loop_min, self.loop_max
        if self.loop_sampling == "lognormal_poisson":  # 1 + Poisson, cut at MAX_LOOPS; mean 1 draws only 1
            return 1, 1 if self.loop_mean == 1 else MAX_LOOPS
        return n_loop, n_loop

    def eval_counts(self, eval_loops, n_loop):
        """The loop counts an evaluation reports val loss at (test-time depth): train.py's eval_loops ("1,2,4"; "": 1
        and 2 * n_loop where the count is sampled, none else), and always n_loop, whose loss is val_loss."""
        try:
            counts = [int(c) for c in eval_loops.split(",")] if eval_loops else \
                [1, 2 * n_loop] if self.loop_sampling != "fixed" else []
        except ValueError:
            counts = [0]
        if not all(1 <= c <= MAX_LOOPS for c in counts):
            raise ValueError(f"eval_loops must be loop counts from 1 to {MAX_LOOPS} separated by commas, like "
                             f"\"1,2,4\", got {eval_loops!r}")
        return sorted({n_loop, *counts})

    def draw(self, seed, step):
        """The loop count of optimizer step `step` (None for fixed): a pure function of (seed, step), not of a random
        stream that training consumes, so that every DDP process and every micro-batch of a step draws the same count
        and a resumed run continues the same sequence. The stream is its own (LOOP_STREAM), apart from every batch's
        [seed, split, index]."""
        if self.loop_sampling == "fixed":
            return None
        rng = np.random.default_rng([seed, LOOP_STREAM, step])
        if self.loop_sampling == "uniform":
            return int(rng.integers(self.loop_min, self.loop_max + 1))
        if self.loop_mean == 1:
            return 1
        sigma = 0.5
        rate = rng.lognormal(math.log(self.loop_mean - 1) - sigma ** 2 / 2, sigma)  # mean loop_mean - 1
        return min(1 + int(rng.poisson(rate)), MAX_LOOPS)


class TruncatedBackprop(nn.Module):
    """A GPT whose forward runs every loop but keeps gradients through the last backprop_loops only, as Huginn trains:
    the earlier loops run without autograd (less memory and compute), and no gradient reaches the blocks' earlier
    visits. With loop_input none nor does anything before the core (the embeddings, the prelude), which only the
    first loop reads; with add or concat every loop reads the embedded input, so they learn through the tracked
    loops. The coda always learns. A module, so that DDP can wrap it as it wraps the model."""

    def __init__(self, model, backprop_loops):
        super().__init__()
        if backprop_loops < 1:
            raise ValueError(f"backprop_loops must be >= 1 for truncated backprop, got {backprop_loops}")
        self.model, self.backprop_loops = model, backprop_loops

    def forward(self, idx, targets=None, n_loop=None):
        model, no_cache = self.model, itertools.repeat(None)
        loops = n_loop or model.config.n_loop
        e = model.embed(idx, 0, no_cache)
        x = None
        for r in range(loops):
            with torch.set_grad_enabled(torch.is_grad_enabled() and r >= loops - self.backprop_loops):
                x = model.loop(x, e, no_cache)
        logits = model.readout(x, no_cache)
        return logits, None if targets is None else model.loss(logits, targets)
