"""decode.py: adaptive exit against a plain reference decoder, its thresholds' two ends, the last_loop cache, the loops
reported by a model whose loops agree after a known count, and bad exit and cache settings."""

import math

import pytest
import torch
from torch.nn import functional as F

from agreeing_loops import agree_after
from lab.decode import KV_CACHES, exit_logits, generate_stream, new_caches
from lab.flops import kv_cache_bytes
from model import GPT, KVCache
from models import HUGINN, perturbed, tiny

SECOND_PROCESS = True  # seconds of decoding, run beside the rest of the session (conftest.py)


def generate(model, idx, max_new_tokens, **kwargs):
    """idx and the tokens that lab.decode.generate_stream samples after it, as GPT.generate returns them."""
    return torch.cat([idx, *generate_stream(model, idx, max_new_tokens, **kwargs)], dim=1)


def embedding(model, idx, start):
    """The token (and learned position) embedding of idx at positions start.., before the prelude: GPT.embed's first
    steps, written out so that the reference below can keep every prelude block's input."""
    t = model.transformer
    x = t.wte(idx)
    if t.wpe is not None:
        x = x + t.wpe(torch.arange(start, start + idx.size(1)))
    return t.ln_e(x)


def reference_exit_generation(model, prompt, steps, threshold, max_loops, kv_cache="per_visit"):
    """Adaptive exit applied plainly to one sequence (prompt: a list of ids), greedy -> (new tokens, loops of each).
    Nothing is kept between uses but each position's block inputs ("sources"); a block's keys and values of earlier
    positions are recomputed from them at every use: for core block b at loop r from the input position w had there
    at loop min(r, exit_w) (last_loop: at exit_w), for coda block c from its input in the coda's run at w's exit.
    A position exits at the first loop r >= 1 whose distribution is within threshold of loop r - 1's (loop 0: the
    embedded input's), or at max_loops. The prompt, and the window once the context outgrows block_size, run as one
    pass: every position through every loop, reading the others at the same loop."""
    t, bs = model.transformer, model.config.block_size
    source_loop = (lambda r, exit: min(r, exit)) if kv_cache == "per_visit" else (lambda r, exit: exit)

    def kl(log_p, log_q):
        return (log_p.exp() * (log_p - log_q)).sum(-1)

    def parallel(ids):
        T = len(ids)
        src = [{} for _ in range(T)]
        x = embedding(model, torch.tensor([ids]), 0)
        for i, block in enumerate(t.prelude):
            for w in range(T):
                src[w]["p", i] = x[0, w]
            x = block(x, None)
        e = x

        def readout(state):
            inputs, x = [], state
            for block in t.coda:
                inputs.append(x)
                x = block(x, None)
            logits = model.lm_head(t.ln_f(x))
            return logits, F.log_softmax(logits.float(), -1), inputs

        log_p = readout(e)[1]
        exits, state = [0] * T, None
        for r in range(1, max_loops + 1):
            x = model.into_loop(state, e)
            for b, block in enumerate(t.h):
                for w in range(T):
                    src[w]["h", r, b] = x[0, w]
                x = block(x, None)
            state = x
            logits, new_log_p, coda_inputs = readout(state)
            divergence = kl(new_log_p, log_p)[0]
            for w in range(T):
                if not exits[w] and (divergence[w] < threshold or r == max_loops):
                    exits[w] = r
                    src[w].update({("c", c): inputs[0, w] for c, inputs in enumerate(coda_inputs)})
                    if w == T - 1:
                        last = logits[0, w]
            log_p = new_log_p
        return src, exits, last

    def decode(ids, src, exits):
        u = len(ids) - 1  # the new position; 0..u-1 are known by their sources

        def run(block, x, sources):
            cache = KVCache()
            block(torch.stack(sources)[None], cache)  # the earlier positions' keys and values, at positions 0..u-1
            assert cache.past == u  # and so the new position's queries and keys turn as position u's
            return block(x, cache)

        mine = {}
        x = embedding(model, torch.tensor([[ids[u]]]), u)
        for i, block in enumerate(t.prelude):
            mine["p", i] = x[0, 0]
            x = run(block, x, [src[w]["p", i] for w in range(u)])
        e = x

        def readout(state):
            inputs, x = [], state
            for c, block in enumerate(t.coda):
                inputs.append(x[0, 0])
                x = run(block, x, [src[w]["c", c] for w in range(u)])
            logits = model.lm_head(t.ln_f(x))[0, 0]
            return logits, F.log_softmax(logits.float(), -1), inputs

        log_p, state = readout(e)[1], None
        for r in range(1, max_loops + 1):
            x = model.into_loop(state, e)
            for b, block in enumerate(t.h):
                mine["h", r, b] = x[0, 0]
                x = run(block, x, [src[w]["h", source_loop(r, exits[w]), b] for w in range(u)])
            state = x
            logits, new_log_p, coda_inputs = readout(state)
            if kl(new_log_p, log_p) < threshold or r == max_loops:
                mine.update({("c", c): inputs for c, inputs in enumerate(coda_inputs)})
                src.append(mine)
                exits.append(r)
                return logits, r
            log_p = new_log_p

    ids, tokens, loops = list(prompt), [], []
    with torch.no_grad():
        for step in range(steps):
            if step == 0 or len(ids) > bs:
                src, exits, logits = parallel(ids[-bs:])
                used = exits[-1]
            else:
                logits, used = decode(ids, src, exits)
            ids.append(logits.argmax().item())
            tokens.append(ids[-1])
            loops.append(used)
    return tokens, loops


EXIT_ARCHS = {"gpt2": {}, "preln-rope": dict(residual="preln", position_encoding="rope"),
              "huginn": dict(residual="preln", loop_input="concat", **HUGINN)}


@pytest.mark.parametrize("kv_cache", KV_CACHES)
@pytest.mark.parametrize("arch", EXIT_ARCHS, ids=list(EXIT_ARCHS))
def test_adaptive_exit_generation_equals_a_plain_reference(arch, kv_cache):
    """Batched, cached generation with adaptive exit: the tokens and each token's loops equal the reference, row by
    row, also past block_size (the window slides); threshold 0 (the fixed-depth path) too."""
    torch.manual_seed(2)
    model = perturbed(GPT(tiny(n_loop=2, block_size=12, **EXIT_ARCHS[arch])).double(), 0.1)
    prompt = torch.randint(0, 128, (2, 5))
    spread = set()
    for threshold in (0.0, 0.003, 0.02):
        used = []
        out = generate(model, prompt, 11, top_k=1, n_loop=5, exit_threshold=threshold, kv_cache=kv_cache,
                       loops_used=used)
        for row in range(2):
            tokens, loops = reference_exit_generation(model, prompt[row].tolist(), 11, threshold, 5, kv_cache)
            assert out[row, 5:].tolist() == tokens
            if threshold:
                assert [u[row].item() for u in used] == loops
                spread.update(loops)
    assert len(spread) > 2, spread  # the tokens did exit at several loop counts


@pytest.mark.parametrize("arch", EXIT_ARCHS, ids=list(EXIT_ARCHS))
def test_exit_threshold_zero_is_fixed_n_loop_and_one_that_every_kl_passes_is_one_loop(arch):
    torch.manual_seed(3)
    model = perturbed(GPT(tiny(n_loop=2, **EXIT_ARCHS[arch])))
    idx = torch.randint(0, 128, (2, 12))
    targets = torch.roll(idx, -1, 1)
    with torch.no_grad():
        for threshold, loops, fixed in ((0.0, 3, 3), (math.inf, 4, 1)):
            logits, loss, used = exit_logits(model, idx, threshold, loops, targets)
            assert torch.equal(used, torch.full_like(idx, fixed))
            expected, expected_loss = model(idx, targets, n_loop=fixed)
            assert torch.equal(logits, expected) and torch.equal(loss, expected_loss)
    prompt = idx[:, :5]
    for kv_cache in KV_CACHES:
        used = []
        every = generate(model, prompt, 20, top_k=1, n_loop=4, exit_threshold=math.inf, kv_cache=kv_cache,
                         loops_used=used)
        assert torch.equal(every, model.generate(prompt, 20, top_k=1, n_loop=1))  # token for token, past block_size
        assert torch.equal(torch.stack(used), torch.ones(20, 2, dtype=torch.long))
    assert torch.equal(generate(model, prompt, 20, top_k=1, n_loop=3, exit_threshold=0.0),
                       model.generate(prompt, 20, top_k=1, n_loop=3))


@pytest.mark.parametrize("arch", EXIT_ARCHS, ids=list(EXIT_ARCHS))
def test_last_loop_cache_holds_one_entry_per_block_and_equals_per_visit_at_one_loop(arch):
    torch.manual_seed(4)
    model = perturbed(GPT(tiny(n_loop=2, block_size=16, **EXIT_ARCHS[arch])))
    prompt = torch.randint(0, 128, (2, 5))
    per_visit, last_loop = (generate(model, prompt, 25, top_k=1, n_loop=1, kv_cache=c) for c in KV_CACHES)
    assert torch.equal(per_visit, last_loop)
    torch.manual_seed(5)
    sampled = generate(model, prompt, 10, n_loop=1, kv_cache="last_loop")
    torch.manual_seed(5)
    assert torch.equal(sampled, model.generate(prompt, 10, n_loop=1))
    # memory: the buffers that a cache allocates, against kv_cache_bytes; last_loop's do not grow with n_loop
    cfg = model.config
    for n_loop in (1, 4):
        for kv_cache in KV_CACHES:
            cache = new_caches(model, n_loop, kv_cache)
            with torch.no_grad():
                model(prompt, n_loop=n_loop, caches=cache)
            stores = {id(store): store for store in (getattr(c, "store", c) for c in cache)}.values()
            allocated = sum(s.k.nbytes + s.v.nbytes for s in stores)
            assert allocated == kv_cache_bytes(model, 2, cfg.block_size, 4, n_loop, kv_cache)
            entries = cfg.depth(n_loop) if kv_cache == "per_visit" else cfg.depth(1)
            assert len(stores) == entries
    # at 3 loops the prompt, whose positions run their loops together, is exact; a decoded token is not
    with torch.no_grad():
        steps = {}
        for kv_cache in KV_CACHES:
            cache = new_caches(model, 3, kv_cache)
            steps[kv_cache] = (model(prompt, n_loop=3, caches=cache)[0], model(prompt[:, :1], n_loop=3,
                                                                             caches=cache)[0])
        assert torch.equal(steps["per_visit"][0], steps["last_loop"][0])
        assert (steps["per_visit"][1] - steps["last_loop"][1]).abs().max() > 1e-3


@pytest.mark.parametrize("arch", EXIT_ARCHS, ids=list(EXIT_ARCHS))
def test_loops_reported_are_those_of_a_model_whose_loops_agree_after_a_known_count(arch, monkeypatch):
    torch.manual_seed(6)
    model = perturbed(GPT(tiny(**EXIT_ARCHS[arch])))
    m = 1 + torch.arange(12) % 4  # 1..4 by position
    agree_after(monkeypatch, m)
    # a coda reads the other positions' states at the same loop: a position's p_r settles once every position up
    # to it has settled
    settled = m.cummax(0).values if model.config.n_coda else m
    with torch.no_grad():
        _, _, loops = exit_logits(model, torch.randint(0, 128, (2, 12)), 1e-9, n_loop=8)
        assert torch.equal(loops, (settled + 1).expand(2, 12))
        loops = exit_logits(model, torch.randint(0, 128, (2, 12)), 1e-9, n_loop=3)[2]  # at most n_loop
        assert torch.equal(loops, (settled + 1).clamp(max=3).expand(2, 12))
    agree_after(monkeypatch, 3)
    used = []
    generate(model, torch.randint(0, 128, (2, 5)), 6, top_k=1, n_loop=8, exit_threshold=1e-9, loops_used=used)
    assert torch.equal(torch.stack(used), torch.full((6, 2), 4))


def test_bad_exit_and_cache_settings_are_rejected():
    model = GPT(tiny(n_loop=2))
    idx = torch.zeros(1, 4, dtype=torch.long)
    for kw, message in ((dict(exit_threshold=-0.1), "exit_threshold must be >= 0 (0 = off: every position runs "
                                                    "n_loop loops), got -0.1"),
                        (dict(exit_threshold=math.nan), "exit_threshold must be >= 0 (0 = off: every position runs "
                                                        "n_loop loops), got nan"),
                        (dict(exit_threshold=1e-3, n_loop=-1), "n_loop, the most loops a position runs with "
                                                               "adaptive exit, must be from 1 to 1024 "
                                                               "(model.MAX_LOOPS), got -1"),
                        (dict(exit_threshold=1e-3, n_loop=5000), "n_loop, the most loops a position runs with "
                                                                 "adaptive exit, must be from 1 to 1024 "
                                                                 "(model.MAX_LOOPS), got 5000")):
        with pytest.raises(ValueError) as e:
            exit_logits(model, idx, **kw)
        assert str(e.value) == message
        with pytest.raises(ValueError) as e:
            generate(model, idx, 3, **kw)
        assert str(e.value) == message
    with pytest.raises(ValueError) as e:
        generate(model, idx, 3, kv_cache="last")
    assert str(e.value) == "unknown kv_cache 'last'; choose one of per_visit, last_loop"
    with pytest.raises(ValueError) as e:
        new_caches(model, 2, kv_cache="last")
    assert str(e.value) == "unknown kv_cache 'last'; choose one of per_visit, last_loop"


@pytest.mark.parametrize("kv_cache", KV_CACHES)
def test_exit_logits_rejects_a_cache_made_for_another_loop_count(kv_cache):
    """exit_logits runs up to n_loop loops and rewrites every visit's entries past a position's exit: a cache made
    for fewer loops has no entries for the deeper visits, one made for more would give the coda a core visit's."""
    model = GPT(tiny(n_loop=2, **HUGINN))
    idx = torch.zeros(1, 4, dtype=torch.long)
    for cached_loops in (1, 2, 5):
        depth = 1 + 2 * cached_loops + 2
        with pytest.raises(ValueError) as e:
            exit_logits(model, idx, 1e-3, n_loop=3, caches=new_caches(model, cached_loops, kv_cache))
        assert str(e.value) == (f"a cache of {depth} visits for a pass through 9: make it with "
                                f"new_caches(model, n_loop) for the n_loop the pass runs")
