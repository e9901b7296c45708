"""
What a looped GPT costs: training FLOPs per token (runtime.flops_per_token, the yardstick of MFU in train.py and
bench), and the bytes a cached decode step must read and the FLOPs it must compute, with the memory bandwidth and the
matrix product rate that make them times (the floor of the benches' decode speed, and the bound its arithmetic sets).
Counted over the unrolled visits: a loop costs its blocks' compute again although it stores no new weights.
"""

import math
import time

import torch

from model import GPT
# training FLOPs and the matrix product rate are the lesson's, found here with the rest of what a step costs
from runtime import flops_per_token, matmul_rate, synchronize  # noqa: F401


def kv_cache_bytes(model: GPT, sequences, positions, element_size, n_loop=None, kv_cache="per_visit"):
    """Bytes of the keys and values of `positions` positions of each sequence in a cache of the kv_cache layout: an
    entry per unrolled visit (per_visit) or per physical block (last_loop, lab.decode)."""
    cfg = model.config
    entries = cfg.depth(n_loop or cfg.n_loop) if kv_cache == "per_visit" else cfg.depth(1)
    return 2 * entries * sequences * positions * cfg.n_embd * element_size


def decode_step_bytes(model: GPT, sequences, past, element_size, n_loop=None, weight_size=None):
    """Bytes a cached decode step must read from memory at the least (over the memory bandwidth: bench's floor):
    every weight of the blocks and of the output layer once, and in every unrolled visit the keys and values of the
    `past` positions of each sequence. The same in both cache layouts: last_loop stores one entry per block, but
    each of a block's visits attends over all of it. The embeddings' few rows and the activations are left out.
    element_size: bytes of a cached key or value; weight_size: of a weight as stored (None: element_size), which
    under autocast is more than the step computes in, and is read whole all the same."""
    t = model.transformer
    weights = sum(p.numel() for m in (t.prelude, t.h, t.coda, t.inject) if m is not None for p in m.parameters())
    weights += model.lm_head.weight.numel()
    return weights * (weight_size or element_size) + kv_cache_bytes(model, sequences, past, element_size, n_loop)


def decode_step_flops(model: GPT, sequences, past, n_loop=None):
    """FLOPs of a cached decode step: per sequence, the forward of one token, a third of runtime.flops_per_token's
    count for a step tracked through every loop (2 FLOPs per matrix weight forward, 4 backward), with each unrolled
    visit's attention over past + 1 positions (the cached ones and its own) in place of block_size."""
    cfg = model.config
    loops = n_loop or cfg.n_loop
    forward = flops_per_token(model, loops) // 3
    return sequences * (forward - 4 * cfg.n_embd * (cfg.block_size - past - 1) * cfg.depth(loops))


def read_bandwidth(device):
    """Bytes per second that this process reads from memory: the fastest of a few sums and vector-matrix products
    over 256 MiB of float32, 8x the largest L3 cache of the CPUs here, so that every repeat reads from memory."""
    data = torch.ones(2**26, device=device)
    vector = torch.ones(256, device=device)
    best = math.inf
    for _ in range(5):
        for read in (data.sum, lambda: vector @ data.view(256, -1)):
            synchronize(device)
            t0 = time.perf_counter()
            read()
            synchronize(device)
            best = min(best, time.perf_counter() - t0)
    return data.numel() * data.element_size() / best
