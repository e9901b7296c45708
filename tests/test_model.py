import math

import pytest
import torch

from model import GPT, GPTConfig, RESIDUALS, residual_coefficients


def tiny(**kw):
    args = dict(block_size=32, vocab_size=128, n_layer=2, n_loop=1, n_head=2, n_embd=32, dropout=0.0, bias=True)
    args.update(kw)
    return GPTConfig(**args)


@pytest.mark.parametrize("n_layer,n_loop", [(1, 1), (2, 4), (6, 2), (12, 1), (2, 48)])
def test_residual_coefficients_follow_the_formulas(n_layer, n_loop):
    N = n_layer * n_loop
    assert residual_coefficients("deeploop", N) == pytest.approx((math.sqrt(2 * N), 1 / math.sqrt(8 * N)))
    assert residual_coefficients("deepnorm", N) == pytest.approx(((2 * N) ** 0.25, (8 * N) ** -0.25))
    assert residual_coefficients("postln", N) == (1.0, 1.0)
    assert residual_coefficients("preln", N) == (1.0, 1.0)
    model = GPT(tiny(n_layer=n_layer, n_loop=n_loop, residual="deeploop"))
    assert model.transformer.h[0].alpha == pytest.approx(math.sqrt(2 * N))


@pytest.mark.parametrize("p", [0.25, 0.3, 0.45, 0.5, 0.6])
@pytest.mark.parametrize("N", [1, 3, 6, 14])
def test_residual_exponent_sets_p_of_the_rule(p, N):
    for residual in ("deeploop", "deepnorm"):
        assert residual_coefficients(residual, N, p) == pytest.approx(((2 * N) ** p, (8 * N) ** -p))
    # 0 is the scheme's own p, and p = 1/4 on deeploop is exactly DeepNorm
    assert residual_coefficients("deeploop", N, 0.0) == residual_coefficients("deeploop", N, 0.5)
    assert residual_coefficients("deepnorm", N, 0.0) == residual_coefficients("deepnorm", N, 0.25)
    assert residual_coefficients("deeploop", N, 0.25) == residual_coefficients("deepnorm", N)
    model = GPT(tiny(n_layer=1, n_loop=N, residual="deeploop", residual_exponent=p))
    assert (model.alpha, model.beta) == pytest.approx(((2 * N) ** p, (8 * N) ** -p))
    assert model.transformer.h[0].alpha == pytest.approx((2 * N) ** p)


def test_bad_residual_exponent_is_rejected():
    with pytest.raises(ValueError, match=r"^residual_exponent must be >= 0 \(0 = the scheme's own\), got -0.5$"):
        GPTConfig(residual="deeploop", residual_exponent=-0.5)
    for residual in ("preln", "postln"):
        message = (f"residual_exponent=0.5 only applies to deeploop and deepnorm, not {residual}; leave it at 0 or "
                   f"use --residual=deeploop")
        with pytest.raises(ValueError) as e:
            GPTConfig(residual=residual, residual_exponent=0.5)
        assert str(e.value) == message


def test_unknown_residual_is_rejected():
    with pytest.raises(ValueError, match="unknown residual scheme 'deepnet'"):
        GPTConfig(residual="deepnet")


@pytest.mark.parametrize("residual", ["deeploop", "deepnorm"])
def test_init_scales_v_out_and_mlp_by_beta_but_not_q_k(residual):
    # wide matrices so that the sample std is within ~1% of the true one
    cfg = dict(n_layer=2, n_loop=4, n_embd=256, n_head=4)
    torch.manual_seed(0)
    scaled = GPT(tiny(residual=residual, **cfg))
    torch.manual_seed(0)
    plain = GPT(tiny(residual="postln", **cfg))
    _, beta = residual_coefficients(residual, 8)
    C = 256
    for b_scaled, b_plain in zip(scaled.transformer.h, plain.transformer.h):
        pairs = {
            "q": (b_scaled.attn.c_attn.weight[:C], b_plain.attn.c_attn.weight[:C]),
            "k": (b_scaled.attn.c_attn.weight[C:2 * C], b_plain.attn.c_attn.weight[C:2 * C]),
            "v": (b_scaled.attn.c_attn.weight[2 * C:], b_plain.attn.c_attn.weight[2 * C:]),
            "attn.c_proj": (b_scaled.attn.c_proj.weight, b_plain.attn.c_proj.weight),
            "mlp.c_fc": (b_scaled.mlp.c_fc.weight, b_plain.mlp.c_fc.weight),
            "mlp.c_proj": (b_scaled.mlp.c_proj.weight, b_plain.mlp.c_proj.weight),
        }
        for name, (w, w0) in pairs.items():
            ratio = (w.std() / w0.std()).item()
            expected = 1.0 if name in ("q", "k") else beta
            assert ratio == pytest.approx(expected, rel=0.02), name


def test_preln_output_projections_use_gpt2_scaled_init_over_unrolled_depth():
    torch.manual_seed(0)
    model = GPT(tiny(residual="preln", n_layer=2, n_loop=8, n_embd=256, n_head=4))
    for block in model.transformer.h:
        assert block.mlp.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * 16), rel=0.02)
        assert block.mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.02)


@pytest.mark.parametrize("residual", RESIDUALS)
def test_parameter_count_does_not_depend_on_n_loop(residual):
    counts = {n_loop: GPT(tiny(residual=residual, n_loop=n_loop)).num_params() for n_loop in (1, 2, 8)}
    assert len(set(counts.values())) == 1, counts


def test_forward_visits_each_physical_block_n_loop_times_in_order():
    model = GPT(tiny(n_layer=3, n_loop=2))
    order = []
    for i, block in enumerate(model.transformer.h):
        block.register_forward_hook(lambda *_, i=i: order.append(i))
    model(torch.zeros(1, 4, dtype=torch.long))
    assert order == [0, 1, 2, 0, 1, 2]
    order.clear()
    model(torch.zeros(1, 4, dtype=torch.long), n_loop=3)
    assert order == [0, 1, 2] * 3


@pytest.mark.parametrize("residual", RESIDUALS)
def test_causality(residual):
    torch.manual_seed(0)
    model = GPT(tiny(residual=residual, n_loop=2)).eval()
    idx = torch.randint(0, 128, (1, 20))
    t = 11
    changed = idx.clone()
    changed[0, t] = (idx[0, t] + 1) % 128
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t], b[:, t])


@pytest.mark.parametrize("n_loop,override", [(1, None), (3, None), (3, 1), (2, 5)])
def test_cached_greedy_generation_equals_recomputing_the_context(n_loop, override):
    torch.manual_seed(1)
    model = GPT(tiny(n_loop=n_loop, block_size=16)).eval()
    prompt = torch.randint(0, 128, (2, 5))
    # 30 new tokens run the context well past block_size=16, where the window slides
    cached = model.generate(prompt, 30, top_k=1, n_loop=override)
    recomputed = model.generate(prompt, 30, top_k=1, n_loop=override, use_cache=False)
    assert cached.shape == (2, 35)
    assert torch.equal(cached, recomputed)
    # and the reference itself is what a plain argmax over full forwards gives
    idx = prompt
    for _ in range(30):
        logits, _ = model(idx[:, -16:], n_loop=override)
        idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(cached, idx)


def test_n_loop_override_changes_output_but_keeps_alpha():
    torch.manual_seed(0)
    model = GPT(tiny(n_loop=2)).eval()
    idx = torch.randint(0, 128, (1, 8))
    a, _ = model(idx)
    b, _ = model(idx, n_loop=4)
    assert not torch.allclose(a, b)
    assert model.transformer.h[0].alpha == pytest.approx(math.sqrt(2 * 4))


@pytest.mark.parametrize("residual", RESIDUALS)
def test_loss_at_init_is_near_uniform(residual):
    torch.manual_seed(0)
    model = GPT(tiny(residual=residual, n_loop=4, vocab_size=512))
    idx = torch.randint(0, 512, (4, 32))
    targets = torch.randint(0, 512, (4, 32))
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(512)) < 0.5


def test_gradients_finite_for_deeploop_at_unrolled_depth_96():
    torch.manual_seed(0)
    model = GPT(tiny(residual="deeploop", n_layer=2, n_loop=48))
    idx = torch.randint(0, 128, (2, 32))
    _, loss = model(idx, torch.roll(idx, -1, 1))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_loop_diagnostics_per_visit_gradients_sum_to_the_real_gradient():
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=2, n_loop=3))
    idx = torch.randint(0, 128, (2, 16))
    targets = torch.roll(idx, -1, 1)
    diag = model.loop_diagnostics(idx, targets)
    assert len(diag["residual_rms"]) == 6 and len(diag["grad_norm"]) == 2 and len(diag["grad_norm"][0]) == 3
    # Post-LN: every visit ends in a LayerNorm with unit gain and zero bias at init
    assert diag["residual_rms"] == pytest.approx([1.0] * 6, rel=1e-3)
    _, loss = model(idx, targets)
    loss.backward()
    for b, block in enumerate(model.transformer.h):
        total = torch.cat([p.grad.flatten() for p in block.parameters()]).norm().item()
        norms = diag["grad_norm"][b]
        # ||sum g_r||^2 = kappa * sum ||g_r||^2
        assert total ** 2 == pytest.approx(diag["kappa"][b] * sum(n ** 2 for n in norms), rel=1e-4)
        assert 0.0 <= diag["kappa"][b] <= 3.0 + 1e-6


def test_kappa_is_one_without_looping():
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=3, n_loop=1))
    idx = torch.randint(0, 128, (2, 16))
    assert model.loop_diagnostics(idx, torch.roll(idx, -1, 1))["kappa"] == pytest.approx([1.0] * 3)


def test_mfu_counts_flops_over_the_unrolled_depth():
    looped = GPT(tiny(n_layer=2, n_loop=4))
    untied = GPT(tiny(n_layer=8, n_loop=1))
    assert looped.num_params() < untied.num_params()
    # same unrolled depth, same matmuls per token
    assert looped.flops_per_token() == untied.flops_per_token()
    assert looped.estimate_mfu(1000, 1.0, 1e12) == pytest.approx(looped.flops_per_token() * 1000 / 1e12)
