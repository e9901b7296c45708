"""
What the residual stream still holds after each visit of the looped core: linear probes of each position's input
token and of its position, beside the loops' own diagnostics (visit_diagnostics: kappa_R, per-visit gradient norms,
the stream's RMS). train.py records loop_diagnostics at every evaluation; lab/plot.py draws them.
"""

import itertools

import torch
from torch.func import functional_call


def linear_probe(features, labels, fit, floor=1e-3):
    """Accuracy of a linear read-out of `labels` (n,) from `features` (n, d): least squares onto the labels' one-hot
    codes on the rows where `fit` (n,) is True, scored by argmax on the other rows, where a label the fit rows never
    showed counts as missed. The features are centred and divided by the stream's RMS (one number: the read-out
    does not depend on the stream's scale, which grows in Pre-LN and stays 1 in Post-LN), and only directions that
    vary by more than `floor` of that RMS are read: rounding varies a stream by a millionth, and a read-out of it
    would still tip the argmax between near-tied labels. 1.0: the stream still tells the labels apart linearly;
    the most frequent label's share: it no longer does. Raises ValueError unless both kinds of rows exist."""
    if fit.all() or not fit.any():
        raise ValueError("a linear probe needs rows to fit on and rows to score on")
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


def stream_probes(streams, idx):
    """(token_probe, position_probe): linear_probe of each position's input token and of its index from each stream
    (B, T, C) of visit_diagnostics ([0]: the core's input), fit on the first half of the batch's sequences and
    scored on the other half. The position is what a pointer to a cell must find. Raises ValueError for a batch of
    one sequence, which has no second half."""
    B, T = idx.shape
    if B < 2:
        raise ValueError("the stream probes fit on half of a batch's sequences and score on the other half: they need "
                         "a batch of 2 sequences or more")
    fit = torch.arange(B, device=idx.device).repeat_interleave(T) < B // 2
    positions = torch.arange(T, device=idx.device).repeat(B)
    return tuple([linear_probe(s.reshape(B * T, -1), labels, fit) for s in streams]
                 for labels in (idx.reshape(-1), positions))


def visit_diagnostics(model, idx, targets):
    """kappa_R, the paper's visit-alignment coefficient, on one batch, and what it is made of:
        kappa[b]          ||sum_r g_r||^2 / sum_r ||g_r||^2 over the gradients g_r that visit r gives core block b
        grad_norm[b][r]   ||g_r||
        residual_rms[v]   RMS of the stream after unrolled core visit v
        streams[v]        the stream itself ([0]: the core's input), for the lab's probes
    kappa is 1 when the visits' gradients are orthogonal (decorrelated: DeepNorm's 1/4 suffices) and R when they
    all point the same way (the aligned regime DeepLoop's 1/2 is built for); below 1, visits partly cancel. It is
    exactly 1 at n_loop = 1, and near 1 when one visit's gradient dwarfs the others (grad_norm tells which).
    Each visit runs its block with a leaf copy of the block's parameters (sharing storage), so autograd hands back
    every g_r; their sum is the block's real gradient."""
    L, R, no_cache = model.config.n_layer, model.config.n_loop, itertools.repeat(None)
    e = model.embed(idx, 0, no_cache)
    x, visit_params, streams = None, [], [e.detach()]
    for _ in range(R):
        x = model.into_loop(x, e)
        for block in model.transformer.h:
            params = {name: p.detach().requires_grad_() for name, p in block.named_parameters()}
            x = functional_call(block, params, (x,))
            visit_params.append(list(params.values()))
            streams.append(x.detach())
    grads = torch.autograd.grad(model.loss(model.readout(x, no_cache), targets), sum(visit_params, []))
    n = len(visit_params[0])
    g = torch.stack([torch.cat([t.flatten() for t in grads[v * n:(v + 1) * n]]) for v in range(L * R)])
    g = g.view(R, L, -1)  # g[r, b]: what visit r gives block b
    squares = g.pow(2).sum(-1)
    return dict(kappa=(g.sum(0).pow(2).sum(-1) / squares.sum(0).clamp_min(1e-30)).tolist(),
                grad_norm=squares.sqrt().T.tolist(), streams=streams,
                residual_rms=[s.pow(2).mean().sqrt().item() for s in streams[1:]])


def loop_diagnostics(model, idx, targets):
    """visit_diagnostics' numbers with the stream probes (token_probe, position_probe) where the batch has two
    sequences or more: a JSON-ready dict, as train.py records it."""
    diagnostics = visit_diagnostics(model, idx, targets)
    streams = diagnostics.pop("streams")
    if idx.size(0) >= 2:
        diagnostics["token_probe"], diagnostics["position_probe"] = stream_probes(streams, idx)
    return diagnostics
