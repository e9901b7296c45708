"""A model whose loops agree after a known count: what tests of adaptive exit compare its loop counts with."""

import torch

from model import GPT

GPT_LOOP = GPT.loop  # as model.py has it, whatever agree_after has patched


def agree_after(monkeypatch, m):
    """Make every GPT's loops agree after m loops: m an int, or a (T,) tensor, one count per position of a pass that
    starts at position 0. A loop leaves the state e + min(r, m) * d (d a fixed direction) in place of what its
    blocks computed (they still run on the state they get, and fill the cache), so the state, and with it p_r, is
    the same from loop m on: loop m + 1 is the first whose KL to its predecessor is 0."""
    count = [0]

    def loop(self, x, e, caches):
        GPT_LOOP(self, x, e, caches)
        count[0] = 1 if x is None else count[0] + 1
        steps = torch.as_tensor(m).clamp(max=count[0]).to(e.dtype)[..., None]
        direction = torch.randn(e.size(-1), generator=torch.Generator().manual_seed(0)).to(e.dtype)
        return e + steps * e.std() * direction

    monkeypatch.setattr(GPT, "loop", loop)
