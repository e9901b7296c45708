"""
A looped GPT with DeepLoop residual scaling, in one file.

A looped GPT stores `n_layer` physical blocks and runs the whole stack `n_loop` times, so the network is
`unrolled_depth = n_layer * n_loop` blocks deep while holding only `n_layer` blocks of parameters. Optionally, as in
the recurrent-depth models (Huginn's prelude / core / coda), `n_prelude` blocks run once before the looped core and
`n_coda` blocks once after it, and `loop_input` feeds the embedded input into every loop (`LoopInput`).

DeepLoop keeps DeepNorm's Post-LN block, x = LN(alpha * x + f(x)), and only changes the two numbers alpha (how much
the residual stream is up-weighted) and beta (how much the residual branches are down-scaled at init). All of the
method is `residual_coefficients` below; everything else in this file is a GPT-2 that can loop.
"""

import inspect
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.func import functional_call

RESIDUALS = ("deeploop", "deepnorm", "postln", "preln", "preln_scaled")
PRE_LN = ("preln", "preln_scaled")  # GPT-2's block, x = x + f(Norm(x)); the other schemes are Post-LN
OWN_EXPONENT = {"deeploop": 0.5, "deepnorm": 0.25}  # each Post-LN scheme's p when residual_exponent is 0
NORMS = ("layernorm", "rmsnorm")
POSITION_ENCODINGS = ("learned", "rope")
LOOP_SAMPLINGS = ("fixed", "uniform", "lognormal_poisson")
LOOP_INPUTS = ("none", "add", "concat")
KV_CACHES = ("per_visit", "last_loop")  # generate's cache layouts (GPT.new_kv_cache)
# The most loops a forward pass may run, in training, evaluation and generation. A training step never ends early
# (train.py lets a step finish on SIGTERM before it saves), so a step must end in bounded time; and a typo such as
# --loop_max=1000000000000 would otherwise grow the list of visits until the memory runs out. 1024 is 32 times
# Huginn's training mean of 32, and past every count that this project's configs and docs use.
MAX_LOOPS = 1024
LOOP_STREAM = 0x6C6F6F70  # "loop": the second word of TrainLoops.draw's seed; batches put their split's index there


def check_loops(n_loop):
    """Raise ValueError unless n_loop is a loop count from 1 to MAX_LOOPS."""
    if not 1 <= n_loop <= MAX_LOOPS:
        raise ValueError(f"n_loop must be a loop count from 1 to {MAX_LOOPS} (model.MAX_LOOPS), got {n_loop}")


def residual_coefficients(residual, unrolled_depth, exponent=0.0):
    """Return (alpha, beta) for a residual scheme at unrolled depth N = n_prelude + n_layer * n_loop + n_coda: the
    prelude and coda blocks count once each, as the untied layers they are; every loop of the core counts again.

        deeploop: alpha = (2N)^p,  beta = (8N)^(-p),  p = 1/2
        deepnorm: alpha = (2N)^p,  beta = (8N)^(-p),  p = 1/4
        postln, preln, preln_scaled: alpha = beta = 1 (preln_scaled scales its branches with branch_scale below)

    A nonzero `exponent` replaces p for the two Post-LN schemes (the paper's Appendix C sweeps p from 0.30 to 0.60);
    0 means the scheme's own p.

    Why DeepLoop raises DeepNorm's exponent from 1/4 to 1/2: DeepNorm bounds how far one optimizer step moves the
    output of an untied network, where each of the N residual branches gets and applies its own update. In a looped
    network a physical block is visited n_loop times; its single update sums the gradients of all visits and is
    then read back by every one of those visits. When the visits' gradients align, the output perturbation grows
    like the square of the visit count instead of linearly, and keeping it bounded needs alpha and 1/beta to grow
    like N^(1/2). With n_loop = 1 nothing is revisited and the rule is still a valid (more conservative) DeepNorm.
    """
    N = unrolled_depth
    if residual not in RESIDUALS:
        raise ValueError(f"unknown residual scheme {residual!r}; choose one of {', '.join(RESIDUALS)}")
    if exponent < 0:
        raise ValueError(f"residual_exponent must be >= 0 (0 = the scheme's own), got {exponent}")
    if residual in ("postln", *PRE_LN):
        if exponent:
            raise ValueError(f"residual_exponent={exponent} only applies to deeploop and deepnorm, not {residual}; "
                             f"leave it at 0 or use --residual=deeploop")
        return 1.0, 1.0
    p = exponent or OWN_EXPONENT[residual]
    return (2 * N) ** p, (8 * N) ** -p


def branch_scale(residual, n_layer, n_loop, lam=1.0):
    """Return epsilon, the number a Pre-LN block multiplies both branch outputs by in the forward pass:
    x = x + epsilon * f(Norm(x)).

        preln_scaled: epsilon = lam / (n_loop * sqrt(n_layer))
        every other scheme: epsilon = 1

    With a prelude and coda, n_layer counts every distinct block (n_prelude + n_layer + n_coda: independent blocks,
    under the square root) and n_loop the core's loops; all blocks share the one epsilon.

    preln_scaled is the rival rule of Wang, Li, Zhang, Huang, Yan and Li, "On the Residual Scaling of Looped
    Transformers: Stability and Transferability" (arXiv 2606.18524). They keep Pre-LN and argue from the same
    observation as DeepLoop, that a shared block's visits make correlated updates, that the loops need 1/n_loop and
    not 1/sqrt(n_loop), while the n_layer distinct blocks, being independent, need only 1/sqrt(n_layer); they claim
    that the best learning rate then depends on n_layer alone, not on n_loop. What this takes from the paper is its
    abstract (the only text of it the search found): the multiplier in the forward pass and its formula. Its init and
    its value of lambda were not in that text. Chosen here: lam = 1 by default, and GPT-2's init without its
    1/sqrt(2N) shrinking of the output projections (every matrix std 0.02): epsilon already carries the depth
    scaling, and shrinking the weights as well would count the depth twice.
    """
    if residual not in RESIDUALS:
        raise ValueError(f"unknown residual scheme {residual!r}; choose one of {', '.join(RESIDUALS)}")
    if not (0 < lam < math.inf):
        raise ValueError(f"residual_lambda must be a positive number (the paper's lambda, 1 by default), got {lam}")
    if residual != "preln_scaled":
        if lam != 1:
            raise ValueError(f"residual_lambda={lam} only applies to preln_scaled, not {residual}; leave it at 1 or "
                             f"use --residual=preln_scaled")
        return 1.0
    return lam / (n_loop * math.sqrt(n_layer))


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for faster matmuls
    n_layer: int = 12        # physical blocks
    n_loop: int = 1          # rounds over the stack of physical blocks
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    residual: str = "deeploop"
    residual_exponent: float = 0.0  # p of alpha = (2N)^p, beta = (8N)^-p; 0 = the scheme's own (1/2 or 1/4)
    residual_lambda: float = 1.0    # preln_scaled: lambda of epsilon = lambda / (n_loop * sqrt(n_layer))
    # The backbone; the defaults are GPT-2's blocks. The DeepLoop paper's backbone is rmsnorm + rope +
    # norm_branch_input=True, the Post-LN block x = RMSNorm(alpha * x + f(RMSNorm(x))). Pre-LN blocks already feed
    # their branches a normalized input, so norm_branch_input changes only Post-LN schemes.
    norm: str = "layernorm"               # layernorm | rmsnorm: every normalization in the model
    position_encoding: str = "learned"    # learned (GPT-2's position embedding) | rope (rotary, on q and k)
    norm_branch_input: bool = False       # Post-LN: normalize the input of each attention and MLP branch too
    # alpha, beta (and preln_scaled's epsilon) are numbers of the model, fixed at init: they come from the unrolled
    # depth n_prelude + n_layer * coefficient_loops + n_coda, whatever count of core loops a forward pass runs
    # (sampled loop counts, test-time depth)
    coefficient_loops: int = 0            # 0: n_loop
    # Huginn's prelude / core / coda: blocks run once before and once after the looped core of n_layer blocks
    n_prelude: int = 0
    n_coda: int = 0
    loop_input: str = "none"              # none | add | concat: the embedded input fed into every loop (LoopInput)

    def __post_init__(self):
        if self.residual not in RESIDUALS:
            raise ValueError(f"unknown residual scheme {self.residual!r}; choose one of {', '.join(RESIDUALS)}")
        if self.norm not in NORMS:
            raise ValueError(f"unknown norm {self.norm!r}; choose one of {', '.join(NORMS)}")
        if self.position_encoding not in POSITION_ENCODINGS:
            raise ValueError(f"unknown position_encoding {self.position_encoding!r}; choose one of "
                             f"{', '.join(POSITION_ENCODINGS)}")
        if self.n_loop < 1 or self.n_layer < 1:
            raise ValueError(f"n_layer and n_loop must be >= 1, got n_layer={self.n_layer} n_loop={self.n_loop}")
        check_loops(self.n_loop)
        if not 0 <= self.coefficient_loops <= MAX_LOOPS:
            raise ValueError(f"coefficient_loops must be from 0 (= n_loop) to {MAX_LOOPS} (model.MAX_LOOPS), got "
                             f"{self.coefficient_loops}")
        if self.n_prelude < 0 or self.n_coda < 0:
            raise ValueError(f"n_prelude and n_coda must be >= 0 (0 = none), got n_prelude={self.n_prelude} "
                             f"n_coda={self.n_coda}")
        if self.loop_input not in LOOP_INPUTS:
            raise ValueError(f"unknown loop_input {self.loop_input!r}; choose one of {', '.join(LOOP_INPUTS)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.position_encoding == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"rope rotates pairs of channels: the head size n_embd/n_head="
                             f"{self.n_embd // self.n_head} must be even")
        self.coefficients()  # raises on a bad exponent or lambda

    def depth(self, loops):
        """Blocks that a pass with `loops` loops of the core runs through: n_prelude + n_layer * loops + n_coda."""
        return self.n_prelude + self.n_layer * loops + self.n_coda

    @property
    def unrolled_depth(self):
        return self.depth(self.n_loop)

    @property
    def coefficient_depth(self):
        """The N that alpha, beta and Pre-LN's scaled init are built from."""
        return self.depth(self.coefficient_loops or self.n_loop)

    def coefficients(self):
        """(alpha, beta, epsilon) of the model: residual_coefficients at coefficient_depth, branch_scale over every
        distinct block and coefficient_loops (or n_loop) loops."""
        alpha, beta = residual_coefficients(self.residual, self.coefficient_depth, self.residual_exponent)
        blocks = self.n_prelude + self.n_layer + self.n_coda
        return alpha, beta, branch_scale(self.residual, blocks, self.coefficient_loops or self.n_loop,
                                         self.residual_lambda)


@dataclass
class TrainLoops:
    """The loop count of each training step, for test-time depth: a model trained at one loop count gets worse at any
    other, unless training draws the count at random (Geiping et al. 2025, "Scaling up Test-Time Compute with Latent
    Reasoning: A Recurrent Depth Approach", the Huginn model). The field names are train.py's settings.
        fixed              every step runs the model's n_loop
        uniform            loop_min..loop_max, each equally likely
        lognormal_poisson  Huginn's shape: r = 1 + Poisson(lambda), lambda log-normal with sigma 1/2 and mean
                           loop_mean - 1, so that r has mean loop_mean (Huginn's own draw has mean loop_mean + 1) and a
                           long right tail, cut at MAX_LOOPS (a draw above it runs MAX_LOOPS); Huginn trains at
                           mean 32 (with backprop through the last 8)
    backprop_loops > 0 keeps gradients through the last backprop_loops loops of a step only, as Huginn does; the
    earlier loops run without autograd (less memory and compute). GPT.forward does that part."""
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

    def draw(self, seed, step):
        """The loop count of optimizer step `step` (None for fixed): a pure function of (seed, step), not of a random
        stream that training consumes, so that every DDP process and every micro-batch of a step draws the same count
        and a resumed run continues the same sequence. The stream is its own (LOOP_STREAM): seeded with [seed, step]
        it was the stream of a batch, [seed, split, index] (numpy pads [seed, 0] to [seed, 0, 0]: train batch 0)."""
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


class KVCache:
    """The keys and values that one unrolled visit of a block has computed so far, kept for generation. The buffers
    have room for a whole block_size context and are filled in place, so that no step copies the cache to grow it,
    and a compiled decode step sees the same buffers at every token. With store, another KVCache, this one reads and
    writes that one's buffers and keeps only its own count of positions: kv_cache=last_loop (GPT.new_kv_cache) gives
    every visit of a core block its own KVCache over one store, so that a later loop of a position overwrites what
    the earlier loops wrote there."""

    def __init__(self, store=None):
        self.store = store or self  # whose buffers
        self.k = self.v = None  # (B, n_head, block_size, head_size) each, allocated at the first visit
        self.past = 0           # positions filled

    def update(self, k, v, block_size):
        """Write the new positions' k and v (B, n_head, T, head_size) after the past ones -> the keys and values of
        all positions so far."""
        store = self.store
        if store.k is None:
            store.k = k.new_empty(*k.shape[:2], block_size, k.size(3))
            store.v = v.new_empty(*v.shape[:2], block_size, v.size(3))
        end = self.past + k.size(2)
        store.k[:, :, self.past:end], store.v[:, :, self.past:end] = k, v
        self.past = end
        return store.k[:, :, :end], store.v[:, :, :end]

    def rewrite(self, start, k, v, block_size):
        """Replace the keys and values of the positions from start on with k and v (only those positions count)."""
        self.past = start
        self.update(k, v, block_size)


def make_norm(config):
    """The normalization every norm in the model uses. RMSNorm gets LayerNorm's eps: its default (None) would take the
    input dtype's machine epsilon, 0.008 for bfloat16, and change the model with the precision."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=1e-5)
    return nn.LayerNorm(config.n_embd, bias=config.bias)


def rotary_tables(block_size, head_size, base=10000.0):
    """cos and sin (block_size, head_size / 2) of RoPE's angles: position t turns channel pair i by t * base^(-2i/d)."""
    inv_freq = base ** -(torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    angles = torch.outer(torch.arange(block_size, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """Rotate the channel pairs (i, i + d/2) of x (B, n_head, T, d) by the angles of its T positions. The rotation
    runs in float32 and returns x's dtype, so that under autocast q, k and v keep one dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


def linear_probe(features, labels, fit, floor=1e-3):
    """Accuracy of a linear read-out of `labels` (n,) from `features` (n, d): least squares onto the labels' one-hot
    codes on the rows where `fit` (n,) is True, scored by argmax on the other rows, where a label the fit rows never
    showed counts as missed. The features are centred and divided by the stream's RMS (one number: the read-out
    does not depend on the stream's scale, which grows in Pre-LN and stays 1 in Post-LN), and only directions that
    vary by more than `floor` of that RMS are read: rounding varies a stream by a millionth, and a read-out of it
    would still tip the argmax between near-tied labels. 1.0: the stream still tells the labels apart linearly;
    the most frequent label's share: it no longer does."""
    x = features.detach().double()
    x = (x - x[fit].mean(0)) / x[fit].pow(2).mean().sqrt().clamp_min(1e-30)
    classes, code = labels[fit].unique(return_inverse=True)
    a, b = x[fit], x[~fit]
    target = torch.zeros(a.size(0), classes.numel(), dtype=x.dtype, device=x.device)
    target[torch.arange(a.size(0), device=x.device), code] = 1
    prior = target.mean(0)  # the intercept, since the features are centred
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    keep = s > floor * a.size(0) ** 0.5  # s / sqrt(n): the RMS of the stream along that direction
    weight = vh[keep].T @ ((u[:, keep].T @ (target - prior)) / s[keep, None])
    predicted = classes[(b @ weight + prior).argmax(1)]
    return (predicted == labels[~fit]).double().mean().item()


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.block_size = config.block_size
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matrix
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, cache=None, rope=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        if rope is not None:  # (cos, sin) of these T positions; cached keys are stored already rotated
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        past = 0  # positions before these T, whose keys and values come from the cache
        if cache is not None:
            past = cache.past
            k, v = cache.update(k, v, self.block_size)
        if past == 0:
            mask, causal = None, True
        elif T == 1:  # one new query after the cache sees every key: no mask, so the fastest kernels stay eligible
            mask, causal = None, False
        else:  # new queries sit after `past` cached keys: query i may see keys 0..past+i
            mask, causal = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past), False
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config, alpha, epsilon):
        super().__init__()
        self.pre_ln = config.residual in PRE_LN
        self.alpha, self.epsilon = alpha, epsilon
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)
        branch_norm = config.norm_branch_input and not self.pre_ln
        self.ln_attn_input = make_norm(config) if branch_norm else nn.Identity()
        self.ln_mlp_input = make_norm(config) if branch_norm else nn.Identity()

    def forward(self, x, cache=None, rope=None):
        if self.pre_ln:  # GPT-2; epsilon is 1 but in preln_scaled (1.0 * y is y, bit for bit)
            x = x + self.epsilon * self.attn(self.ln_1(x), cache, rope)
            return x + self.epsilon * self.mlp(self.ln_2(x))
        # Post-LN (deeploop, deepnorm, postln): the residual stream is up-weighted by alpha before each LayerNorm.
        # The stream is the previous norm's output, so ln_*_input (norm_branch_input) differ from identities only
        # through their learned gains (and LayerNorm's biases).
        x = self.ln_1(self.alpha * x + self.attn(self.ln_attn_input(x), cache, rope))
        return self.ln_2(self.alpha * x + self.mlp(self.ln_mlp_input(x)))


class LoopInput(nn.Module):
    """The stream entering every core loop after the first, from the state x the previous loop left and the embedded
    input e (the prelude's output, as Huginn's e = prelude(embed(x)); without a prelude the embedding, which ln_e
    normalizes in a Post-LN model):
        add     x + e, as Yang et al.'s looped transformer (Leiay/looped_transformer): z = f(z + e) from z = 0
        concat  adapter([x, e]), Huginn's Linear(2d -> d) (seal-rg/recurrent-pretraining), initialised to [I | 0] as
                in LoopedLMs/nanoLOOP: at init it passes the state through
    The first loop reads e itself, as add's zero start gives; not Huginn's random start state, so that a forward
    pass stays a function of its input (evaluation, cached decoding). It sits between loops, outside the blocks, so
    that both branches of the first core block read it. Every Post-LN block reads a normalized stream, and x and e
    are norms' outputs, but neither their sum (RMS about sqrt 2) nor a trained adapter's output is: a norm of its
    own follows. alpha does not weigh x against e: e is the input, to be read as strongly as the first loop reads
    it, not a branch to keep small. Pre-LN needs no norm: its blocks normalize each branch's input."""

    def __init__(self, config):
        super().__init__()
        C = config.n_embd
        self.adapter = nn.Linear(2 * C, C, bias=config.bias) if config.loop_input == "concat" else None
        self.norm = nn.Identity() if config.residual in PRE_LN else make_norm(config)

    def forward(self, x, e):
        return self.norm(x + e if self.adapter is None else self.adapter(torch.cat((x, e), dim=-1)))


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        N = config.coefficient_depth
        self.alpha, self.beta, self.epsilon = config.coefficients()

        def blocks(n):
            return nn.ModuleList([Block(config, self.alpha, self.epsilon) for _ in range(n)])

        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd) if config.position_encoding == "learned" else None,
            # Post-LN blocks read a normalized stream everywhere but at the first block; normalizing the embedding
            # (as BERT does) makes that one alike. Without it the tiny embedding (std 0.02) is soon swamped by what
            # the first branches learn to output for every position, and the model collapses to unigram statistics.
            ln_e=nn.Identity() if config.residual in PRE_LN else make_norm(config),
            drop=nn.Dropout(config.dropout),
            prelude=blocks(config.n_prelude),  # empty lists by default: the state dict is GPT-2's
            h=blocks(config.n_layer),  # the looped core
            coda=blocks(config.n_coda),
            inject=LoopInput(config) if config.loop_input != "none" else None,
            # Post-LN blocks already end in a LayerNorm; only Pre-LN needs a final one
            ln_f=make_norm(config) if config.residual in PRE_LN else nn.Identity(),
        ))
        if config.position_encoding == "rope":  # not in the state dict: a pure function of the config
            cos, sin = rotary_tables(config.block_size, config.n_embd // config.n_head)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

        self.apply(self._init_weights)
        with torch.no_grad():
            if config.loop_input == "concat":
                nn.init.eye_(self.transformer.inject.adapter.weight)  # [I | 0]; _init_weights zeroed the bias
            for block in self._visits(1):  # preln_scaled keeps std 0.02: its epsilon carries the depth
                if config.residual == "preln":  # GPT-2's scaled init, counted over the unrolled depth
                    for proj in (block.attn.c_proj, block.mlp.c_proj):
                        nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * N))
                elif config.residual not in PRE_LN:
                    # DeepNorm's init: v, the attention output and both MLP matrices times beta; q and k untouched
                    block.attn.c_attn.weight[2 * config.n_embd:] *= self.beta
                    for linear in (block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
                        linear.weight *= self.beta

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding=True):
        """Stored parameters; independent of n_loop. The position embedding is left out by default (as in nanoGPT);
        the token embedding stays in because it is also the output layer."""
        n = sum(p.numel() for p in self.parameters())
        wpe = self.transformer.wpe
        return n - wpe.weight.numel() if non_embedding and wpe is not None else n

    def _visits(self, n_loop):
        """The unrolled order of physical blocks: the prelude, the core's 0..L-1 n_loop times, the coda."""
        t = self.transformer
        return [*t.prelude, *[block for _ in range(n_loop or self.config.n_loop) for block in t.h], *t.coda]

    def _embed(self, idx, start=0):
        T = idx.size(1)
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of length {start + T} is longer than block_size {self.config.block_size}")
        x = self.transformer.wte(idx)
        if self.transformer.wpe is not None:
            x = x + self.transformer.wpe(torch.arange(start, start + T, dtype=torch.long, device=idx.device))
        return self.transformer.drop(self.transformer.ln_e(x))

    def _rope(self, start, T):
        """RoPE's (cos, sin) for positions [start, start + T), or None with learned positions."""
        if self.config.position_encoding != "rope":
            return None
        return self.rope_cos[start:start + T], self.rope_sin[start:start + T]

    def _loss(self, logits, targets):
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    @staticmethod
    def _run(blocks, x, caches, rope):
        for block, cache in zip(blocks, caches):
            x = block(x, cache, rope)
        return x

    def loop(self, state, e, caches, rope):
        """One loop of the core -> the state it leaves. state: what the previous loop left, None before the first
        loop, which reads the embedded input e alone; caches: the loop's n_layer KVCache entries (or Nones)."""
        return self._run(self.transformer.h, self._loop_input(state, e), caches, rope)

    def _loop_input(self, state, e):
        return e if state is None else state if self.transformer.inject is None else self.transformer.inject(state, e)

    def forward(self, idx, targets=None, n_loop=None, kv_cache=None, last_only=False, head=None, backprop_loops=0):
        """Logits for every position, and the mean cross-entropy when targets are given (-1 = ignore).
        n_loop runs another count of core loops than the model was built with (test-time depth, 1 to MAX_LOOPS);
        alpha, beta and epsilon stay as built.
        backprop_loops > 0 runs all core loops but the last backprop_loops without autograd (Huginn's truncated
        backprop): no gradient reaches the blocks' earlier visits. With loop_input none, nor do the prelude, the
        position embedding and ln_e, which only the first loop reads; with add or concat every loop reads the
        embedded input, so they learn through the loops that keep gradients, as Huginn's do. The coda always learns.
        Used by generate(): kv_cache, a list with one KVCache per unrolled visit (_visits' order); last_only, which
        spares the output layer all positions but the last; head, generate's copy of the output layer's weight
        (n_embd, vocab) to multiply by instead of calling lm_head."""
        if n_loop:
            check_loops(n_loop)
        P, L, loops = self.config.n_prelude, self.config.n_layer, n_loop or self.config.n_loop
        start = kv_cache[0].past if kv_cache else 0
        caches = kv_cache or [None] * self.config.depth(loops)
        rope = self._rope(start, idx.size(1))
        e = self._run(self.transformer.prelude, self._embed(idx, start), caches[:P], rope)
        untracked = loops - backprop_loops if backprop_loops else 0
        x = None
        for r in range(loops):
            with torch.no_grad() if r < untracked else nullcontext():
                x = self.loop(x, e, caches[P + r * L:P + (r + 1) * L], rope)
        logits = self._readout(x, caches[P + loops * L:], rope, last_only, head)
        return logits, None if targets is None else self._loss(logits, targets)

    def _readout(self, state, caches, rope, last_only=False, head=None):
        """Logits from the state the core's loops left: the coda, ln_f and the output layer."""
        x = self._run(self.transformer.coda, state, caches, rope)
        x = self.transformer.ln_f(x[:, -1:] if last_only else x)
        return x @ head if head is not None else self.lm_head(x)

    def exit_logits(self, idx, exit_threshold, n_loop=None, targets=None, kv_cache=None, head=None):
        """Adaptive exit, Huginn's KL criterion (seal-rg/recurrent-pretraining): each position takes the logits of
        the first loop r whose next-token distribution p_r is within exit_threshold of the previous loop's,
        KL(p_r || p_r-1) < exit_threshold, or of loop n_loop, the most a position runs -> (logits, loss or None,
        loops: (B, T), the loop each position took). p_0 is what the embedded input predicts before any loop (e
        through the coda, ln_f and the output layer), so that a position can exit after one loop: a threshold that
        every KL passes gives n_loop=1, and 0 (off: no KL is below it) gives n_loop. The criterion is a coda pass and
        an output-layer product per loop, and one for p_0.
        The positions of idx run together, loop by loop, until each has exited; a position reads the others' states
        at the same loop, exited or not. With kv_cache (new_kv_cache's list) the positions are appended to it, and
        each keeps there what its exit loop computed: in every later visit of a core block, the keys and values of
        its exit loop's visit of that block (as Huginn fills the steps a token skipped from its latest one), in the
        coda those of the coda's run on its exit loop's state. A position decoded later, one at a time (generate),
        reads an exited position's exit-loop entries at every deeper loop, where a parallel pass (no cache: scoring;
        or a prompt) lets it read what that position's further loops computed: the two differ wherever a position
        exits before the last loop (measured in docs/adaptive_exit.md)."""
        loops_max = n_loop or self.config.n_loop
        if not exit_threshold >= 0:
            raise ValueError(f"exit_threshold must be >= 0 (0 = off: every position runs n_loop loops), got "
                             f"{exit_threshold}")
        if not 1 <= loops_max <= MAX_LOOPS:
            raise ValueError(f"n_loop, the most loops a position runs with adaptive exit, must be from 1 to "
                             f"{MAX_LOOPS} (model.MAX_LOOPS), got {n_loop}")
        P, L, (B, T) = self.config.n_prelude, self.config.n_layer, idx.shape
        start = kv_cache[0].past if kv_cache else 0
        caches = kv_cache or [None] * self.config.depth(loops_max)
        coda = caches[P + loops_max * L:]
        rope = self._rope(start, T)
        e = self._run(self.transformer.prelude, self._embed(idx, start), caches[:P], rope)

        def readout(state):
            for cache in coda if kv_cache else ():
                cache.past = start  # every loop's readout writes these positions' coda entries anew
            logits = self._readout(state, coda, rope, head=head)
            return logits, F.log_softmax(logits.float(), dim=-1)

        _, log_p = readout(e)
        state, loops, logits, kept = None, torch.zeros(B, T, dtype=torch.long, device=idx.device), None, None
        for r in range(1, loops_max + 1):
            visits = caches[P + (r - 1) * L:P + r * L]
            state = self.loop(state, e, visits, rope)
            new_logits, new_log_p = readout(state)
            kl = (new_log_p.exp() * (new_log_p - log_p)).sum(-1).clamp_min(0)  # >= 0, but for rounding
            running = loops == 0
            exits = running & ((kl < exit_threshold) | (r == loops_max))
            loops = torch.where(exits, r, loops)
            logits = new_logits if logits is None else torch.where(exits[..., None], new_logits, logits)
            if kv_cache:  # what each position's exit loop computed: the core's while it runs, the coda's as it exits
                kept = self._keep(kept, visits, coda, running, exits, start, T)
            log_p = new_log_p
            if loops.all():
                break
        if kv_cache:
            self._rewrite_exited(caches, kept, loops, r, start)
        return logits, None if targets is None else self._loss(logits, targets), loops

    @staticmethod
    def _keep(kept, visits, coda, running, exits, start, T):
        """exit_logits' bookkeeping after a loop: each position's keys and values of the core's visits while it
        runs (so in the end its exit loop's), of the coda's blocks at the loop it exits at."""
        fresh = [(cache.store.k[:, :, start:start + T], cache.store.v[:, :, start:start + T])
                 for cache in (*visits, *coda)]
        if kept is None:  # the buffers are overwritten by later loops (last_loop) and readouts (the coda)
            return [(k.clone(), v.clone()) for k, v in fresh]
        masks = [running[:, None, :, None]] * len(visits) + [exits[:, None, :, None]] * len(coda)
        return [(torch.where(m, k, old_k), torch.where(m, v, old_v))
                for m, (k, v), (old_k, old_v) in zip(masks, fresh, kept)]

    def _rewrite_exited(self, caches, kept, loops, computed, start):
        """The end of a cached exit_logits pass: every position gets, in each core visit after its exit loop (with
        last_loop's shared entries: in every visit), its exit loop's keys and values of that block, also in the
        visits of loops that this pass did not run; in the coda, those of its exit."""
        P, L, block_size = self.config.n_prelude, self.config.n_layer, self.config.block_size
        T = loops.size(1)
        loops_max = (len(caches) - P - self.config.n_coda) // L
        for r in range(1, loops_max + 1):
            for b in range(L):
                cache, (k, v) = caches[P + (r - 1) * L + b], kept[b]
                if cache.store is cache and r <= computed:  # per_visit: loop r's own, where a position ran loop r
                    ran = (loops >= r)[:, None, :, None]
                    if ran.all():
                        continue
                    k = torch.where(ran, cache.k[:, :, start:start + T], k)
                    v = torch.where(ran, cache.v[:, :, start:start + T], v)
                cache.rewrite(start, k, v, block_size)
        for cache, (k, v) in zip(caches[P + loops_max * L:], kept[L:]):
            cache.rewrite(start, k, v, block_size)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, n_loop=None, use_cache=True,
                 vocab_size_limit=None, **kw):
        """Sample max_new_tokens continuations of idx (B, T) -> (B, T + max_new_tokens); see generate_stream."""
        return torch.cat([idx, *self.generate_stream(idx, max_new_tokens, temperature, top_k, n_loop, use_cache,
                                                     vocab_size_limit, **kw)], dim=1)

    def new_kv_cache(self, n_loop=None, kv_cache="per_visit"):
        """An empty cache for generate: a list in _visits' order, a KVCache per unrolled visit.
            per_visit  every visit has entries of its own: a block's second visit sees other inputs than its first,
                       so cached decoding equals recomputing; the memory grows with n_loop
            last_loop  the visits of a core block share one entry (Ouro's decoding with the last loop's cache):
                       each position keeps the keys and values of its last loop there, and every visit of the block
                       reads those of the earlier positions, so the memory does not grow with n_loop. It is an
                       approximation (cached no longer equals recomputed) but at n_loop=1, and within a prompt,
                       whose positions run their loops together
        The prelude and coda blocks run once, with one entry each in both."""
        if kv_cache not in KV_CACHES:
            raise ValueError(f"unknown kv_cache {kv_cache!r}; choose one of {', '.join(KV_CACHES)}")
        P, L, loops = self.config.n_prelude, self.config.n_layer, n_loop or self.config.n_loop
        if kv_cache == "per_visit":
            return [KVCache() for _ in range(self.config.depth(loops))]
        stores = [KVCache() for _ in range(L)]
        return [*(KVCache() for _ in range(P)), *(KVCache(stores[b]) for _ in range(loops) for b in range(L)),
                *(KVCache() for _ in range(self.config.n_coda))]

    @torch.no_grad()
    def generate_stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, n_loop=None, use_cache=True,
                        vocab_size_limit=None, exit_threshold=0.0, kv_cache="per_visit", loops_used=None):
        """Yield the sampled tokens (B, 1) one step at a time, so that sample.py can print them as they come.
        With use_cache each step feeds only the newest token and reads keys/values of earlier positions from a cache
        (new_kv_cache's kv_cache layout). Once the context outgrows block_size the window slides and every position
        embedding shifts, so the cache is rebuilt from the last block_size tokens; this keeps the output identical to
        recomputing the cropped context at every step. vocab_size_limit samples only ids below it: the output layer
        is padded (GPT-2's 50257 ids to 50304) and a tokenizer cannot decode the padding ids.
        exit_threshold > 0: adaptive exit (exit_logits), n_loop then the most loops a token runs. The prompt (and a
        rebuilt window) runs as one pass, each new token as a pass of its own; each step appends to loops_used (a
        list) the loops its tokens took, a (B,) tensor. A batch runs until its last sequence exits (the others'
        extra loops are computed and dropped). Adaptive exit and last_loop need the cache."""
        if not use_cache and (exit_threshold or kv_cache != "per_visit"):
            raise ValueError("adaptive exit (exit_threshold > 0) and kv_cache=last_loop work on the KV cache: use "
                             "use_cache=True")
        # A decode step reads every weight once and the output layer is most of them. F.linear reads the stored
        # (vocab, n_embd) matrix far below the memory bandwidth, a product with this transposed contiguous copy near
        # it (docs/speed.md); the copy is in the precision the steps compute in: under autocast its dtype. An output
        # layer swapped for another module (eval_downstream's float32 one) keeps its own product.
        head, device_type = None, idx.device.type
        if isinstance(self.lm_head, nn.Linear):
            weight = self.lm_head.weight
            dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
            head = weight.to(dtype).t().contiguous()
        caches = None
        for _ in range(max_new_tokens):
            if use_cache and caches and caches[0].past < self.config.block_size:
                new = idx[:, -1:]
            else:  # the first step, and every step once the window slides: the whole (cropped) context
                caches = self.new_kv_cache(n_loop, kv_cache) if use_cache else None
                new = idx[:, -self.config.block_size:]
            if exit_threshold:
                logits, _, loops = self.exit_logits(new, exit_threshold, n_loop, kv_cache=caches, head=head)
                if loops_used is not None:
                    loops_used.append(loops[:, -1])
            else:
                logits, _ = self(new, n_loop=n_loop, kv_cache=caches, last_only=True, head=head)
            # the softmax in float32 whatever the step computed in, over the real vocabulary only
            logits = logits[:, -1, :vocab_size_limit].float() / temperature
            if top_k is not None:  # sample among the top_k candidates only: far cheaper than masking a large vocab
                logits, candidates = torch.topk(logits, min(top_k, logits.size(-1)))
                idx_next = candidates.gather(-1, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1))
            else:
                idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
            yield idx_next

    def loop_diagnostics(self, idx, targets):
        """What looping does inside the network, on one batch:
            residual_rms[v]   RMS of the residual stream after unrolled visit v (n_layer * n_loop values);
            grad_norm[b][r]   norm of the gradient that visit r contributes to physical block b;
            kappa[b]          the visit-alignment coefficient of block b (below);
            token_probe[v]    how well a linear read-out recovers each position's input token from the stream
                              after visit v (linear_probe, fit on the first half of the batch's sequences and scored
                              on the other half); [0] reads the core's input (the embedded input), [v] visit v's output;
            position_probe[v] the same for each position's index: what a pointer to a cell must find.
        Each visit runs the block with its own leaf copy of the block's parameters (sharing storage), so autograd
        hands back the per-visit gradient contributions g_r, whose sum is the block's real gradient. All of them cover
        the looped core only; the prelude and coda run as in forward."""
        L, R = self.config.n_layer, self.config.n_loop
        rope = self._rope(0, idx.size(1))
        e = self._run(self.transformer.prelude, self._embed(idx), [None] * self.config.n_prelude, rope)
        x, residual_rms, visit_params, streams = None, [], [], [e.detach()]
        for _ in range(R):
            x = self._loop_input(x, e)
            for block in self.transformer.h:
                params = {name: p.detach().requires_grad_() for name, p in block.named_parameters()}
                x = functional_call(block, params, (x, None, rope))
                visit_params.append(params)
                streams.append(x.detach())
                residual_rms.append(streams[-1].pow(2).mean().sqrt().item())
        x = self._run(self.transformer.coda, x, [None] * self.config.n_coda, rope)
        loss = self._loss(self.lm_head(self.transformer.ln_f(x)), targets)
        grads = torch.autograd.grad(loss, [p for params in visit_params for p in params.values()])
        n = len(visit_params[0])
        flat = [torch.cat([g.flatten() for g in grads[v * n:(v + 1) * n]]) for v in range(L * R)]
        grad_norm, kappa = [], []
        for b in range(L):
            g = [flat[r * L + b] for r in range(R)]
            # kappa_R = ||sum_r g_r||^2 / sum_r ||g_r||^2 compares the block's real update with what R independent
            # blocks would get. It is 1 when the visits' gradients are orthogonal (decorrelated visits: DeepNorm's
            # exponent 1/4 suffices) and R when they all point the same way (the aligned regime that DeepLoop's
            # exponent 1/2 is built for); values below 1 mean visits partly cancel. It is exactly 1 when n_loop = 1,
            # and close to 1 too when one visit's gradient dwarfs the others (grad_norm shows which case it is).
            sq = [gr.pow(2).sum() for gr in g]
            grad_norm.append([s.sqrt().item() for s in sq])
            kappa.append((sum(g).pow(2).sum() / sum(sq).clamp_min(1e-30)).item())
        # what each position's stream still holds of what its cell is: its input token and its position
        B, T = idx.shape
        fit = torch.arange(B, device=idx.device).repeat_interleave(T) < B // 2
        positions = torch.arange(T, device=idx.device).repeat(B)
        token_probe, position_probe = ([linear_probe(s.reshape(B * T, -1), labels, fit) for s in streams]
                                       for labels in (idx.reshape(-1), positions))
        return dict(residual_rms=residual_rms, grad_norm=grad_norm, kappa=kappa, token_probe=token_probe,
                    position_probe=position_probe)

    def compile_blocks(self, **options):
        """torch.compile every Block in place, and the loss (options as torch.compile's, e.g. backend=): how train.py
        compiles. Compiling the whole forward traces the unrolled loop over the visits, one graph per loop count, and
        past dynamo's recompile_limit (8) every further count runs uncompiled, with a warning only: sampled loop counts
        (TrainLoops; log-normal Poisson with mean 8 draws 20 counts in 200 steps) and eval_loops exceed it. Marking the
        count dynamic does not help: the Python loop specializes on it, and raising the limit would compile the whole
        unrolled model again for each count. One Block graph serves every visit of every block, whatever the count
        (their parameters are graph inputs); it varies only with autograd on or off (backprop_loops), training or eval,
        and whether its input carries a gradient: a handful of graphs in all. Against the whole forward this gives up
        fusing across block boundaries and around the embedding and the output layer's matrix product; the blocks'
        products, norms and activations, and the loss, compile as before."""
        for module in self.modules():
            if isinstance(module, Block):
                module.compile(**options)
        self._loss = torch.compile(self._loss, **options)

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW with weight decay on matrices only (not on biases and LayerNorm gains)."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay),
                  dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type in ("cuda", "cpu")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **(dict(fused=True) if fused else {}))

    def flops_per_token(self, n_loop=None, backprop_loops=0):
        """Training FLOPs per token of a step that runs n_loop loops (None: the model's), counted over the unrolled
        depth: each visit of a block costs its matmuls again (PaLM appendix B accounting). The forward pass costs 2
        FLOPs per parameter and token in every visit, the backward pass 4, in the visits it reaches only: with
        backprop_loops, the last backprop_loops loops (forward's truncated backprop). Attention's scores likewise:
        4 * n_embd * block_size per visit forward, twice that backward. The prelude, coda and injection run once a
        pass, forward and backward (with backprop_loops and loop_input none no gradient reaches the prelude: its
        backward is counted all the same, a few blocks' worth at most)."""
        cfg = self.config
        loops = n_loop or cfg.n_loop
        tracked = min(backprop_loops, loops) if backprop_loops else loops
        core_params = sum(p.numel() for p in self.transformer.h.parameters())
        other_params = self.num_params() - core_params  # the tied output layer, prelude, coda, injection, norms
        attention = 4 * cfg.n_embd * cfg.block_size
        once = cfg.n_prelude + cfg.n_coda
        forward = 2 * (core_params * loops + other_params) + attention * cfg.depth(loops)
        return forward + 4 * (core_params * tracked + other_params) + 2 * attention * (cfg.n_layer * tracked + once)

    def estimate_mfu(self, tokens_per_iter, dt, peak_flops, n_loop=None, backprop_loops=0):
        """Model FLOPs utilisation of steps that run n_loop loops (flops_per_token): achieved training FLOP/s over
        peak_flops (e.g. 989e12 for an H100's bf16)."""
        return self.flops_per_token(n_loop, backprop_loops) * tokens_per_iter / dt / peak_flops

    def decode_step_bytes(self, sequences, past, element_size, n_loop=None, kv_cache="per_visit"):
        """Bytes a cached decode step must read from memory at the least, the yardstick of bench.py's decode floor
        (these bytes over the memory bandwidth): every weight of the blocks and of the output layer once, and the
        keys and values of `past` positions of each sequence in every unrolled visit (last_loop: in every physical
        block, read once). The embeddings' few rows and the activations are left out."""
        t = self.transformer
        weights = sum(p.numel() for m in (t.prelude, t.h, t.coda, t.inject) if m is not None for p in m.parameters())
        weights += self.lm_head.weight.numel()
        return weights * element_size + self.kv_cache_bytes(sequences, past, element_size, n_loop, kv_cache)

    def kv_cache_bytes(self, sequences, positions, element_size, n_loop=None, kv_cache="per_visit"):
        """Bytes of the keys and values of `positions` positions of each sequence in a cache of new_kv_cache's
        layout: an entry per unrolled visit (per_visit) or per physical block (last_loop)."""
        cfg = self.config
        entries = cfg.depth(n_loop or cfg.n_loop) if kv_cache == "per_visit" else cfg.depth(1)
        return 2 * entries * sequences * positions * cfg.n_embd * element_size

    @classmethod
    def from_checkpoint(cls, path, device="cpu"):
        """Load a checkpoint written by train.py -> (model on device, checkpoint dict). The file is read onto the CPU,
        so that the optimizer state in it does not take device memory before the optimizer asks for it; drop the dict
        once done with it. weights_only=True: loading can never run code from the file. Raises FileNotFoundError or
        ValueError with a message that says what to do."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no checkpoint at {path}; train one with `python train.py config/smoke_cpu.py` "
                                    f"or set --out_dir")
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"{path} is not a readable checkpoint ({type(e).__name__}); point --out_dir at a "
                             f"train.py run") from e
        if not isinstance(ckpt, dict) or ckpt.get("program") != "deeploop-train":
            raise ValueError(f"{path} was not written by this project's train.py; point --out_dir at a train.py run")
        model = cls(GPTConfig(**ckpt["model_args"]))
        model.load_state_dict(ckpt["model"])
        return model.to(device), ckpt
