"""flops.py: training FLOPs over the unrolled visits against counts by hand, and the bytes a cached decode step reads,
against what the visits' attention is handed in both cache layouts."""

import pytest
import torch
from torch.nn import functional as F

from lab.decode import KV_CACHES, new_caches
from lab.flops import decode_step_bytes, decode_step_flops, flops_per_token, kv_cache_bytes
from model import CHOICES, GPT, RESIDUALS
from models import HUGINN, HUGINN_BACKBONES, tiny


def test_flops_count_the_unrolled_depth():
    looped = GPT(tiny(n_layer=2, n_loop=4))
    untied = GPT(tiny(n_layer=8, n_loop=1))
    assert looped.num_params() < untied.num_params()
    # same unrolled depth, same matmuls per token
    assert flops_per_token(looped) == flops_per_token(untied)


def test_flops_count_the_loops_a_step_ran_and_backward_over_the_tracked_loops_only():
    """A model built for 1 loop that runs 4 does the work of one built for 4; with backprop_loops, forward (a third
    of the cost: 2 FLOPs per matrix weight and token of 6) runs every loop, backward (4 of 6) the tracked ones."""
    one, four = GPT(tiny(n_layer=2, n_loop=1)), GPT(tiny(n_layer=2, n_loop=4))
    assert flops_per_token(one, 4) == flops_per_token(four) == flops_per_token(four, 4)
    per_loop = flops_per_token(one, 2) - flops_per_token(one, 1)  # the blocks' 6 x matrix weights + attention
    block_matrices = sum(p.numel() for p in one.transformer.h.parameters() if p.dim() >= 2)
    assert per_loop == 6 * block_matrices + 12 * 2 * 32 * 32  # 2 blocks, width 32, 32 positions
    head = flops_per_token(one, 1) - per_loop  # the output layer, forward and backward, in every step
    for loops, tracked in ((4, 1), (4, 3), (7, 2)):
        assert flops_per_token(one, loops, tracked) == head + per_loop * (loops + 2 * tracked) // 3
    assert flops_per_token(one, 4, 4) == flops_per_token(one, 4, 9) == flops_per_token(one, 4)  # every loop tracked


def test_decode_floor_counts_each_weight_once_and_the_cache_of_every_visit():
    model = GPT(tiny(n_layer=2, n_loop=3))  # width 32, vocabulary 128, with biases
    # two LayerNorms, the q/k/v matrix, the attention output, the MLP's two matrices
    block = 2 * 2 * 32 + (32 * 96 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32)
    head = 128 * 32  # the output layer, tied to the token embedding
    cache = 2 * 6 * 3 * 10 * 32  # keys and values, 6 visits, 3 sequences, 10 positions, width 32
    assert decode_step_bytes(model, 3, 10, 4) == 4 * (2 * block + head + cache) == 164096
    # bfloat16, and 10 visits instead of 6
    assert decode_step_bytes(model, 3, 10, 2, n_loop=5) == 2 * (2 * block + head + cache * 10 // 6)


# A tiny Huginn (width 32, two core blocks, a prelude and a coda block, vocabulary 128, block_size 32), counted by hand
# in PaLM's accounting over the matrix weights: 2 FLOPs per weight and token forward, 4 backward; attention's scores
# and weighted sum 4 * n_embd * block_size per visit forward, twice that backward.
W = 12 * 32 * 32  # a block's matrices: q, k, v 3 x 32^2, the attention output 32^2, the MLP 2 x 4 x 32^2
A = 2 * 32 * 32   # concat's adapter, [x, e] -> x
H = 128 * 32      # the output layer
S = 4 * 32 * 32   # a visit's attention, forward


@pytest.mark.parametrize("loop_input,loops,backprop_loops,forward,backward", [
    # every loop tracked: the prelude, 2 blocks a loop, the coda, and the adapter in each loop after the first
    ("concat", 3, 0, 2 * (8 * W + H + 2 * A) + 8 * S, 4 * (8 * W + H + 2 * A) + 2 * 8 * S),
    ("concat", 3, 5, 2 * (8 * W + H + 2 * A) + 8 * S, 4 * (8 * W + H + 2 * A) + 2 * 8 * S),
    # the last 2 of 4 loops tracked: both read the input through the adapter, and send the prelude its gradient
    ("concat", 4, 2, 2 * (10 * W + H + 3 * A) + 10 * S, 4 * (4 * W + W + H + 2 * A + W) + 2 * 6 * S),
    ("concat", 4, 1, 2 * (10 * W + H + 3 * A) + 10 * S, 4 * (2 * W + W + H + A + W) + 2 * 4 * S),
    ("add", 4, 2, 2 * (10 * W + H) + 10 * S, 4 * (4 * W + W + H + W) + 2 * 6 * S),
    # loop_input none: only the first loop, untracked, reads the prelude's output: no backward for the prelude
    ("none", 4, 2, 2 * (10 * W + H) + 10 * S, 4 * (4 * W + W + H) + 2 * 5 * S),
    ("none", 4, 0, 2 * (10 * W + H) + 10 * S, 4 * (10 * W + H) + 2 * 10 * S),
])
def test_flops_against_a_hand_count(loop_input, loops, backprop_loops, forward, backward):
    model = GPT(tiny(n_layer=2, n_loop=2, n_prelude=1, n_coda=1, loop_input=loop_input))
    assert flops_per_token(model, loops, backprop_loops) == forward + backward


@pytest.mark.parametrize("loop_input", CHOICES["loop_input"])
def test_decode_step_flops_are_the_forward_of_one_token_over_the_positions_it_reads(loop_input):
    """Per sequence: 2 per matrix weight the token passes (the adapter only where concat has one, at each loop after
    the first) and 4 * n_embd per position that each visit attends over (9 cached and its own)."""
    model = GPT(tiny(n_layer=2, n_loop=2, n_prelude=1, n_coda=1, loop_input=loop_input))
    adapter = A if loop_input == "concat" else 0
    assert decode_step_flops(model, 3, 9, n_loop=3) == 3 * (2 * (8 * W + H + 2 * adapter) + 8 * 4 * 32 * 10)
    assert decode_step_flops(model, 1, 9, n_loop=4) == 2 * (10 * W + H + 3 * adapter) + 10 * 4 * 32 * 10


@pytest.mark.parametrize("residual", RESIDUALS)
def test_rope_costs_the_flops_of_learned_positions(residual):
    """Position embeddings are lookups and rotations are elementwise: neither is a matrix product."""
    learned = GPT(tiny(residual=residual))
    rope = GPT(tiny(residual=residual, position_encoding="rope"))
    assert flops_per_token(rope) == flops_per_token(learned)


@pytest.mark.parametrize("loop_input", CHOICES["loop_input"])
@pytest.mark.parametrize("backbone", HUGINN_BACKBONES.values(), ids=list(HUGINN_BACKBONES))
def test_decode_floor_grows_by_the_cache_of_a_loop_with_a_prelude_coda_and_loop_input(loop_input, backbone):
    model = GPT(tiny(n_loop=2, block_size=16, loop_input=loop_input, **HUGINN, **backbone))
    assert decode_step_bytes(model, 1, 10, 4, n_loop=3) - decode_step_bytes(model, 1, 10, 4, n_loop=2) == \
        4 * 2 * 2 * 10 * 32  # the 2 visits of one more loop


@pytest.mark.parametrize("kv_cache", KV_CACHES)
def test_decode_floor_is_what_every_visit_attends_over_in_both_cache_layouts(kv_cache, monkeypatch):
    """A cached decode step reads, in every unrolled visit, the keys and values of all positions so far: per_visit
    from the visit's own entry, last_loop from the store that its block's visits share, whole at each visit. So
    last_loop stores less, but a step reads as much: decode_step_bytes counts what the attention of each visit is
    handed, in either layout."""
    torch.manual_seed(0)
    model = GPT(tiny(n_loop=3, **HUGINN)).eval()
    caches = new_caches(model, 3, kv_cache)
    read = []
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, **kwargs):
        read.append(k.nbytes + v.nbytes)
        return sdpa(q, k, v, **kwargs)

    with torch.no_grad():
        model(torch.randint(0, 128, (2, 9)), caches=caches)  # a prompt of 9 positions
        monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
        model(torch.randint(0, 128, (2, 1)), caches=caches)  # a decode step: the 10th attends over 10 positions
    assert len(read) == 1 + 2 * 3 + 2  # a visit each
    weights = decode_step_bytes(model, 2, 0, 4, n_loop=3)
    assert sum(read) == decode_step_bytes(model, 2, 10, 4, n_loop=3) - weights == kv_cache_bytes(model, 2, 10, 4, 3)
