"""
How far one optimizer step moves a looped model, against its untied control: the quantity the DeepLoop bound is
about (DeepNet's "model update", ||F(x; theta + dtheta) - F(x; theta)||), measured rather than read off outcomes.

    python -m lab.model_update                               # one step from init on text: looped against untied
    python -m lab.model_update --backbone=paper              # the same on the paper's block (RMSNorm, RoPE)
    python -m lab.model_update --sgd_lrs=0.1,10,1000 --adamw_lrs=3e-4,3e-3,3e-2   # where the linearization ends
    python -m lab.model_update --mode=train                  # the per-step update over training, depth task
    python -m lab.model_update --json_out=steps.json --png=steps.png

mode=step. For each scheme and loop count R: the looped model, L = n_layer blocks run R times, and its untied control,
L * R blocks run once (GPTConfig(n_layer=L * R, n_loop=1): the same unrolled depth N, so the same alpha and beta). The
control is a copy (block i = looped block i % L, everything else shared): at init it computes the same function, bit
for bit, and its blocks get exactly the looped visits' gradients, so the two differ in the update alone: a looped
block gets one that sums its R visits' gradients, and all R visits read it back. (control=fresh: an independently
initialized untied model instead.) One step on a fixed batch, SGD (the setting of a first-order bound) or AdamW as
train.py configures it (betas, weight decay, clipping of the gradient norm), moving the blocks' matrices alone (what
alpha and beta scale), the blocks, or the whole model; then on that batch:
    logits, stream   RMS of the change of the logits and of the stream the last block leaves
    *_lin, *_miss    RMS of the first-order prediction (the Jacobian-vector product along the step), and of the real
                     change minus it
    kappa            kappa_R of the step's gradient per block, ||sum_r g_r||^2 / sum_r ||g_r||^2 as
                     lab.probes.visit_diagnostics defines it (1: the visits decorrelated, R: aligned)
mode=train. train.py's AdamW, clipping and learning-rate schedule on the depth task (config/depth_cpu.py's model and
batches; the same init, batches and losses as train.py), and after every step the RMS change of the logits on a fixed
val batch: DeepNet's figure of the model update over the first steps; kappa_R and the token probe after the last
visit (lab.probes.visit_diagnostics) every kappa_interval steps.

Prints markdown tables; json_out gets every record, png a figure. Results: docs/model_update.md. The functions above
the script part raise ValueError with a message that names the fix; the script prints it as one line.
"""

import dataclasses
import json
import math
import os
import sys

import torch
from torch.func import functional_call, jvp
from torch.nn.attention import SDPBackend, sdpa_kernel

from configurator import configure, die
from lab import require
from dataset import EVAL_SEED, TokenWindows, load_meta
from model import GPT, GPTConfig
from prepare_data import prepare_builtin_if_missing
from lab.probes import loop_diagnostics
from lab.tasks import PointerChains

# ---------------------------------------------------------------------------------------------------------------------
mode = "step"            # step: one step from init, looped against untied | train: the per-step update over training
# "" takes the mode's default (MODES)
dataset = ""             # builtin_bytes (text) | chains (config/depth_cpu.py's pointer chains)
schemes = ""             # postln, preln, deeploop (p = 1/2), deepnorm (1/4), deeploop:p (any p), comma-separated
loops = ""               # R values
seeds = "0,1,2"          # each: the init (torch.manual_seed) and, in step mode, the batch
backbone = "gpt2"        # gpt2 (GPT-2's blocks) | paper (RMSNorm, RoPE, norm_branch_input: the paper's block)
n_layer = 2
n_head = 4
n_embd = 64
block_size = 0           # 0: the dataset's (DATA_SHAPES: the sweeps' text model, config/depth_cpu.py)
batch_size = 0
# step mode
optimizers = "sgd,adamw"
sgd_lrs = "0.1"
adamw_lrs = "3e-3"
moving = "matrices,blocks,all"  # what a step moves (MOVING)
control = "copy"         # copy: the untied control computes the looped model's function | fresh: its own init
dtype = "float64"        # float64 | float32, which rounds the change of a small step to nothing
# AdamW as train.py (both modes), and train mode's schedule (config/depth_cpu.py's)
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0          # train.py's clipping of the gradient norm before AdamW's step; 0: none
learning_rate = 3e-3
min_lr = 3e-4
lr_decay_iters = 1500
warmups = "100,500"      # train mode: the warmup_iters of each run
max_iters = 300          # train mode: steps measured
kappa_interval = 10      # train mode: kappa_R and the token probe every this many steps; 0: never
models = "tied"          # train mode: tied (the looped model), untied (L * R blocks once, own init), or both
json_out = ""            # every record, as JSON ("": none)
png = ""                 # the figure ("": none)
# ---------------------------------------------------------------------------------------------------------------------

MODES = {
    "step": dict(dataset="builtin_bytes", schemes="postln,deepnorm,deeploop,deeploop:1,preln", loops="1,2,4,8,16"),
    "train": dict(dataset="chains", schemes="postln,deepnorm,deeploop,preln", loops="2"),
}
DATA_SHAPES = {"builtin_bytes": (64, 8), "chains": (16, 64)}  # (block_size, batch_size)
CHAINS = dict(n_values=8, max_hops=6)  # config/depth_cpu.py's task
BACKBONES = {"gpt2": {}, "paper": dict(norm="rmsnorm", position_encoding="rope", norm_branch_input=True)}
OPTIMIZERS = ("sgd", "adamw")
MOVING = {"matrices": "the blocks' matrices", "blocks": "the blocks", "all": "the whole model"}


def listed(text, kind, name, choices=None):
    """A comma-separated setting as a list of kind (int, float, str); raises ValueError naming the setting."""
    try:
        values = [kind(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or (choices and not set(values) <= set(choices)):
        what = f"one or more of {', '.join(choices)}" if choices else f"{kind.__name__}s"
        raise ValueError(f"{name} must be {what}, comma-separated, got {text!r}")
    return values


def make_config(scheme, n_loop, vocab_size, block_size, n_layer=2, n_head=4, n_embd=64, backbone="gpt2"):
    """The GPTConfig (dropout 0) of a scheme: postln, preln, deeploop, deepnorm, or deeploop:p (exponent p)."""
    residual, _, p = scheme.partition(":")
    if residual not in ("postln", "preln", "deeploop", "deepnorm") or (p and residual != "deeploop"):
        raise ValueError(f"unknown scheme {scheme!r}: use postln, preln, deeploop, deepnorm or deeploop:p (exponent p;"
                         f" preln_scaled has no untied control that computes its function)")
    try:
        exponent = float(p or 0)
    except ValueError:
        raise ValueError(f"scheme {scheme!r}: the exponent after ':' must be a number, like deeploop:0.25") from None
    if backbone not in BACKBONES:
        raise ValueError(f"unknown backbone {backbone!r}; choose one of {', '.join(BACKBONES)}")
    return GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_loop=n_loop, n_head=n_head,
                     n_embd=n_embd, dropout=0.0, residual=residual, residual_exponent=exponent, **BACKBONES[backbone])


def untied_config(config):
    """The untied control's config: n_layer * n_loop blocks run once (the same unrolled depth, alpha and beta)."""
    if config.n_prelude or config.n_coda or config.loop_input != "none" or config.coefficient_loops or \
            config.residual == "preln_scaled":
        raise ValueError("the untied control needs the whole stack looped: no prelude, coda or loop_input, "
                         "coefficient_loops 0, and not preln_scaled (its epsilon depends on R apart from N)")
    return dataclasses.replace(config, n_layer=config.n_layer * config.n_loop, n_loop=1)


def untied_copy(tied):
    """The untied control as a copy of a looped GPT: block i is looped block i % n_layer, every other parameter the
    same; at init it computes the looped model's function."""
    L, R = tied.config.n_layer, tied.config.n_loop
    untied = GPT(untied_config(tied.config)).to(tied.lm_head.weight)
    state = {}
    for name, value in tied.state_dict().items():
        _, core, rest = name.partition("transformer.h.")
        block, _, leaf = rest.partition(".")
        state.update({f"transformer.h.{r * L + int(block)}.{leaf}": value for r in range(R)} if core else
                     {name: value})
    untied.load_state_dict(state)
    return untied


def core_blocks(model):
    """The physical blocks of the looped core, in order."""
    return model.transformer.h


def outputs(model, idx, params=None):
    """(logits, stream) of the model on idx, with its own parameters or functional_call's params; the stream is what
    the last visit of the last core block leaves (in Post-LN the normalized stream that the output layer reads)."""
    streams = []
    hook = core_blocks(model)[-1].register_forward_hook(lambda module, args, out: streams.append(out))
    try:
        logits = model(idx)[0] if params is None else functional_call(model, params, (idx,))[0]
    finally:
        hook.remove()
    return logits, streams[-1]


def rms(t):
    return t.pow(2).mean().sqrt().item()


def visit_kappa(untied, n_layer, idx, targets):
    """(kappa_R of each looped block, kappa_R of all blocks pooled) from an untied copy's gradients on (idx, targets):
    its block r * L + b gets exactly visit r's share of looped block b's gradient. The pooled value is how much more a
    looped SGD step than an untied one lowers the loss, to first order."""
    blocks = core_blocks(untied)
    params = [list(block.parameters()) for block in blocks]
    grads = torch.autograd.grad(untied(idx, targets)[1], [p for ps in params for p in ps])
    flat, i = [], 0
    for ps in params:
        flat.append(torch.cat([g.flatten() for g in grads[i:i + len(ps)]]).double())
        i += len(ps)
    R = len(blocks) // n_layer
    summed = [sum(flat[r * n_layer + b] for r in range(R)).pow(2).sum() for b in range(n_layer)]
    separate = [sum(flat[r * n_layer + b].pow(2).sum() for r in range(R)) for b in range(n_layer)]
    return [(s / q).item() for s, q in zip(summed, separate)], (sum(summed) / sum(separate)).item()


def moving_parameters(model, moving):
    """{name: parameter} that a step moves: the core blocks' matrices (what alpha and beta scale), the core's blocks
    (with their norms' gains and the biases), or every parameter."""
    if moving not in MOVING:
        raise ValueError(f"unknown moving {moving!r}; choose one of {', '.join(MOVING)}")
    core = {id(p) for p in core_blocks(model).parameters() if moving == "blocks" or p.dim() >= 2}
    return {name: p for name, p in model.named_parameters() if moving == "all" or id(p) in core}


def make_optimizer(model, params, optimizer, lr, weight_decay=0.1, betas=(0.9, 0.95)):
    """Plain SGD, or AdamW as train.py builds it (GPT.configure_optimizers: weight decay on matrices only), over the
    parameters params (a dict) alone."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if not lr > 0:
        raise ValueError(f"learning rates must be > 0, got {lr}")
    if optimizer == "sgd":
        return torch.optim.SGD(list(params.values()), lr=lr)
    chosen = {id(p) for p in params.values()}
    for p in model.parameters():
        p.requires_grad_(id(p) in chosen)  # configure_optimizers takes the parameters that require a gradient
    adamw = model.configure_optimizers(weight_decay, lr, betas, model.lm_head.weight.device.type)
    for p in model.parameters():
        p.requires_grad_(True)
    return adamw


def step_change(model, idx, targets, optimizer="sgd", lr=0.1, moving="blocks", weight_decay=0.1, betas=(0.9, 0.95),
                grad_clip=1.0):
    """One optimizer step on (idx, targets) from the model's parameters -> the change it makes on idx, a dict of RMS
    values: logits, stream (the last block's), their first-order predictions along the step (logits_lin, stream_lin),
    the real change minus the prediction (logits_miss, stream_miss), the step over the moved parameters (step), and
    the loss before and after (loss, loss_after) and its first-order change (loss_lin). AdamW clips the gradient norm
    to grad_clip first (0: no clipping) as train.py does; SGD never. The model is left as it was."""
    params = moving_parameters(model, moving)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = make_optimizer(model, params, optimizer, lr, weight_decay, betas)
    with torch.no_grad():
        logits0, stream0 = outputs(model, idx)
    model.zero_grad(set_to_none=True)
    loss = model(idx, targets)[1]
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in params.items()}
    if optimizer == "adamw" and grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(list(params.values()), grad_clip)
    opt.step()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits1, stream1 = outputs(model, idx)
        loss_after = model(idx, targets)[1].item()
        delta = {name: p.detach() - start[name] for name, p in params.items()}
        tangents = {name: delta[name] if name in delta else torch.zeros_like(p) for name, p in start.items()}
        # forward-mode AD has no rule for the fused CPU attention kernels; the math kernel computes the same function
        with sdpa_kernel(SDPBackend.MATH):
            _, (logits_lin, stream_lin) = jvp(lambda p: outputs(model, idx, p), (start,), (tangents,))
        for name, p in model.named_parameters():
            p.copy_(start[name])
    return dict(logits=rms(logits1 - logits0), stream=rms(stream1 - stream0), logits_lin=rms(logits_lin),
                stream_lin=rms(stream_lin), logits_miss=rms(logits1 - logits0 - logits_lin),
                stream_miss=rms(stream1 - stream0 - stream_lin),
                step=rms(torch.cat([d.flatten() for d in delta.values()])), loss=loss.item(), loss_after=loss_after,
                loss_lin=sum((grads[name] * d).sum() for name, d in delta.items()).item())


def get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """train.py's schedule: linear warmup, cosine decay to min_lr at lr_decay_iters, constant after."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    progress = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (learning_rate - min_lr)


def train_updates(model, train_batch, fixed, max_iters, schedule, weight_decay=0.1, betas=(0.9, 0.95), grad_clip=1.0,
                  kappa_interval=10):
    """Train the model as train.py does (its AdamW and clipping, lr get_lr(it, **schedule)) on train_batch(it) ->
    (x, y), and record each step: lr, the training loss, the gradient norm before clipping, the RMS of the step over
    the core's parameters (step), and on the fixed batch (x, y) the loss after the step and the RMS change of the
    logits and of the last block's stream that the step made; every kappa_interval steps (0: never) kappa_R (mean
    over blocks) and the token probe after the last visit, before the step."""
    optimizer = model.configure_optimizers(weight_decay, schedule["learning_rate"], betas,
                                           model.lm_head.weight.device.type)
    core = list(core_blocks(model).parameters())
    with torch.no_grad():
        before = outputs(model, fixed[0])
    records = []
    for it in range(max_iters):
        lr = get_lr(it, **schedule)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = train_batch(it)
        record = dict(iter=it, lr=lr)
        if kappa_interval and it % kappa_interval == 0:
            diagnostics = loop_diagnostics(model, x, y)
            record.update(kappa=sum(diagnostics["kappa"]) / len(diagnostics["kappa"]),
                          token_probe=diagnostics["token_probe"][-1])
        start = [p.detach().clone() for p in core]
        loss = model(x, y)[1]
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            after = outputs(model, fixed[0])
            record.update(loss=loss.item(), grad_norm=grad_norm.item(), fixed_loss=model(*fixed)[1].item(),
                          step=rms(torch.cat([(p - s).flatten() for p, s in zip(core, start)])),
                          logits=rms(after[0] - before[0]), stream=rms(after[1] - before[1]))
        records.append(record)
        before = after
    return records


def make_data(dataset, block_size, split, seed):
    """(batch, vocab_size) of a dataset: batch(index, batch_size) -> (x, y), a function of (seed, split, index)."""
    if dataset == "chains":
        task = PointerChains(CHAINS["n_values"], CHAINS["max_hops"], block_size, seed, split)
        return task.batch, task.vocab_size
    if dataset != "builtin_bytes":
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATA_SHAPES)}")
    data_dir = prepare_builtin_if_missing(dataset)
    return TokenWindows(data_dir, split, block_size, seed).batch, load_meta(data_dir)["vocab_size"]


def mean_sd(values):
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def slope(xs, ys):
    """The least-squares exponent a of y ~ x^a."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-300)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


# ---------------------------------------------------------------------------------------------------------------------
# the script's two modes: measurements, tables, figures

def measure_steps(S):
    """mode=step: a record per (scheme, R, seed, optimizer, lr, moving)."""
    batch, vocab = make_data(S["dataset"], S["block_size"], "train", EVAL_SEED)
    vocab = -(-vocab // 64) * 64  # padded as train.py pads it
    records = []
    for scheme in S["schemes"]:
        for R in S["loops"]:
            for seed in S["seeds"]:
                x, y = batch(seed, S["batch_size"])
                torch.manual_seed(seed)
                config = make_config(scheme, R, vocab, S["block_size"], S["n_layer"], S["n_head"], S["n_embd"],
                                     S["backbone"])
                tied = GPT(config).to(getattr(torch, S["dtype"]))
                copy = untied_copy(tied)
                kappa, pooled = visit_kappa(copy, S["n_layer"], x, y)
                if S["control"] == "fresh":
                    torch.manual_seed(seed + 1)  # another draw than the looped model's
                    copy = GPT(untied_config(config)).to(getattr(torch, S["dtype"]))
                for optimizer in S["optimizers"]:
                    for lr in S[f"{optimizer}_lrs"]:
                        for moving in S["moving"]:
                            records.append(dict(scheme=scheme, R=R, seed=seed, optimizer=optimizer, lr=lr,
                                                moving=moving, kappa=kappa, kappa_pooled=pooled, **{
                                name: step_change(model, x, y, optimizer, lr, moving, S["weight_decay"],
                                                  (S["beta1"], S["beta2"]), S["grad_clip"])
                                for name, model in (("looped", tied), ("untied", copy))}))
                print(f"  {scheme} R={R} seed {seed}: kappa_R {sum(kappa) / len(kappa):.2f}", file=sys.stderr)
    return records


def step_tables(records, S):
    """Markdown: per optimizer, lr and moving, a block of rows per scheme with R across, and the exponent of the
    change against R (y ~ R^a: 0 is flat)."""
    R_values, lines = S["loops"], []
    rows = (("kappa_R", lambda r: sum(r["kappa"]) / len(r["kappa"]), "{:.2f}"),
            ("logits, looped", lambda r: r["looped"]["logits"], "{:.3g}"),
            ("logits, untied", lambda r: r["untied"]["logits"], "{:.3g}"),
            ("ratio, logits", lambda r: r["looped"]["logits"] / r["untied"]["logits"], "{:.2f} ± {:.2f}"),
            ("ratio, stream", lambda r: r["looped"]["stream"] / r["untied"]["stream"], "{:.2f} ± {:.2f}"),
            ("miss of linear, looped", lambda r: r["looped"]["logits_miss"] / r["looped"]["logits"], "{:.2f}"),
            ("miss of linear, untied", lambda r: r["untied"]["logits_miss"] / r["untied"]["logits"], "{:.2f}"))
    for optimizer, lr, moving in dict.fromkeys((r["optimizer"], r["lr"], r["moving"]) for r in records):
        lines += [f"\n**{optimizer} lr {lr:g}, {MOVING[moving]} moving** (mean over {len(S['seeds'])} seeds; ratio: "
                  f"looped / untied, mean ± sd; miss: RMS of the real change minus the linear one, over the real)\n",
                  "| scheme | | " + " | ".join(f"R = {R}" for R in R_values) + " | exponent in R |",
                  "|---|---|" + "---|" * (len(R_values) + 1)]
        for scheme in S["schemes"]:
            cells = [[r for r in records if (r["optimizer"], r["lr"], r["moving"], r["scheme"], r["R"]) ==
                      (optimizer, lr, moving, scheme, R)] for R in R_values]
            for i, (name, value, form) in enumerate(rows):
                figures = [mean_sd([value(r) for r in cell]) for cell in cells]
                exponent = f"{slope(R_values, [m for m, _ in figures]):.2f}" \
                    if name.startswith("logits") and len(R_values) > 1 else ""
                lines.append(f"| {scheme if i == 0 else ''} | {name} | " + " | ".join(
                    form.format(*f[:form.count('{')]) for f in figures) + f" | {exponent} |")
    return "\n".join(lines)


def train_runs(S):
    """mode=train: a run per (scheme, R, warmup, model, seed), with its records."""
    fixed_batch, vocab = make_data(S["dataset"], S["block_size"], "val", EVAL_SEED)
    fixed = fixed_batch(0, S["batch_size"])
    vocab = -(-vocab // 64) * 64
    runs = []
    for scheme in S["schemes"]:
        for R in S["loops"]:
            for warmup in S["warmups"]:
                for which in S["models"]:
                    for seed in S["seeds"]:
                        batch, _ = make_data(S["dataset"], S["block_size"], "train", seed)
                        config = make_config(scheme, R, vocab, S["block_size"], S["n_layer"], S["n_head"],
                                             S["n_embd"], S["backbone"])
                        torch.manual_seed(seed)  # as train.py: this draw is the init
                        model = GPT(config if which == "tied" else untied_config(config))
                        schedule = dict(learning_rate=S["learning_rate"], warmup_iters=warmup,
                                        lr_decay_iters=S["lr_decay_iters"], min_lr=S["min_lr"])
                        records = train_updates(model, lambda it: batch(it, S["batch_size"]), fixed, S["max_iters"],
                                                schedule, S["weight_decay"], (S["beta1"], S["beta2"]), S["grad_clip"],
                                                S["kappa_interval"])
                        print(f"  {scheme} R={R} warmup {warmup} {which} seed {seed}: fixed-batch loss "
                              f"{records[-1]['fixed_loss']:.3f} after {len(records)} steps", file=sys.stderr)
                        runs.append(dict(scheme=scheme, R=R, warmup=warmup, model=which, seed=seed, records=records))
    return runs


def run_key(run):
    return run["scheme"], run["R"], run["warmup"], run["model"]


def train_table(runs, S):
    """Markdown: per (scheme, R, warmup, model), means over seeds: the per-step change of the logits over windows of
    steps, each seed's peak (and its step), the fixed batch's loss at the end and how many seeds sit on the task's
    plateau (ln n_values: the same answer at every cell), kappa_R at the last record (looped models only: an untied
    one has no visits to align)."""
    edges = [e for e in (0, 10, 50, 100, 200, 300, 500, 1000) if e < S["max_iters"]] + [S["max_iters"]]
    windows = list(zip(edges[:-1], edges[1:]))
    plateau = math.log(CHAINS["n_values"]) if S["dataset"] == "chains" else None
    lines = ["| scheme | R | warmup | model | " + " | ".join(f"steps {a}-{b - 1}" for a, b in windows) +
             " | peak (step), by seed | loss at the end | on the plateau | kappa_R at the end |",
             "|---|---|---|---|" + "---|" * (len(windows) + 4)]
    for key in dict.fromkeys(map(run_key, runs)):
        group = [run["records"] for run in runs if run_key(run) == key]
        means = [mean_sd([sum(x["logits"] for x in recs[a:b]) / (b - a) for recs in group])[0] for a, b in windows]
        peaks = " ".join("{logits:.2g} ({iter})".format(**max(recs, key=lambda x: x["logits"])) for recs in group)
        end = mean_sd([recs[-1]["fixed_loss"] for recs in group])
        stuck = f"{sum(abs(recs[-1]['fixed_loss'] - plateau) < 0.02 for recs in group)} of {len(group)}" \
            if plateau else "—"
        kappas = [[x["kappa"] for x in recs if "kappa" in x] for recs in group]
        kappa = f"{mean_sd([k[-1] for k in kappas])[0]:.2f}" if all(kappas) and key[3] == "tied" else "—"
        lines.append(f"| {' | '.join(map(str, key))} | " + " | ".join(f"{m:.3g}" for m in means) +
                     f" | {peaks} | {end[0]:.3f} ± {end[1]:.3f} | {stuck} | {kappa} |")
    return "\n".join(lines)


def plot_steps(records, S, path):
    """A panel per (moving, optimizer and lr): the RMS change of the logits against R, looped (solid) and untied
    (dashed), a line per scheme; on log axes the gap between the two is the looped / untied ratio."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = list(dict.fromkeys((r["optimizer"], r["lr"]) for r in records))
    movings = list(dict.fromkeys(r["moving"] for r in records))
    fig, axes = plt.subplots(len(movings), len(runs), figsize=(6 * len(runs), 4.2 * len(movings)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, moving in zip(axes, movings):
        for ax, (optimizer, lr) in zip(row, runs):
            for color, scheme in zip(colors, S["schemes"]):
                cells = [[r for r in records if (r["optimizer"], r["lr"], r["moving"], r["scheme"], r["R"]) ==
                          (optimizer, lr, moving, scheme, R)] for R in S["loops"]]
                for which, style in (("looped", "o-"), ("untied", "s--")):
                    ax.plot(S["loops"], [mean_sd([r[which]["logits"] for r in cell])[0] for cell in cells], style,
                            color=color, alpha=1 if which == "looped" else 0.5, label=f"{scheme}, {which}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(f"R (the untied control: {S['n_layer']}R blocks run once)")
            ax.set_ylabel("RMS change of the logits in one step")
            ax.set_title(f"{optimizer} lr {lr:g}, {MOVING[moving]} moving", fontsize=10)
            ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def plot_train(runs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 9), sharex=True)
    keys = list(dict.fromkeys(map(run_key, runs)))
    for color, key in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"] * len(keys), keys):
        for i, run in enumerate(run for run in runs if run_key(run) == key):
            steps = [x["iter"] for x in run["records"]]
            label = f"{key[0]} R={key[1]} warmup {key[2]}{' untied' if key[3] == 'untied' else ''}" if i == 0 else None
            top.plot(steps, [x["logits"] for x in run["records"]], color=color, lw=0.7, alpha=0.8, label=label)
            bottom.plot(steps, [x["fixed_loss"] for x in run["records"]], color=color, lw=0.7, alpha=0.8)
    top.set_yscale("log")
    top.set_ylabel("RMS change of the logits in one step (fixed val batch)")
    bottom.set_ylabel("loss on the fixed val batch")
    bottom.set_xlabel("step")
    top.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def script_settings():
    """The script's settings, checked and parsed -> dict; raises ValueError naming the bad one."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    S = dict(mode=mode, dataset=dataset or MODES[mode]["dataset"], backbone=backbone, n_layer=n_layer, n_head=n_head,
             n_embd=n_embd, control=control, dtype=dtype, weight_decay=weight_decay, beta1=beta1, beta2=beta2,
             grad_clip=grad_clip, learning_rate=learning_rate, min_lr=min_lr, lr_decay_iters=lr_decay_iters,
             max_iters=max_iters, kappa_interval=kappa_interval)
    if S["dataset"] not in DATA_SHAPES:
        raise ValueError(f"unknown dataset {S['dataset']!r}; choose one of {', '.join(DATA_SHAPES)}")
    S["block_size"] = block_size or DATA_SHAPES[S["dataset"]][0]
    S["batch_size"] = batch_size or DATA_SHAPES[S["dataset"]][1]
    S.update(schemes=listed(schemes or MODES[mode]["schemes"], str, "schemes"),
             loops=listed(loops or MODES[mode]["loops"], int, "loops"), seeds=listed(seeds, int, "seeds"),
             optimizers=listed(optimizers, str, "optimizers", OPTIMIZERS), sgd_lrs=listed(sgd_lrs, float, "sgd_lrs"),
             adamw_lrs=listed(adamw_lrs, float, "adamw_lrs"), moving=listed(moving, str, "moving", MOVING),
             warmups=listed(warmups, int, "warmups"), models=listed(models, str, "models", ("tied", "untied")))
    if control not in ("copy", "fresh"):
        raise ValueError(f"control must be copy or fresh, got {control!r}")
    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be float64 or float32, got {dtype!r}")
    if min(S["loops"]) < 1 or min(S["seeds"]) < 0 or min(S["warmups"]) < 0:
        raise ValueError(f"loops must be >= 1, seeds and warmups >= 0, got loops={S['loops']} seeds={S['seeds']} "
                         f"warmups={S['warmups']}")
    if min(S["sgd_lrs"] + S["adamw_lrs"] + [learning_rate]) <= 0 or min_lr < 0:
        raise ValueError("learning rates must be > 0 (sgd_lrs, adamw_lrs, learning_rate), min_lr >= 0")
    if min(n_layer, n_head, n_embd, S["block_size"], S["batch_size"], max_iters) < 1 or \
            min(kappa_interval, grad_clip, weight_decay) < 0:
        raise ValueError("n_layer, n_head, n_embd, block_size, batch_size and max_iters must be >= 1, "
                         "kappa_interval, grad_clip and weight_decay >= 0")
    for scheme in S["schemes"]:  # every model of the grid, before the work: a bad one stops here, not midway
        for R in S["loops"]:
            untied_config(make_config(scheme, R, 64, S["block_size"], n_layer, n_head, n_embd, backbone))
    for path in (json_out, png):
        if path and os.path.exists(path):
            raise ValueError(f"{path} exists; delete it or choose another path")
    return S


if __name__ == "__main__":
    configure(globals(), sys.argv[1:])
    if png:
        require("matplotlib")
    try:
        S = script_settings()
        if mode == "step":
            records = measure_steps(S)
            print(step_tables(records, S))
        else:
            torch.set_flush_denormal(True)  # as train.py does on a CPU (denormals: deep Post-LN's slow early steps)
            records = train_runs(S)
            print(train_table(records, S))
    except ValueError as e:
        die(str(e))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(dict(settings=S, records=records), f)
    if png:
        plot_steps(records, S, png) if mode == "step" else plot_train(records, png)
        print(f"wrote {png}")
