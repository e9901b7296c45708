"""Small models for the tests of model.py and of the lab's instruments built on it."""

import itertools

import torch

from model import CHOICES, GPT, GPTConfig


def tiny(**kw):
    args = dict(block_size=32, vocab_size=128, n_layer=2, n_loop=1, n_head=2, n_embd=32, dropout=0.0, bias=True)
    args.update(kw)
    return GPTConfig(**args)


PAPER = dict(norm="rmsnorm", position_encoding="rope", norm_branch_input=True)  # the DeepLoop paper's backbone
# every backbone: both norms x both position encodings x both Post-LN block forms, and Pre-LN with each norm/position
BACKBONES = [dict(residual="deeploop", norm=n, position_encoding=p, norm_branch_input=b)
             for n in CHOICES["norm"] for p in CHOICES["position_encoding"] for b in (False, True)] + \
            [dict(residual="preln", norm=n, position_encoding=p)
             for n in CHOICES["norm"] for p in CHOICES["position_encoding"]] + \
            [dict(residual="preln_scaled")]
NO_CACHE = itertools.repeat(None)  # the caches iterator of a pass without a KV cache: None for every block
HUGINN = dict(n_prelude=1, n_coda=2)  # blocks run once before and after the looped core
# the backbones that a prelude, a coda and each loop_input are tested on
HUGINN_BACKBONES = {"gpt2": {}, "paper": PAPER, "preln": dict(residual="preln"),
                    "preln-rope": dict(residual="preln", **PAPER)}


def backbone_id(backbone):
    return "-".join(str(v) for v in backbone.values())


def perturbed(model, scale=0.05):
    """The model moved away from init (where concat's adapter ignores e and Post-LN loops barely change the state)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model.eval()


def learned_by_heart(ids, block_size, **settings):
    """A looped GPT (1 block x 2 loops, bytes; settings: other GPTConfig fields) trained on the token ids (a list)
    until it predicts each from the ones before it: a model whose right answers a test knows."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**dict(block_size=block_size, vocab_size=320, n_layer=1, n_loop=2, n_head=2, n_embd=32),
                             **settings}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    ids = torch.tensor(ids)[None]
    for _ in range(300):
        _, loss = model(ids[:, :-1], ids[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.01:
            break
    assert loss.item() < 0.01, "the fixture model did not learn its sentence"
    return model.eval()
