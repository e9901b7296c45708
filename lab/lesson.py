"""
The checks of docs/deeploop.md: each step of the argument for DeepLoop's exponent, computed in float64 on a model
small enough to take a few seconds on a laptop's CPU. The lesson shows what each prints.

    python -m lab.lesson --check=coefficients   # alpha, beta and the bound's factors N (beta/alpha)^2 and R times it
    python -m lab.lesson --check=expand         # a block visited twice: one SGD step's four terms, against autograd
    python -m lab.lesson --check=kappa          # kappa_R from the visits' own gradients
    python -m lab.lesson --check=step           # one SGD and one AdamW step, looped against untied, R = 1, 2, 4
    python -m lab.lesson --check=norm           # Norm(alpha x + f) = Norm(x + f / alpha) with eps / alpha^2

The models are config/depth_cpu.py's task at width 32 (lab.model_update's make_config, untied_copy, step_change and
visit_kappa measure them), so nothing is downloaded or prepared.
"""

import copy
import itertools
import sys

import torch
from torch.func import jvp
from torch.nn.attention import SDPBackend, sdpa_kernel

from configurator import configure, die
from dataset import EVAL_SEED
from lab.model_update import (listed, make_config, make_data, outputs, rms, slope, step_change, train_updates,
                              untied_copy, visit_kappa)
from lab.probes import visit_diagnostics
from model import GPT, GPTConfig, make_norm, residual_coefficients

# ---------------------------------------------------------------------------------------------------------------------
check = "step"           # coefficients | expand | kappa | step | norm
n_layer = 2              # physical blocks L (expand takes one: a single block visited twice)
loops = "1,2,4"          # the loop counts R of coefficients, kappa and step
exponents = "0.25,0.5"   # coefficients and step: the p of alpha = (2N)^p, beta = (8N)^-p of each row
residual = "deeploop"    # kappa: the scheme whose visits are measured (deeploop, deepnorm, postln, preln)
steps = 0                # kappa: then train the last R's model this many steps, kappa_R every 10
same_eps = False         # norm: keep the norm's eps on the right side too, and see what that costs
seed = 0                 # the init and the batch
# ---------------------------------------------------------------------------------------------------------------------

CHECKS = ("coefficients", "expand", "kappa", "step", "norm")
WIDTH = dict(n_head=2, n_embd=32)
CELLS, ROWS = 16, 16  # the task's block_size and the batch's rows
SGD_LR, ADAMW_LR = 0.1, 3e-3  # lab.model_update's: one plain SGD step, and train.py's rate
SCHEDULE = dict(learning_rate=3e-3, warmup_iters=100, lr_decay_iters=1500, min_lr=3e-4)  # config/depth_cpu.py's


def task_model(scheme, R, L):
    """(the looped model in float64, a batch (x, y) of the depth task) for a scheme of lab.model_update."""
    batch, vocab = make_data("chains", CELLS, "train", EVAL_SEED)
    torch.manual_seed(seed)
    return GPT(make_config(scheme, R, vocab, CELLS, L, **WIDTH)).double(), batch(seed, ROWS)


def beta_over_alpha(N, p):
    alpha, beta = residual_coefficients("deeploop", N, p)
    return beta / alpha


def check_coefficients(L, R_values, ps):
    """alpha and beta of each (p, R) from model.residual_coefficients, and the bound's factors: N (beta/alpha)^2, the
    untied stack's, and R N (beta/alpha)^2, the looped one's with aligned visits."""
    print(f"L = {L} physical blocks run R times: N = {L}R; beta / alpha = (4N)^(-2p)")
    print("   p   R   N    alpha     beta  beta/alpha  N (beta/alpha)^2  R N (beta/alpha)^2")
    for p in ps:
        for R in R_values:
            N = GPTConfig(n_layer=L, n_loop=R).unrolled_depth
            alpha, beta = residual_coefficients("deeploop", N, p)
            bound = N * (beta / alpha) ** 2
            print(f"{p:4.2f} {R:3d} {N:3d} {alpha:8.4f} {beta:8.4f} {beta / alpha:11.4f} {bound:17.4f} "
                  f"{R * bound:19.4f}")


def block_jvp(model, idx, tangents):
    """The first-order change of model's logits on idx along tangents {parameter name: direction}, zero elsewhere."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    directions = {name: tangents.get(name, torch.zeros_like(p)) for name, p in params.items()}
    # forward-mode AD has no rule for the fused CPU attention kernels; the math kernel computes the same function
    with sdpa_kernel(SDPBackend.MATH):
        return jvp(lambda q: outputs(model, idx, q)[0], (params,), (directions,))[1]


def block_gradient(model, x, y, b):
    """{name within the block: gradient} of core block b of model on (x, y)."""
    names, params = zip(*model.transformer.h[b].named_parameters())
    return dict(zip(names, torch.autograd.grad(model(x, y)[1], params)))


def on_block(b, leaves):
    """{name within a block: tensor} -> {the model's name for core block b's parameter: tensor}."""
    return {f"transformer.h.{b}.{name}": t for name, t in leaves.items()}


def relative(a, b):
    """max |a - b| over max |b|."""
    return ((a - b).abs().max() / b.abs().max()).item()


def check_expand():
    """One block visited twice: the four terms J_r g_s of an SGD step's first-order change of the logits, their sums
    against autograd's change of the looped model and of its untied copy."""
    tied, (x, y) = task_model("deeploop", 2, 1)
    untied = untied_copy(tied)  # its block r - 1 is visit r of the looped block, with the same parameters
    g = {r: block_gradient(untied, x, y, r - 1) for r in (1, 2)}  # g_r: what visit r gives the block's parameters
    summed = {name: g[1][name] + g[2][name] for name in g[1]}
    looped_grad = block_gradient(tied, x, y, 0)
    print(f"one block visited R = 2 times (deeploop, N = 2: alpha = {tied.alpha:.4f}, beta = {tied.beta:.4f}); "
          f"an SGD step of rate 1")
    print(f"  looped gradient against g_1 + g_2, relative difference: "
          f"{max(relative(looped_grad[k], summed[k]) for k in summed):.0e}")
    # J_r d: how the logits change to first order when visit r alone reads the parameter change d
    terms = {(r, s): block_jvp(untied, x, on_block(r - 1, g[s])) for r in (1, 2) for s in (1, 2)}
    for (r, s), term in terms.items():
        print(f"  J_{r} g_{s}  RMS {rms(term):.4e}" + ("  (untied: each visit reads its own gradient)" if r == s
                                                       else f"  (looped only: visit {r} reads visit {s}'s)"))
    looped = block_jvp(tied, x, on_block(0, {k: -v for k, v in summed.items()}))
    untied_change = block_jvp(untied, x, {**on_block(0, {k: -v for k, v in g[1].items()}),
                                          **on_block(1, {k: -v for k, v in g[2].items()})})
    four, two = -sum(terms.values()), -(terms[1, 1] + terms[2, 2])
    print(f"  looped change (autograd)  RMS {rms(looped):.4e}, against -(the four terms): {relative(four, looped):.0e}")
    print(f"  untied change (autograd)  RMS {rms(untied_change):.4e}, against -(J_1 g_1 + J_2 g_2): "
          f"{relative(two, untied_change):.0e}")
    print(f"  looped / untied: {rms(looped) / rms(untied_change):.4f};  kappa_2 of (g_1, g_2): "
          f"{visit_kappa(untied, 1, x, y)[1]:.4f}")


def check_kappa(R_values):
    """kappa_R of each block at init, from the untied copy's blocks and from lab.probes; with steps, over training."""
    print(f"{residual}, L = {n_layer}: kappa_R = ||sum_r g_r||^2 / sum_r ||g_r||^2 of each block, from its visits' "
          f"gradients")
    print("   R  kappa_R (untied copy)  kappa_R (lab.probes)  ||g_r|| of block 1, r = 1..R")
    for R in R_values:
        tied, (x, y) = task_model(residual, R, n_layer)
        kappa = visit_kappa(untied_copy(tied), n_layer, x, y)[0]
        diagnostics = visit_diagnostics(tied, x, y)
        print(f"{R:4d}  {' '.join(f'{k:.4f}' for k in kappa):>21}  "
              f"{' '.join(f'{k:.4f}' for k in diagnostics['kappa']):>20}  "
              f"{' '.join(f'{n:.3e}' for n in diagnostics['grad_norm'][0])}")
    if steps:
        R = R_values[-1]
        tied, fixed = task_model(residual, R, n_layer)
        batch, _ = make_data("chains", CELLS, "train", seed)
        records = train_updates(tied, lambda it: batch(it, ROWS), fixed, steps, SCHEDULE, kappa_interval=10)
        print(f"trained as train.py trains config/depth_cpu.py (AdamW, warming up to lr 3e-3 over 100 steps), "
              f"R = {R}:")
        print("  step  kappa_R (block mean)   loss")
        for record in records:
            if "kappa" in record:
                print(f"{record['iter']:6d}  {record['kappa']:20.4f} {record['loss']:7.3f}")


def check_step(R_values, ps):
    """One SGD and one AdamW step of the blocks' matrices, looped against untied: the changes, their ratio, the first-
    order change of the loss's ratio, and the exponents in R beside the bound's."""
    print(f"one step from init, L = {n_layer}, the blocks' matrices moving (what alpha and beta scale): the RMS change "
          f"of the logits")
    at_1 = {}
    for p in ps:
        print(f"p = {p:<8g}               SGD, lr {SGD_LR:g}                          AdamW, lr {ADAMW_LR:g}")
        print("   R  kappa_R     looped     untied  ratio  dL ratio      looped     untied  ratio     step")
        rows = []
        for R in R_values:
            tied, (x, y) = task_model(f"deeploop:{p}", R, n_layer)
            untied = untied_copy(tied)
            kappa = visit_kappa(untied, n_layer, x, y)[1]
            sgd = [step_change(m, x, y, "sgd", SGD_LR, "matrices") for m in (tied, untied)]
            adamw = [step_change(m, x, y, "adamw", ADAMW_LR, "matrices") for m in (tied, untied)]
            rows.append((R, sgd, adamw))
            print(f"{R:4d}  {kappa:7.4f}  {sgd[0]['logits']:9.3e}  {sgd[1]['logits']:9.3e}  "
                  f"{sgd[0]['logits'] / sgd[1]['logits']:5.3f}  {sgd[0]['loss_lin'] / sgd[1]['loss_lin']:8.4f}   "
                  f"{adamw[0]['logits']:9.3e}  {adamw[1]['logits']:9.3e}  "
                  f"{adamw[0]['logits'] / adamw[1]['logits']:5.3f}  {adamw[0]['step']:7.1e}")
        if len(rows) > 1:
            fit = lambda run, i: slope(R_values, [r[run][i]["logits"] for r in rows])  # noqa: E731
            print(f"  exponent in R, SGD:   looped {fit(1, 0):.2f} (2 - 4p = {2 - 4 * p:.2f}), untied {fit(1, 1):.2f} "
                  f"(1 - 4p = {1 - 4 * p:.2f})")
            print(f"  exponent in R, AdamW: looped {fit(2, 0):.2f}, untied {fit(2, 1):.2f} (1 - 2p = {1 - 2 * p:.2f})")
        at_1[p] = rows[0]
    if len(ps) > 1 and R_values[0] == 1:
        (p, a), (q, b) = list(at_1.items())[:2]
        ratio = beta_over_alpha(n_layer, q) / beta_over_alpha(n_layer, p)
        print(f"R = 1, p = {q:g} against p = {p:g}: beta/alpha {ratio:.4f} times, (beta/alpha)^2 "
              f"{ratio ** 2:.4f} times;")
        print(f"  the change with SGD {b[1][0]['logits'] / a[1][0]['logits']:.4f} times, with AdamW "
              f"{b[2][0]['logits'] / a[2][0]['logits']:.4f} times")


def check_norm(R_values):
    """Norm(alpha x + f) against Norm(x + f / alpha) with eps / alpha^2 (or the same eps), LayerNorm and RMSNorm, on
    tensors and on a block of the model against its twin with alpha = 1."""
    torch.manual_seed(seed)
    C = WIDTH["n_embd"]
    z = torch.randn(ROWS, CELLS, C, dtype=torch.float64)
    z = z - z.mean(-1, keepdim=True)
    x = z / z.pow(2).mean(-1, keepdim=True).sqrt()  # a normalized stream: mean 0, mean square 1 at every position
    f = 0.1 * torch.randn(ROWS, CELLS, C, dtype=torch.float64)  # a branch's output
    idx = torch.randint(0, 64, (ROWS, CELLS), generator=torch.Generator().manual_seed(seed))
    print(f"deeploop, L = {n_layer}; Norm with random gains and eps 1e-5; on the right "
          f"{'the same eps' if same_eps else 'eps / alpha^2'}. Max |left - right| over max |left|:")
    print("   norm        R   N    alpha   Norm(alpha x + f) : Norm(x + f / alpha)   Block : its twin")
    for norm in ("layernorm", "rmsnorm"):
        for R in R_values:
            config = GPTConfig(n_layer=n_layer, n_loop=R, block_size=CELLS, vocab_size=64, norm=norm, **WIDTH)
            alpha = config.coefficients()[0]
            left = make_norm(config).double()
            with torch.no_grad():
                left.weight.normal_(1.0, 0.2)
            right = copy.deepcopy(left)
            right.eps = left.eps if same_eps else left.eps / alpha ** 2
            a, b = left(alpha * x + f), right(x + f / alpha)
            # a block of the model, and its twin: alpha = 1, both branches' output projections divided by alpha, the
            # norms' eps by alpha^2
            model = GPT(config).double()
            block = model.transformer.h[0]
            twin = copy.deepcopy(block)
            twin.alpha = 1.0
            with torch.no_grad():
                for linear in (twin.attn.c_proj, twin.mlp.c_proj):
                    linear.weight /= alpha
                    linear.bias /= alpha
            for norm_layer in (twin.ln_1, twin.ln_2):
                norm_layer.eps = norm_layer.eps if same_eps else norm_layer.eps / alpha ** 2
            with torch.no_grad():
                stream = model.embed(idx, 0, itertools.repeat(None))
                c, d = block(stream), twin(stream)
            print(f"   {norm:9s} {R:3d} {config.unrolled_depth:3d} {alpha:8.4f} {relative(b, a):20.1e} "
                  f"{relative(d, c):28.1e}")


def settings():
    """(R values, exponents), checked; raises ValueError naming the bad setting."""
    if check not in CHECKS:
        raise ValueError(f"unknown check {check!r}; choose one of {', '.join(CHECKS)}")
    R_values, ps = listed(loops, int, "loops"), listed(exponents, float, "exponents")
    if min(R_values) < 1 or n_layer < 1 or min(ps) <= 0 or steps < 0:
        raise ValueError(f"loops and n_layer must be >= 1, exponents > 0 and steps >= 0, got loops={loops} "
                         f"n_layer={n_layer} exponents={exponents} steps={steps}")
    if residual not in ("deeploop", "deepnorm", "postln", "preln"):
        raise ValueError(f"residual must be deeploop, deepnorm, postln or preln (those with an untied copy), got "
                         f"{residual!r}")
    return R_values, ps


if __name__ == "__main__":
    configure(globals(), sys.argv[1:])
    try:
        R_values, ps = settings()
    except ValueError as e:
        die(str(e))
    if check == "coefficients":
        check_coefficients(n_layer, R_values, ps)
    elif check == "expand":
        check_expand()
    elif check == "kappa":
        check_kappa(R_values)
    elif check == "step":
        check_step(R_values, ps)
    else:
        check_norm(R_values)
