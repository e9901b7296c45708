"""loops.py: the loop count a training step draws (a pure function of seed and step, on a stream of its own, bounded
by MAX_LOOPS), bad distributions, and truncated backprop against a hand computation of each visit's gradient, with a
prelude and coda and with compiled blocks at sampled counts."""

import numpy as np
import pytest
import torch
import torch._dynamo
from torch.func import functional_call

from lab.loops import LOOP_STREAM, TrainLoops, TruncatedBackprop
from model import CHOICES, GPT, MAX_LOOPS
from models import HUGINN, NO_CACHE, perturbed, tiny

SECOND_PROCESS = True  # dynamo's tracing of ~20 loop counts, seconds of computing run beside the rest (conftest.py)


def test_train_loops_draw_a_pure_function_of_seed_and_step():
    uniform, huginn = TrainLoops("uniform", loop_min=1, loop_max=3), TrainLoops("lognormal_poisson", loop_mean=3.0)
    for loops in (uniform, huginn):
        draws = [loops.draw(1337, step) for step in range(3000)]
        assert draws == [loops.draw(1337, step) for step in range(3000)]  # fresh calls, any order: the same counts
        assert draws != [loops.draw(1338, step) for step in range(3000)]
        assert sum(draws) / len(draws) == pytest.approx(loops.mean, rel=0.04) and min(draws) >= 1
    assert set(draws) > {1, 2, 3, 4, 5, 6}  # Huginn's long right tail
    assert {uniform.draw(0, step) for step in range(100)} == {1, 2, 3}
    assert TrainLoops().draw(0, 5) is None and TrainLoops("lognormal_poisson", loop_mean=1.0).draw(0, 5) == 1


def test_the_loop_draw_has_a_stream_of_its_own():
    """Seeded with [seed, step], the draw of step 0 was the stream of train batch 0 ([seed, 0, 0] after numpy's
    padding) and that of step 1 the stream of val batch 0 ([seed, 1, 0]): the loop count was a function of the
    batch's data. The draw's seed has LOOP_STREAM where a batch's has its split."""
    loops = TrainLoops("uniform", loop_min=1, loop_max=MAX_LOOPS)
    for step in (0, 1):
        draws = [loops.draw(seed, step) for seed in range(20)]
        batch = [int(np.random.default_rng([seed, step, 0]).integers(1, MAX_LOOPS + 1)) for seed in range(20)]
        own = [int(np.random.default_rng([seed, LOOP_STREAM, step]).integers(1, MAX_LOOPS + 1)) for seed in range(20)]
        assert draws == own and sum(d == b for d, b in zip(draws, batch)) <= 1
    assert LOOP_STREAM >= 2  # a split's index is 0 (train) or 1 (val)


@pytest.mark.parametrize("build,message", [
    (lambda: TrainLoops("uniform", loop_min=1, loop_max=1000000000000),
     f"loop_sampling=uniform needs 1 <= loop_min <= loop_max <= {MAX_LOOPS} (model.MAX_LOOPS), got loop_min=1 "
     f"loop_max=1000000000000"),
    (lambda: TrainLoops("lognormal_poisson", loop_mean=float("1e400")),
     f"loop_sampling=lognormal_poisson needs 1 <= loop_mean <= {MAX_LOOPS} (model.MAX_LOOPS), got inf"),
])
def test_every_loop_count_a_step_draws_is_bounded_by_max_loops(build, message):
    """A typo in a loop count would run a step that never ends (and that SIGTERM does not cut short), or grow the
    list of visits until memory runs out: every count a setting can make a step draw stops at MAX_LOOPS (the model's
    own counts: tests/test_model.py)."""
    with pytest.raises(ValueError) as error:
        build()
    assert str(error.value) == message


def test_lognormal_poisson_draws_above_max_loops_run_max_loops():
    """The log-normal Poisson draw has no upper end: a draw above MAX_LOOPS runs MAX_LOOPS (at loop_mean =
    MAX_LOOPS, about half of them), and MAX_LOOPS itself is a valid count everywhere."""
    draws = [TrainLoops("lognormal_poisson", loop_mean=MAX_LOOPS).draw(0, step) for step in range(200)]
    assert max(draws) == MAX_LOOPS and 50 < draws.count(MAX_LOOPS) < 150 and min(draws) >= 1
    assert tiny(n_loop=MAX_LOOPS).n_loop == MAX_LOOPS
    assert TrainLoops("uniform", loop_min=MAX_LOOPS, loop_max=MAX_LOOPS).draw(0, 0) == MAX_LOOPS


def test_compiled_blocks_take_every_sampled_loop_count_in_a_few_graphs():
    """train.py's compile (compile_blocks) over a sampled run: the 20 counts that log-normal Poisson with mean 8 draws
    in 200 steps, with truncated backprop, then evaluations at other counts, compile a handful of graphs in all
    (autograd on or off, training or eval, a block input with or without a gradient; the loss), and running every
    count again compiles nothing: far below dynamo's recompile_limit, past which it would run uncompiled (made an
    error here). Whole-model compile, for comparison, needs a graph per count and hits the limit. A counting backend
    instead of inductor: seconds, not minutes; the graphs it is handed are the ones inductor would compile."""
    loops = TrainLoops("lognormal_poisson", loop_mean=8.0)
    counts = sorted({loops.draw(1337, step) for step in range(200)})
    assert len(counts) > 2 * torch._dynamo.config.recompile_limit
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    idx = torch.randint(0, 128, (2, 16))
    targets = torch.roll(idx, -1, 1)
    model = GPT(tiny(n_layer=2, n_loop=8))
    truncated = TruncatedBackprop(model, 2)
    eager = model(idx, targets, n_loop=3)[1]
    torch._dynamo.reset()
    try:
        model.compile_blocks(backend=counting)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for n_loop in counts:
                truncated(idx, targets, n_loop)[1].backward()
            training = len(graphs)
            model.eval()
            with torch.no_grad():
                for n_loop in (1, 16, 40):
                    model(idx, targets, n_loop=n_loop)
            model.train()
            evaluation = len(graphs) - training
            for n_loop in counts[::-1]:
                truncated(idx, targets, n_loop)[1].backward()
            compiled = model(idx, targets, n_loop=3)[1]
        assert training <= 5 and evaluation <= 2 and len(graphs) == training + evaluation
        torch.testing.assert_close(compiled, eager)

        torch._dynamo.reset()
        graphs.clear()
        whole = torch.compile(GPT(tiny(n_layer=2, n_loop=8)), backend=counting)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            with pytest.raises(Exception, match="recompile_limit"):
                for n_loop in counts:
                    whole(idx, targets, n_loop=n_loop)
        assert len(graphs) == torch._dynamo.config.recompile_limit
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("settings,message", [
    (dict(loop_sampling="uniform", loop_min=0, loop_max=3),
     "loop_sampling=uniform needs 1 <= loop_min <= loop_max <= 1024 (model.MAX_LOOPS), got loop_min=0 loop_max=3"),
    (dict(loop_sampling="uniform", loop_min=3, loop_max=2),
     "loop_sampling=uniform needs 1 <= loop_min <= loop_max <= 1024 (model.MAX_LOOPS), got loop_min=3 loop_max=2"),
    (dict(loop_sampling="lognormal_poisson", loop_mean=-2.0),
     "loop_sampling=lognormal_poisson needs 1 <= loop_mean <= 1024 (model.MAX_LOOPS), got -2.0"),
    (dict(loop_sampling="poisson"), "unknown loop_sampling 'poisson'; choose one of fixed, uniform, lognormal_poisson"),
    (dict(loop_mean=2.0), "loop_mean only applies to loop_sampling=lognormal_poisson, not fixed"),
    (dict(loop_sampling="lognormal_poisson", loop_mean=2.0, loop_max=4),
     "loop_min and loop_max only apply to loop_sampling=uniform, not lognormal_poisson"),
    (dict(backprop_loops=-1), "backprop_loops must be >= 0 (0 = through every loop), got -1"),
])
def test_impossible_loop_distributions_are_rejected(settings, message):
    with pytest.raises(ValueError) as error:
        TrainLoops(**settings)
    assert str(error.value) == message


def test_backprop_through_the_last_loops_equals_the_gradient_of_those_visits_alone():
    """Truncated backprop through the last k of R loops, against a hand computation: every visit runs the block with
    its own leaf copy of the weights (as visit_diagnostics does), so autograd hands back each visit's contribution;
    the truncated gradient of a block is the sum over the last k loops' visits, and nothing reaches the position
    embedding, which only the untracked first visits read."""
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=2, n_loop=2))
    idx = torch.randint(0, 128, (2, 16))
    targets = torch.roll(idx, -1, 1)
    R, k = 4, 1  # run at 4 loops, gradients through the last one
    TruncatedBackprop(model, k)(idx, targets, R)[1].backward()

    x = model.embed(idx, 0, NO_CACHE)
    visit_params = []
    for block in [*model.transformer.h] * R:
        params = {name: p.detach().requires_grad_() for name, p in block.named_parameters()}
        x = functional_call(block, params, (x, None))
        visit_params.append(params)
    loss = model.loss(model.lm_head(model.transformer.ln_f(x)), targets)
    grads = torch.autograd.grad(loss, [p for params in visit_params for p in params.values()])
    n = len(visit_params[0])
    per_visit = [dict(zip(params, grads[v * n:(v + 1) * n])) for v, params in enumerate(visit_params)]
    for b, block in enumerate(model.transformer.h):
        for name, p in block.named_parameters():
            expected = sum(per_visit[r * 2 + b][name] for r in range(R - k, R))
            torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-7, msg=name)
    assert model.transformer.wpe.weight.grad is None and model.transformer.ln_e.weight.grad is None

    # k >= R loops: every visit tracked, the ordinary gradient
    model.zero_grad()
    TruncatedBackprop(model, R)(idx, targets, R)[1].backward()
    full = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model(idx, targets, n_loop=R)[1].backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, full[name]), name


@pytest.mark.parametrize("loop_input", CHOICES["loop_input"])
def test_backprop_loops_with_a_prelude_and_coda(loop_input):
    """Truncated backprop through the last k of R core loops, against a hand computation with a leaf copy of the
    core's weights per visit and of the embedded input e per loop: a core block gets the sum over the kept loops'
    visits; the prelude gets what the kept loops' reads of e send it, which is nothing with loop_input none (the
    first loop alone reads e, untracked): the prelude, position embedding and ln_e then learn nothing, as without a
    prelude. The coda, after the loops, gets its full gradient."""
    torch.manual_seed(0)
    model = perturbed(GPT(tiny(n_layer=2, n_loop=2, loop_input=loop_input, **HUGINN)))
    t = model.transformer
    idx = torch.randint(0, 128, (2, 16))
    targets = torch.roll(idx, -1, 1)
    R, k = 4, 2
    TruncatedBackprop(model, k)(idx, targets, R)[1].backward()
    truncated = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad()
    model(idx, targets, n_loop=R)[1].backward()
    full = {name: p.grad for name, p in model.named_parameters()}

    e = model.embed(idx, 0, NO_CACHE)  # the embeddings, then the prelude
    x, reads, visit_params = None, [], []
    for r in range(R):
        reads.append(e.detach().requires_grad_())
        x = reads[r] if x is None else x if t.inject is None else t.inject(x, reads[r])
        for block in t.h:
            visit_params.append({name: p.detach().requires_grad_() for name, p in block.named_parameters()})
            x = functional_call(block, visit_params[-1], (x, None))
    loss = model.loss(model.readout(x, NO_CACHE), targets)
    grads = torch.autograd.grad(loss, reads + [p for params in visit_params for p in params.values()],
                                allow_unused=True)
    n = len(visit_params[0])
    per_visit = [dict(zip(params, grads[R + v * n:R + (v + 1) * n])) for v, params in enumerate(visit_params)]
    for b, block in enumerate(t.h):
        for name, p in block.named_parameters():
            expected = sum(per_visit[r * 2 + b][name] for r in range(R - k, R))
            torch.testing.assert_close(truncated[f"transformer.h.{b}.{name}"], expected, rtol=1e-4, atol=1e-7)
    kept_reads = [grads[r] for r in range(R - k, R) if grads[r] is not None]
    prelude = dict(t.prelude.named_parameters())
    if loop_input == "none":
        assert not kept_reads
        assert all(truncated[f"transformer.prelude.{name}"] is None for name in prelude)
        assert truncated["transformer.wpe.weight"] is None and truncated["transformer.ln_e.weight"] is None
    else:
        expected = torch.autograd.grad(e, list(prelude.values()), sum(kept_reads))
        for (name, _), g in zip(prelude.items(), expected):
            torch.testing.assert_close(truncated[f"transformer.prelude.{name}"], g, rtol=1e-4, atol=1e-8)
        assert truncated["transformer.wpe.weight"].abs().sum() > 0
    for name in dict(t.coda.named_parameters()):
        torch.testing.assert_close(truncated[f"transformer.coda.{name}"], full[f"transformer.coda.{name}"])


def test_truncated_backprop_needs_a_loop_to_track():
    with pytest.raises(ValueError) as error:
        TruncatedBackprop(GPT(tiny()), 0)
    assert str(error.value) == "backprop_loops must be >= 1 for truncated backprop, got 0"


@pytest.mark.parametrize("loops, bounds", [(TrainLoops(), (3, 3)), (TrainLoops("uniform", 2, 5), (2, 5)),
                                           (TrainLoops("lognormal_poisson", loop_mean=4.0), (1, MAX_LOOPS)),
                                           (TrainLoops("lognormal_poisson", loop_mean=1.0), (1, 1))])
def test_bounds_are_the_fewest_and_most_loops_a_step_draws(loops, bounds):
    assert loops.bounds(3) == bounds
    draws = {loops.draw(1337, step) or 3 for step in range(300)}
    assert bounds[0] <= min(draws) and max(draws) <= bounds[1]
    assert min(draws) == bounds[0] and (bounds[1] == MAX_LOOPS or max(draws) == bounds[1])
