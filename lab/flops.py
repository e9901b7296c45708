"""
What a looped GPT costs: training FLOPs per token (the yardstick of MFU in train.py and bench) and the bytes a cached
decode step must read, with the memory bandwidth that makes them a time (the floor of the benches' decode speed).
Counted over the unrolled visits: a loop costs its blocks' compute again although it stores no new weights.
"""

import math
import time

import torch

from model import GPT
from runtime import synchronize


def matrix_params(modules):
    """Weights of the matrix products in these modules, the only parameters that cost FLOPs per token (PaLM's
    accounting, appendix B; biases, norm gains and embedding lookups are left out)."""
    return sum(p.numel() for module in modules if module is not None for p in module.parameters() if p.dim() >= 2)


def flops_per_token(model: GPT, n_loop=None, backprop_loops=0):
    """Training FLOPs per token of a step that runs n_loop core loops (None: the model's), with gradients through the
    last backprop_loops of them (0: all; lab.loops.TruncatedBackprop). A matrix product costs 2 FLOPs per weight and
    token forward and 4 backward; attention's scores and weighted sum 4 * n_embd * block_size forward per visit and
    twice that backward. Forward: every visit, the prelude and coda once, the output layer once, concat's adapter at
    each loop after the first. Backward: the visits gradients reach only: the tracked loops, the coda and the output
    layer always, the adapter in the tracked loops after the first, and the prelude where a tracked loop reads its
    output (the first loop, or any loop that the input is fed into)."""
    cfg, t = model.config, model.transformer
    loops = n_loop or cfg.n_loop
    tracked = min(backprop_loops, loops) if backprop_loops else loops
    core, prelude, coda = (matrix_params(blocks) for blocks in (t.h, t.prelude, t.coda))
    adapter = matrix_params([t.inject.adapter]) if t.inject is not None and t.inject.adapter is not None else 0
    head = model.lm_head.weight.numel()
    attention = 4 * cfg.n_embd * cfg.block_size  # per visit, forward
    prelude_learns = tracked == loops or cfg.loop_input != "none"
    adapter_runs_tracked = tracked - (tracked == loops)  # the first loop reads the input without the adapter
    forward = 2 * (core * loops + prelude + coda + head + adapter * (loops - 1)) + attention * cfg.depth(loops)
    backward = 4 * (core * tracked + coda + head + adapter * adapter_runs_tracked + prelude * prelude_learns) + \
        2 * attention * (cfg.n_layer * tracked + cfg.n_coda + cfg.n_prelude * prelude_learns)
    return forward + backward


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
