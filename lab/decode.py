"""
Adaptive exit and a KV cache that does not grow with the loop count: how the recurrent-depth models decode.

Adaptive exit (Huginn's KL criterion, Geiping et al. 2025): each position stops looping at the first loop whose
next-token distribution is within a KL threshold of the previous loop's. kv_cache=last_loop (Ouro's decoding): the
visits of a core block share one cache entry, so the cache has the size of an unlooped model's.

    python -m lab.sample --out_dir=out-smoke-sampled --exit_threshold=1e-3 --n_loop=8
    python -m lab.sample --out_dir=out-smoke-sampled --kv_cache=last_loop --n_loop=8
    python -m lab.exit_eval --out_dir=out-depth-sampled      # loss and accuracy against the mean loops

Built on GPT's embed, loop and readout; a library module (bad settings raise ValueError).
"""

import torch
import torch.nn.functional as F

from model import MAX_LOOPS, KVCache

KV_CACHES = ("per_visit", "last_loop")


class SharedKVCache(KVCache):
    """A visit's view of a store that other visits share (kv_cache=last_loop): the keys and values are the store's,
    the count of positions is the visit's own, so a later loop of a position overwrites what earlier loops wrote."""

    def __init__(self, store):
        self.store = store
        super().__init__()

    k = property(lambda self: self.store.k, lambda self, value: setattr(self.store, "k", value))
    v = property(lambda self: self.store.v, lambda self, value: setattr(self.store, "v", value))


def new_caches(model, n_loop=None, kv_cache="per_visit"):
    """An empty cache for GPT.forward and exit_logits, a KVCache per unrolled visit in the order of the visits:
        per_visit  every visit has entries of its own (GPT.new_caches): cached decoding equals recomputing
        last_loop  the visits of a core block share one store: each position keeps there the keys and values of its
                   last loop, and every visit of the block reads those of the earlier positions. An approximation
                   (cached no longer equals recomputed) but at n_loop=1 and within a prompt, whose positions run
                   their loops together
    The prelude and coda blocks run once, with an entry each in both."""
    if kv_cache not in KV_CACHES:
        raise ValueError(f"unknown kv_cache {kv_cache!r}; choose one of {', '.join(KV_CACHES)}")
    cfg = model.config
    if kv_cache == "per_visit":
        return model.new_caches(n_loop)
    stores = [KVCache() for _ in range(cfg.n_layer)]
    return [*(KVCache() for _ in range(cfg.n_prelude)),
            *(SharedKVCache(store) for _ in range(n_loop or cfg.n_loop) for store in stores),
            *(KVCache() for _ in range(cfg.n_coda))]


def exit_logits(model, idx, exit_threshold, n_loop=None, targets=None, caches=None):
    """Adaptive exit: each position takes the logits of the first loop r whose next-token distribution p_r is within
    exit_threshold of the previous loop's, KL(p_r || p_r-1) < exit_threshold, or of loop n_loop, the most a position
    runs -> (logits, loss or None, loops: (B, T), the loop each position took). p_0 is what the embedded input
    predicts before any loop (through the coda and the output layer), so that a position can exit after one loop: a
    threshold every KL passes gives n_loop=1, and 0 (no KL is below it) gives n_loop. The criterion costs a readout
    per loop, and one for p_0.
    The positions of idx run together, loop by loop, until each has exited; a position reads the others' states at
    the same loop, exited or not. With caches (new_caches' list) the positions are appended to it, and each keeps there
    what its exit loop computed: in every later visit of a core block, its exit loop's keys and values of that block
    (as Huginn fills the steps a token skipped from its latest one), in the coda those of the coda's run on its exit
    state. A position decoded later, one at a time, reads an exited position's exit-loop entries at every deeper
    loop, where a parallel pass (no cache: scoring; or a prompt) lets it read what that position's further loops
    computed: the two differ wherever a position exits before the last loop (measured in docs/test_time_depth.md)."""
    cfg, loops_max = model.config, n_loop or model.config.n_loop
    if not exit_threshold >= 0:
        raise ValueError(f"exit_threshold must be >= 0 (0 = off: every position runs n_loop loops), got "
                         f"{exit_threshold}")
    if not 1 <= loops_max <= MAX_LOOPS:
        raise ValueError(f"n_loop, the most loops a position runs with adaptive exit, must be from 1 to "
                         f"{MAX_LOOPS} (model.MAX_LOOPS), got {n_loop}")
    if caches is not None and len(caches) != cfg.depth(loops_max):
        raise ValueError(f"a cache of {len(caches)} visits for a pass through {cfg.depth(loops_max)}: make it with "
                         f"new_caches(model, n_loop) for the n_loop the pass runs")
    P, L, (B, T) = cfg.n_prelude, cfg.n_layer, idx.shape
    start = caches[0].past if caches else 0
    entries = caches or [None] * cfg.depth(loops_max)
    coda = entries[P + loops_max * L:]
    e = model.embed(idx, start, iter(entries[:P]))

    def readout(state):
        for cache in coda if caches else ():
            cache.past = start  # every loop's readout writes these positions' coda entries anew
        logits = model.readout(state, iter(coda))
        return logits, F.log_softmax(logits.float(), dim=-1)

    _, log_p = readout(e)
    state, loops, logits, kept = None, torch.zeros(B, T, dtype=torch.long, device=idx.device), None, None
    for r in range(1, loops_max + 1):
        visits = entries[P + (r - 1) * L:P + r * L]
        state = model.loop(state, e, iter(visits))
        new_logits, new_log_p = readout(state)
        kl = (new_log_p.exp() * (new_log_p - log_p)).sum(-1).clamp_min(0)  # >= 0, but for rounding
        running = loops == 0
        exits = running & ((kl < exit_threshold) | (r == loops_max))
        loops = torch.where(exits, r, loops)
        logits = new_logits if logits is None else torch.where(exits[..., None], new_logits, logits)
        if caches:  # what each position's exit loop computed: the core's while it runs, the coda's as it exits
            kept = _keep(kept, visits, coda, running, exits, start, T)
        log_p = new_log_p
        if loops.all():
            break
    if caches:
        _rewrite_exited(cfg, caches, kept, loops, r, start)
    return logits, None if targets is None else model.loss(logits, targets), loops


def _keep(kept, visits, coda, running, exits, start, T):
    """exit_logits' bookkeeping after a loop: each position's keys and values of the core's visits while it runs
    (so in the end its exit loop's), of the coda's blocks at the loop it exits at."""
    fresh = [(cache.k[:, :, start:start + T], cache.v[:, :, start:start + T]) for cache in (*visits, *coda)]
    if kept is None:  # the buffers are overwritten by later loops (last_loop) and readouts (the coda)
        return [(k.clone(), v.clone()) for k, v in fresh]
    masks = [running[:, None, :, None]] * len(visits) + [exits[:, None, :, None]] * len(coda)
    return [(torch.where(m, k, old_k), torch.where(m, v, old_v))
            for m, (k, v), (old_k, old_v) in zip(masks, fresh, kept)]


def _rewrite_exited(cfg, caches, kept, loops, computed, start):
    """The end of a cached exit_logits pass: every position gets, in each core visit after its exit loop (with
    last_loop's shared entries: in every visit), its exit loop's keys and values of that block, also in the visits of
    loops this pass did not run; in the coda, those of its exit."""
    P, L, T = cfg.n_prelude, cfg.n_layer, loops.size(1)
    loops_max = (len(caches) - P - cfg.n_coda) // L

    def rewrite(cache, k, v):
        cache.past = start
        cache.update(k, v, cfg.block_size)

    for r in range(1, loops_max + 1):
        for b in range(L):
            cache, (k, v) = caches[P + (r - 1) * L + b], kept[b]
            if not isinstance(cache, SharedKVCache) and r <= computed:  # loop r's own where a position ran it
                ran = (loops >= r)[:, None, :, None]
                if ran.all():
                    continue
                k = torch.where(ran, cache.k[:, :, start:start + T], k)
                v = torch.where(ran, cache.v[:, :, start:start + T], v)
            rewrite(cache, k, v)
    for cache, (k, v) in zip(caches[P + loops_max * L:], kept[L:]):
        rewrite(cache, k, v)


def generate_stream(model, idx, max_new_tokens, temperature=1.0, top_k=None, n_loop=None, vocab_size_limit=None,
                    exit_threshold=0.0, kv_cache="per_visit", loops_used=None):
    """GPT.generate_stream through a cache of the kv_cache layout, and with exit_threshold > 0 through adaptive exit
    (n_loop then the most loops a token runs): the prompt (and a refilled window) runs as one pass, each new token as
    a pass of its own; each step appends to loops_used (a list) the loops its tokens took, a (B,) tensor. A batch
    runs until its last sequence exits (the others' extra loops are computed and dropped)."""
    caches = new_caches(model, n_loop, kv_cache)

    def next_logits(ids, caches):
        logits, _, loops = exit_logits(model, ids, exit_threshold, n_loop, caches=caches)
        if loops_used is not None:
            loops_used.append(loops[:, -1])
        return logits

    return model.generate_stream(idx, max_new_tokens, temperature, top_k, n_loop, True, vocab_size_limit, caches,
                                 next_logits if exit_threshold else None)
