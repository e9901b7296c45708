"""
A looped GPT with DeepLoop residual scaling, in one file.

A looped GPT stores `n_layer` physical blocks and runs the whole stack `n_loop` times: it is
`unrolled_depth = n_layer * n_loop` blocks deep while holding the parameters of `n_layer` blocks. DeepLoop keeps
DeepNorm's Post-LN block, x = Norm(alpha * x + f(x)), and changes two numbers only: alpha, how much the residual
stream is up-weighted before each norm, and beta, how much the branches' matrices are scaled down at init.

Read top to bottom: residual_coefficients (the rule, and why the exponent is 1/2), GPTConfig, GPT-2's two branches
(RMSNorm and RoPE are options: the paper's backbone), Block (where alpha acts), GPT (where beta acts, at init, and
where the blocks loop, in forward). Huginn's prelude and coda blocks and the input fed into every loop are here too,
off by default; what a researcher adds on top lives in lab/ and builds on GPT's embed, loop and readout.
"""

import inspect
import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

RESIDUALS = ("deeploop", "deepnorm", "postln", "preln", "preln_scaled")
PRE_LN = ("preln", "preln_scaled")  # GPT-2's block x = x + f(Norm(x)); the other schemes are Post-LN
OWN_EXPONENT = {"deeploop": 0.5, "deepnorm": 0.25}  # p of each scheme that has one
CHOICES = dict(residual=RESIDUALS, norm=("layernorm", "rmsnorm"), position_encoding=("learned", "rope"),
               loop_input=("none", "add", "concat"))
# The most loops a pass may run: a training step never ends early (SIGTERM too), so it must end whatever the typo
MAX_LOOPS = 1024  # 32 times Huginn's training mean of 32


def residual_coefficients(residual, unrolled_depth, exponent=0.0):
    """(alpha, beta) of a residual scheme at unrolled depth N:

        deeploop: alpha = (2N)^p,  beta = (8N)^(-p),  p = 1/2
        deepnorm: alpha = (2N)^p,  beta = (8N)^(-p),  p = 1/4
        postln, preln, preln_scaled: alpha = beta = 1

    A nonzero `exponent` replaces p for deeploop and deepnorm (the paper's Appendix C sweeps it). Where they act:
    alpha up-weights the stream before each norm of a Post-LN block (Block.forward); beta multiplies the value
    projection, the attention output projection and both MLP matrices once, at init (GPT.__init__).
    Why 1/2: DeepNorm bounds how far one optimizer step moves the output of an untied network, each of whose N branches
    gets and applies its own update. A looped block is visited n_loop times; its one update sums the gradients of all
    its visits, and every visit reads it back. When the visits' gradients align (kappa_R near R, lab/probes.py) the
    output's change grows like the square of the visit count, and bounding it takes alpha and 1/beta growing like
    N^(1/2). At n_loop = 1 nothing is revisited and the rule is a more conservative DeepNorm."""
    if residual not in RESIDUALS:
        raise ValueError(f"unknown residual scheme {residual!r}; choose one of {', '.join(RESIDUALS)}")
    if exponent < 0:
        raise ValueError(f"residual_exponent must be >= 0 (0 = the scheme's own), got {exponent}")
    if residual not in OWN_EXPONENT:
        if exponent:
            raise ValueError(f"residual_exponent={exponent} only applies to deeploop and deepnorm, not {residual}; "
                             f"leave it at 0 or use --residual=deeploop")
        return 1.0, 1.0
    p = exponent or OWN_EXPONENT[residual]
    return (2 * unrolled_depth) ** p, (8 * unrolled_depth) ** -p


def branch_scale(residual, n_blocks, n_loop, lam=1.0):
    """epsilon of a Pre-LN block x = x + epsilon * f(Norm(x)): lam / (n_loop * sqrt(n_blocks)) for preln_scaled, the
    rival rule (arXiv 2606.18524: a looped block's visits make correlated updates), 1 for every other scheme. n_blocks:
    the distinct blocks, prelude and coda too, whose epsilon is the looped core's (the rule has none of its own)."""
    if not 0 < lam < math.inf:
        raise ValueError(f"residual_lambda must be a positive number (the paper's lambda, 1 by default), got {lam}")
    if residual != "preln_scaled":
        if lam != 1:
            raise ValueError(f"residual_lambda={lam} only applies to preln_scaled, not {residual}; leave it at 1 or "
                             f"use --residual=preln_scaled")
        return 1.0
    return lam / (n_loop * math.sqrt(n_blocks))


def check_loops(n_loop, zero_is_trained=False):  # zero_is_trained: 0 passes too, a script's "the trained count"
    if not (1 <= n_loop <= MAX_LOOPS or zero_is_trained and n_loop == 0):
        raise ValueError(f"n_loop must be a loop count from 1 to {MAX_LOOPS} (model.MAX_LOOPS)"
                         f"{', or 0 (the trained one)' if zero_is_trained else ''}, got {n_loop}")


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for faster matmuls
    n_layer: int = 12        # physical blocks of the looped core
    n_loop: int = 1          # loops over them
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    residual: str = "deeploop"      # deeploop | deepnorm | postln | preln | preln_scaled
    residual_exponent: float = 0.0  # p of alpha = (2N)^p, beta = (8N)^-p; 0 = the scheme's own
    residual_lambda: float = 1.0    # preln_scaled's lambda
    # the backbone, GPT-2's by default; the paper's block, RMSNorm(alpha * x + f(RMSNorm(x))), is all three below
    norm: str = "layernorm"             # layernorm | rmsnorm
    position_encoding: str = "learned"  # learned (GPT-2's embedding) | rope (rotary, on q and k)
    norm_branch_input: bool = False     # Post-LN: normalize each branch's input too
    coefficient_loops: int = 0  # alpha, beta and epsilon from this many loops (0: n_loop), whatever a pass runs
    # Huginn's shape: blocks run once before and after the looped core, and the embedded input fed to every loop
    n_prelude: int = 0
    n_coda: int = 0
    loop_input: str = "none"  # none | add | concat (LoopInput)

    def __post_init__(self):
        for key, choices in CHOICES.items():
            if getattr(self, key) not in choices:
                raise ValueError(f"unknown {'residual scheme' if key == 'residual' else key} {getattr(self, key)!r}; "
                                 f"choose one of {', '.join(choices)}")
        sizes = {k: getattr(self, k) for k in ("block_size", "vocab_size", "n_layer", "n_loop", "n_head", "n_embd")}
        if min(sizes.values()) < 1:
            raise ValueError(f"{', '.join(f'{k}={v}' for k, v in sizes.items() if v < 1)}: sizes must be >= 1")
        check_loops(self.n_loop)
        if not 0 <= self.coefficient_loops <= MAX_LOOPS:
            raise ValueError(f"coefficient_loops must be from 0 (= n_loop) to {MAX_LOOPS} (model.MAX_LOOPS), got "
                             f"{self.coefficient_loops}")
        if min(self.n_prelude, self.n_coda) < 0:
            raise ValueError(f"n_prelude and n_coda must be >= 0 (0 = none), got n_prelude={self.n_prelude} n_coda="
                             f"{self.n_coda}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.position_encoding == "rope" and self.n_embd // self.n_head % 2:
            raise ValueError(f"rope rotates pairs of channels: the head size n_embd/n_head="
                             f"{self.n_embd // self.n_head} must be even")
        self.coefficients()  # raises on a bad exponent or lambda

    def depth(self, loops):
        """Blocks a pass with `loops` loops of the core runs through: prelude and coda once, the core every loop."""
        return self.n_prelude + self.n_layer * loops + self.n_coda

    @property
    def unrolled_depth(self):
        return self.depth(self.n_loop)

    @property
    def coefficient_depth(self):
        """The N of alpha, beta and Pre-LN's scaled init: the unrolled depth at coefficient_loops (0: n_loop) loops."""
        return self.depth(self.coefficient_loops or self.n_loop)

    def coefficients(self):
        """(alpha, beta, epsilon) of the model at coefficient_depth; epsilon over the distinct blocks, depth(1)."""
        return (*residual_coefficients(self.residual, self.coefficient_depth, self.residual_exponent),
                branch_scale(self.residual, self.depth(1), self.coefficient_loops or self.n_loop, self.residual_lambda))


def make_norm(config):
    # RMSNorm's default eps would be the input dtype's machine epsilon (0.008 in bfloat16): LayerNorm's instead
    return nn.RMSNorm(config.n_embd, eps=1e-5) if config.norm == "rmsnorm" else \
        nn.LayerNorm(config.n_embd, bias=config.bias)


class KVCache:
    """The keys and values one unrolled visit has computed so far, in buffers of block_size that fill in place."""

    def __init__(self):
        self.k, self.v, self.past = None, None, 0  # k, v (B, n_head, block_size, head_size) at the first update

    def update(self, k, v, block_size):
        """Write the new positions' k and v after the past ones -> the keys and values of all positions so far."""
        if self.k is None:
            self.k, self.v = (t.new_empty(*t.shape[:2], block_size, t.size(3)) for t in (k, v))
        end = self.past + k.size(2)
        self.k[:, :, self.past:end], self.v[:, :, self.past:end] = k, v
        self.past = end
        return self.k[:, :, :end], self.v[:, :, :end]


class Rotary(nn.Module):
    """RoPE: channel pair (i, i + d/2) of q and k at position t turns by t * base^(-2i/d): scores see distances only."""

    def __init__(self, head_size, block_size, base=10000.0):
        super().__init__()
        inv_freq = base ** -(torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
        angles = torch.outer(torch.arange(block_size, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)  # a function of the config: not in checkpoints
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x, start):
        """x (B, n_head, T, d) at positions start.. start + T, rotated in float32 and returned in x's dtype."""
        return self.rotate(x, self.cos[start:start + x.size(2)], self.sin[start:start + x.size(2)])

    @staticmethod
    def rotate(x, cos, sin):
        """x (..., T, d) turned by the angles of cos and sin (T, d/2), rows a server may pick per token's position."""
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head, self.block_size, self.dropout = config.n_head, config.block_size, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matrix
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        rope = config.position_encoding == "rope"
        self.rotary = Rotary(config.n_embd // config.n_head, config.block_size) if rope else None

    def forward(self, x, cache=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
        past = cache.past if cache is not None else 0  # positions before these T, read from the cache
        if self.rotary is not None:  # cached keys are stored rotated
            q, k = self.rotary(q, past), self.rotary(k, past)
        if cache is not None:
            k, v = cache.update(k, v, self.block_size)
        mask = None  # one new query after the cache sees every key: no mask keeps the fastest kernels eligible
        if past and T > 1:  # new queries after `past` cached keys: query i sees keys 0..past+i
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
        # `not past` stays a Python bool under torch.compile (`past == 0` would turn symbolic and break the graph)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not past,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Post-LN (deeploop, deepnorm, postln): x = Norm(alpha * x + f(x)), attention then MLP; alpha acts here.
    Pre-LN (preln, preln_scaled): x = x + epsilon * f(Norm(x)), GPT-2's block (epsilon is 1 but in preln_scaled)."""

    def __init__(self, config, alpha, epsilon):
        super().__init__()
        self.pre_ln, self.alpha, self.epsilon = config.residual in PRE_LN, alpha, epsilon
        self.ln_1, self.attn = make_norm(config), CausalSelfAttention(config)
        self.ln_2, self.mlp = make_norm(config), MLP(config)
        # the paper's block normalizes each branch's input too: identities but for their learned gains, at init
        branch_norm = config.norm_branch_input and not self.pre_ln
        self.ln_attn_input, self.ln_mlp_input = (make_norm(config) if branch_norm else nn.Identity() for _ in "am")

    def forward(self, x, cache=None):
        if self.pre_ln:
            x = x + self.epsilon * self.attn(self.ln_1(x), cache)
            return x + self.epsilon * self.mlp(self.ln_2(x))
        x = self.ln_1(self.alpha * x + self.attn(self.ln_attn_input(x), cache))
        return self.ln_2(self.alpha * x + self.mlp(self.ln_mlp_input(x)))


class LoopInput(nn.Module):
    """What every loop after the first reads from the state x and the embedded input e: add, x + e (Yang et al.), or
    concat, Linear([x, e]) (Huginn's adapter) initialised to [I | 0]; then a norm in Post-LN models. alpha does not
    weigh x against e: the input is read as strongly as the first loop reads it."""

    def __init__(self, config):
        super().__init__()
        concat = config.loop_input == "concat"
        self.adapter = nn.Linear(2 * config.n_embd, config.n_embd, bias=config.bias) if concat else None
        self.norm = nn.Identity() if config.residual in PRE_LN else make_norm(config)

    def forward(self, x, e):
        return self.norm(x + e if self.adapter is None else self.adapter(torch.cat((x, e), dim=-1)))


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.alpha, self.beta, self.epsilon = config.coefficients()
        blocks = lambda n: nn.ModuleList(Block(config, self.alpha, self.epsilon) for _ in range(n))  # noqa: E731
        post_ln = config.residual not in PRE_LN
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd) if config.position_encoding == "learned" else None,
            # Post-LN blocks read a normalized stream but at the first; a normalized embedding is not swamped by the
            # first branches' outputs (without it the model collapses to unigram statistics)
            ln_e=make_norm(config) if post_ln else nn.Identity(),
            drop=nn.Dropout(config.dropout),
            prelude=blocks(config.n_prelude),  # empty by default
            h=blocks(config.n_layer), coda=blocks(config.n_coda),  # the looped core, then the coda
            inject=LoopInput(config) if config.loop_input != "none" else None,  # feeds e into the loops after the first
            ln_f=nn.Identity() if post_ln else make_norm(config),  # a Post-LN block ends in a norm already
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        with torch.no_grad():
            for block in (*self.transformer.prelude, *self.transformer.h, *self.transformer.coda):
                if post_ln:  # where beta acts: v, the attention output and both MLP matrices; q and k untouched
                    block.attn.c_attn.weight[2 * config.n_embd:] *= self.beta
                    for linear in (block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
                        linear.weight *= self.beta
                elif config.residual == "preln":  # GPT-2's scaled init over the unrolled depth (preln_scaled: epsilon)
                    for linear in (block.attn.c_proj, block.mlp.c_proj):
                        nn.init.normal_(linear.weight, std=0.02 / math.sqrt(2 * config.coefficient_depth))
            if config.loop_input == "concat":
                nn.init.eye_(self.transformer.inject.adapter.weight)  # [I | 0]

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding=True):
        """Stored parameters, whatever n_loop; the position embedding left out by default (as in nanoGPT)."""
        wpe = self.transformer.wpe if non_embedding and self.transformer.wpe is not None else None
        return sum(p.numel() for p in self.parameters()) - (wpe.weight.numel() if wpe is not None else 0)

    # A forward pass in three parts, which the lab runs one by one; `caches` gives each visit its KVCache (or None)

    def embed(self, idx, start, caches):
        """The input of the looped core: token (and position) embeddings from position `start` on, then the prelude."""
        if (length := start + idx.size(1)) > self.config.block_size:
            raise ValueError(f"sequence of length {length} is longer than block_size {self.config.block_size}")
        x = self.transformer.wte(idx)
        if self.transformer.wpe is not None:
            x = x + self.transformer.wpe(torch.arange(start, start + idx.size(1), device=idx.device))
        x = self.transformer.drop(self.transformer.ln_e(x))
        for block in self.transformer.prelude:
            x = block(x, next(caches))
        return x

    def loop(self, x, e, caches):
        """One loop of the core, from the state x the previous loop left (None before the first)."""
        x = self.into_loop(x, e)
        for block in self.transformer.h:
            x = block(x, next(caches))
        return x

    def into_loop(self, x, e):
        """What a loop reads: e in the first loop (x None), then the state x, with e fed in by LoopInput if set."""
        return e if x is None else x if self.transformer.inject is None else self.transformer.inject(x, e)

    def readout(self, x, caches, last_only=False):
        """Logits from the state the loops left: the coda, the final norm and the output layer."""
        for block in self.transformer.coda:
            x = block(x, next(caches))
        return self.output_layer(self.transformer.ln_f(x[:, -1:] if last_only else x))

    def output_layer(self, x):
        """lm_head(x), or within a step of generate_stream its oneDNN-packed copy: F.linear is slow on few rows."""
        packed = getattr(self, "packed_head", None)
        return self.lm_head(x) if packed is None or torch.compiler.is_compiling() else packed(x)

    def packed_output_layer(self):
        """lm_head through a oneDNN-packed copy of its weight, for one generation; None but in CPU float32."""
        w = self.lm_head.weight if type(self.lm_head) is nn.Linear else None  # a swapped-in head computes its own way
        if w is None or torch.is_autocast_enabled("cpu") or w.dtype != torch.float32 or not w.is_cpu or \
                not torch.backends.mkldnn.is_available():
            return None
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)  # laid out for 8 rows: the fastest from 1 to 2048
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def loss(self, logits, targets):
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def forward(self, idx, targets=None, n_loop=None, caches=None, last_only=False):
        """Logits of every position (the last only with last_only), and the mean cross-entropy when targets are given
        (-1: ignored). n_loop runs another count of loops than the model was built with (test-time depth); alpha,
        beta and epsilon stay as built. caches: new_caches' list, one KVCache per unrolled visit (generation)."""
        loops = n_loop or self.config.n_loop
        check_loops(loops)
        if caches is not None and len(caches) != self.config.depth(loops):
            raise ValueError(f"a cache of {len(caches)} visits for a pass through {self.config.depth(loops)}: make it "
                             f"with new_caches(n_loop) for the n_loop the pass runs")
        start = caches[0].past if caches else 0
        caches = iter(caches) if caches else itertools.repeat(None)
        e = self.embed(idx, start, caches)
        x = None
        for _ in range(loops):  # the same n_layer blocks, every loop
            x = self.loop(x, e, caches)
        logits = self.readout(x, caches, last_only)
        return logits, None if targets is None else self.loss(logits, targets)

    def new_caches(self, n_loop=None):
        """An empty KV cache: a KVCache per unrolled visit, each seeing another input (last_loop: lab.decode)."""
        return [KVCache() for _ in range(self.config.depth(n_loop or self.config.n_loop))]

    def generate(self, idx, max_new_tokens, *args, **kwargs):
        """Sample max_new_tokens continuations of idx (B, T) -> (B, T + max_new_tokens); generate_stream's arguments."""
        return torch.cat([idx, *self.generate_stream(idx, max_new_tokens, *args, **kwargs)], dim=1)

    @torch.no_grad()
    def generate_stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, n_loop=None, use_cache=True,
                        vocab_size_limit=None, caches=None, next_logits=None):
        """Yield the sampled tokens (B, 1) one step at a time. With use_cache a step feeds the newest token only and
        reads the rest from caches (new_caches'); past block_size the window slides and the cache refills, equal to
        recomputing the cropped context. vocab_size_limit: ids below it only (no padding ids). next_logits(ids,
        caches) -> the last position's logits in place of forward: how the lab's adaptive exit decodes."""
        caches = (caches or self.new_caches(n_loop)) if use_cache else None
        packed = self.packed_output_layer()
        for _ in range(max_new_tokens):
            if caches and 0 < caches[0].past < self.config.block_size:
                ids = idx[:, -1:]
            else:  # the first step, and every step once the window slides: the whole cropped context
                for cache in caches or ():
                    cache.past = 0
                ids = idx[:, -self.config.block_size:]
            self.packed_head = packed  # for this step only: no yield while it is set, so no training ever sees it
            try:
                logits = next_logits(ids, caches) if next_logits else self(ids, None, n_loop, caches, True)[0]
            finally:
                self.packed_head = None
            logits = logits[:, -1, :vocab_size_limit].float()  # the softmax in float32
            logits, top = torch.topk(logits, min(top_k, logits.size(-1))) if top_k is not None else (logits, None)
            # max at 0: no temperature overflows; top_k's max is its first value, and only its k values are scaled
            logits = (logits - (logits[:, :1] if top_k is not None else logits.amax(-1, keepdim=True))) / temperature
            idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx_next = idx_next if top is None else top.gather(-1, idx_next)  # top_k's: cheaper than masking the rest
            idx = torch.cat((idx, idx_next), dim=1)
            yield idx_next

    def compile_blocks(self, **options):
        """torch.compile every block and the loss in place: one Block graph serves every visit at any loop count."""
        for block in (*self.transformer.prelude, *self.transformer.h, *self.transformer.coda):
            block.compile(**options)
        self.loss = torch.compile(self.loss, **options)

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW with weight decay on matrices only (not on biases and norm gains)."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay), dict(
            params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type in ("cuda", "cpu")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **(dict(fused=True) if fused else {}))
