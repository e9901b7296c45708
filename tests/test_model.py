import math
import os

import numpy as np
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.func import functional_call
from torch.nn import functional as F

from model import (GPT, KV_CACHES, LOOP_INPUTS, LOOP_STREAM, MAX_LOOPS, GPTConfig, KVCache, NORMS,
                   POSITION_ENCODINGS, PRE_LN, RESIDUALS, TrainLoops, apply_rotary, branch_scale, linear_probe,
                   residual_coefficients)


def tiny(**kw):
    args = dict(block_size=32, vocab_size=128, n_layer=2, n_loop=1, n_head=2, n_embd=32, dropout=0.0, bias=True)
    args.update(kw)
    return GPTConfig(**args)


PAPER = dict(norm="rmsnorm", position_encoding="rope", norm_branch_input=True)  # the DeepLoop paper's backbone
# every backbone: both norms x both position encodings x both Post-LN block forms, and Pre-LN with each norm/position
BACKBONES = [dict(residual="deeploop", norm=n, position_encoding=p, norm_branch_input=b)
             for n in NORMS for p in POSITION_ENCODINGS for b in (False, True)] + \
            [dict(residual="preln", norm=n, position_encoding=p) for n in NORMS for p in POSITION_ENCODINGS] + \
            [dict(residual="preln_scaled")]


def backbone_id(backbone):
    return "-".join(str(v) for v in backbone.values())


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


@pytest.mark.parametrize("n_layer,n_loop,lam,epsilon", [(1, 1, 1.0, 1.0), (2, 1, 1.0, 2 ** -0.5),
                                                        (2, 4, 1.0, 2 ** -0.5 / 4), (4, 8, 2.0, 0.125),
                                                        (9, 3, 0.5, 1 / 18)])
def test_preln_scaled_multiplies_branches_by_lambda_over_loops_times_sqrt_layers(n_layer, n_loop, lam, epsilon):
    assert branch_scale("preln_scaled", n_layer, n_loop, lam) == pytest.approx(epsilon)
    for residual in ("deeploop", "deepnorm", "postln", "preln"):
        assert branch_scale(residual, n_layer, n_loop) == 1.0
    assert residual_coefficients("preln_scaled", n_layer * n_loop) == (1.0, 1.0)
    model = GPT(tiny(residual="preln_scaled", n_layer=n_layer, n_loop=n_loop, residual_lambda=lam))
    assert model.epsilon == model.transformer.h[-1].epsilon == pytest.approx(epsilon)


def test_preln_scaled_forward_is_gpt2_pre_ln_with_the_branches_times_epsilon():
    torch.manual_seed(0)
    model = GPT(tiny(residual="preln_scaled", n_layer=2, n_loop=3, residual_lambda=1.5)).eval()
    eps = 1.5 / (3 * math.sqrt(2))
    idx = torch.randint(0, 128, (2, 10))
    t = model.transformer
    x = t.wte(idx) + t.wpe(torch.arange(10))  # Pre-LN: no norm on the embedding
    for block in [*t.h] * 3:
        h = block.ln_1(x)
        q, k, v = (w.view(2, 10, 2, 16).transpose(1, 2) for w in block.attn.c_attn(h).split(32, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 10, 32)
        x = x + eps * block.attn.c_proj(y)
        x = x + eps * block.mlp.c_proj(F.gelu(block.mlp.c_fc(block.ln_2(x))))
    expected = model.lm_head(t.ln_f(x))
    assert torch.allclose(model(idx)[0], expected, atol=1e-5)
    # the depth lives in epsilon: unlike preln, the output projections keep GPT-2's plain std 0.02
    torch.manual_seed(0)
    wide = GPT(tiny(residual="preln_scaled", n_layer=2, n_loop=8, n_embd=256, n_head=4))
    assert wide.transformer.h[0].mlp.c_proj.weight.std().item() == pytest.approx(0.02, rel=0.02)


@pytest.mark.parametrize("residual,lam,message", [
    ("preln_scaled", -1.0, "residual_lambda must be a positive number (the paper's lambda, 1 by default), got -1.0"),
    ("preln_scaled", 0.0, "residual_lambda must be a positive number (the paper's lambda, 1 by default), got 0.0"),
    ("preln_scaled", math.inf, "residual_lambda must be a positive number (the paper's lambda, 1 by default), got inf"),
    ("preln", 2.0, "residual_lambda=2.0 only applies to preln_scaled, not preln; leave it at 1 or use "
                   "--residual=preln_scaled"),
])
def test_bad_residual_lambda_is_rejected(residual, lam, message):
    with pytest.raises(ValueError) as e:
        GPTConfig(residual=residual, residual_lambda=lam)
    assert str(e.value) == message


@pytest.mark.parametrize("backbone", [{}, PAPER], ids=["gpt2", "paper"])
@pytest.mark.parametrize("residual", ["deeploop", "deepnorm"])
def test_init_scales_v_out_and_mlp_by_beta_but_not_q_k(residual, backbone):
    # wide matrices so that the sample std is within ~1% of the true one
    cfg = dict(n_layer=2, n_loop=4, n_embd=256, n_head=4, **backbone)
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


@pytest.mark.parametrize("backbone", [{}, PAPER], ids=["gpt2", "paper"])
@pytest.mark.parametrize("residual", RESIDUALS)
def test_causality(residual, backbone):
    torch.manual_seed(0)
    model = GPT(tiny(residual=residual, n_loop=2, **backbone)).eval()
    idx = torch.randint(0, 128, (1, 20))
    t = 11
    changed = idx.clone()
    changed[0, t] = (idx[0, t] + 1) % 128
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t], b[:, t])


@pytest.mark.parametrize("backbone", BACKBONES, ids=backbone_id)
@pytest.mark.parametrize("n_loop,override", [(1, None), (3, None), (3, 1), (2, 5)])
def test_cached_greedy_generation_equals_recomputing_the_context(n_loop, override, backbone):
    torch.manual_seed(1)
    model = GPT(tiny(n_loop=n_loop, block_size=16, **backbone)).eval()
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


@pytest.mark.parametrize("residual", ["deeploop", "preln_scaled"])
def test_loop_diagnostics_per_visit_gradients_sum_to_the_real_gradient(residual):
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=2, n_loop=3, residual=residual))
    idx = torch.randint(0, 128, (2, 16))
    targets = torch.roll(idx, -1, 1)
    diag = model.loop_diagnostics(idx, targets)
    assert len(diag["residual_rms"]) == 6 and len(diag["grad_norm"]) == 2 and len(diag["grad_norm"][0]) == 3
    if residual == "deeploop":  # Post-LN: every visit ends in a LayerNorm with unit gain and zero bias at init
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


def test_flops_count_the_loops_a_step_ran_and_backward_over_the_tracked_loops_only():
    """A model built for 1 loop that runs 4 does the work of one built for 4; with backprop_loops, forward (a third
    of the cost: 2 FLOPs per parameter and token of 6) runs every loop, backward (4 of 6) the tracked ones."""
    one, four = GPT(tiny(n_layer=2, n_loop=1)), GPT(tiny(n_layer=2, n_loop=4))
    assert one.flops_per_token(4) == four.flops_per_token() == four.flops_per_token(4)
    assert one.estimate_mfu(1000, 1.0, 1e12, n_loop=4) == four.estimate_mfu(1000, 1.0, 1e12)
    per_loop = one.flops_per_token(2) - one.flops_per_token(1)  # the blocks' 6 x params + attention, per loop
    block_params = sum(p.numel() for p in one.transformer.h.parameters())
    assert per_loop == 6 * block_params + 12 * 2 * 32 * 32  # 2 blocks, width 32, 32 positions
    head = one.flops_per_token(1) - per_loop  # the output layer, forward and backward, in every step
    for loops, tracked in ((4, 1), (4, 3), (7, 2)):
        assert one.flops_per_token(loops, tracked) == head + per_loop * (loops + 2 * tracked) // 3
        assert four.estimate_mfu(1000, 1.0, 1e12, loops, tracked) == pytest.approx(
            one.flops_per_token(loops, tracked) * 1000 / 1e12)
    assert one.flops_per_token(4, 4) == one.flops_per_token(4, 9) == one.flops_per_token(4)  # every loop tracked


def test_decode_floor_counts_each_weight_once_and_the_cache_of_every_visit():
    model = GPT(tiny(n_layer=2, n_loop=3))  # width 32, vocabulary 128, with biases
    # two LayerNorms, the q/k/v matrix, the attention output, the MLP's two matrices
    block = 2 * 2 * 32 + (32 * 96 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32)
    head = 128 * 32  # the output layer, tied to the token embedding
    cache = 2 * 6 * 3 * 10 * 32  # keys and values, 6 visits, 3 sequences, 10 positions, width 32
    assert model.decode_step_bytes(3, 10, 4) == 4 * (2 * block + head + cache) == 164096
    # bfloat16, and 10 visits instead of 6
    assert model.decode_step_bytes(3, 10, 2, n_loop=5) == 2 * (2 * block + head + cache * 10 // 6)


def test_one_token_decode_step_attends_without_a_mask(monkeypatch):
    """After the prompt, each new token is one query that may see every cached key: no mask is built or passed, so
    that the fastest attention kernels stay eligible (any attn_mask rules out flash attention)."""
    model = GPT(tiny(n_loop=2)).eval()
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((q.size(2), k.size(2), attn_mask, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    model.generate(torch.zeros(1, 5, dtype=torch.long), 3, top_k=1)
    visits = 4  # 2 blocks x 2 loops
    assert calls == [(5, 5, None, True)] * visits + [(1, 6, None, False)] * visits + [(1, 7, None, False)] * visits


def test_kv_cache_fills_one_preallocated_buffer_per_visit():
    model = GPT(tiny(n_loop=2, block_size=16)).eval()
    cache = [KVCache() for _ in range(4)]
    model(torch.zeros(2, 5, dtype=torch.long), kv_cache=cache)
    buffers = [(c.k.data_ptr(), c.v.data_ptr()) for c in cache]
    assert all(c.past == 5 and c.k.shape == c.v.shape == (2, 2, 16, 16) for c in cache)
    for _ in range(3):
        model(torch.zeros(2, 1, dtype=torch.long), kv_cache=cache)
    assert all(c.past == 8 for c in cache)
    assert [(c.k.data_ptr(), c.v.data_ptr()) for c in cache] == buffers  # written in place, never regrown


def test_generation_never_samples_ids_at_or_above_vocab_size_limit():
    model = GPT(tiny()).eval()
    with torch.no_grad():
        model.transformer.h[-1].ln_2.bias.fill_(1.0)  # the last LayerNorm's output now sums to n_embd
        model.lm_head.weight[100:] = 1.0  # so that the padding ids win every step
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), 20, vocab_size_limit=100)
    assert out[:, 3:].max() < 100
    assert model.generate(torch.zeros(2, 3, dtype=torch.long), 5, top_k=1)[:, 3:].min() >= 100  # without the limit


def test_compiled_greedy_decode_equals_eager_with_a_few_graphs_for_any_length():
    """torch.compile on the whole forward (as sample.py and bench.py do) with the aot_eager backend, which traces and
    functionalizes like inductor but skips code generation: same tokens as eager, and the graph count does not grow
    with the number of tokens (the prompt, the decode step, the full-buffer decode, the sliding window)."""
    torch.manual_seed(3)
    model = GPT(tiny(n_loop=2, block_size=16)).eval()
    prompt = torch.randint(0, 128, (2, 5))
    eager = model.generate(prompt, 25, top_k=1)
    torch._dynamo.reset()
    counters["stats"].clear()
    model.compile(backend="aot_eager")
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            assert torch.equal(model.generate(prompt, 25, top_k=1), eager)  # 25 tokens: past block_size 16
            graphs = counters["stats"]["unique_graphs"]
            assert torch.equal(model.generate(prompt, 10, top_k=1), eager[:, :15])
        assert graphs <= 4 and counters["stats"]["unique_graphs"] == graphs
    finally:
        torch._dynamo.reset()


def test_from_checkpoint_reads_onto_the_cpu_then_moves_the_model(tmp_path):
    model = GPT(tiny())
    args = dict(block_size=32, vocab_size=128, n_layer=2, n_loop=1, n_head=2, n_embd=32, dropout=0.0, bias=True)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))[1].backward()
    optimizer.step()
    torch.save(dict(program="deeploop-train", model=model.state_dict(), model_args=args,
                    optimizer=optimizer.state_dict()), tmp_path / "ckpt.pt")
    # "meta" stands in for a GPU here: the model goes there, what the file held stays on the CPU
    loaded, ckpt = GPT.from_checkpoint(str(tmp_path / "ckpt.pt"), device="meta")
    assert {p.device.type for p in loaded.parameters()} == {"meta"}
    assert {t.device.type for state in ckpt["optimizer"]["state"].values() for t in state.values()} == {"cpu"}
    loaded, _ = GPT.from_checkpoint(str(tmp_path / "ckpt.pt"))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_from_checkpoint_raises_with_the_fix_in_the_message(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*ckpt.pt; train one with `python train.py "
                                                r"config/smoke_cpu.py` or set --out_dir"):
        GPT.from_checkpoint(path)
    with open(path, "w") as f:
        f.write("not a checkpoint")
    with pytest.raises(ValueError, match=r"ckpt.pt is not a readable checkpoint \(UnpicklingError\); point --out_dir"):
        GPT.from_checkpoint(path)
    torch.save({"a": 1}, path)
    with pytest.raises(ValueError, match="ckpt.pt was not written by this project's train.py"):
        GPT.from_checkpoint(path)


def test_model_module_imports_nothing_of_the_project_and_never_exits():
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model.py")) as f:
        source = f.read()
    imported = {line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert imported == {"contextlib", "inspect", "math", "os", "dataclasses", "numpy", "torch"}
    assert "exit(" not in source and "die(" not in source


@pytest.mark.parametrize("kw,message", [
    (dict(norm="batchnorm"), "unknown norm 'batchnorm'; choose one of layernorm, rmsnorm"),
    (dict(position_encoding="alibi"), "unknown position_encoding 'alibi'; choose one of learned, rope"),
    (dict(position_encoding="rope", n_embd=30, n_head=2), "rope rotates pairs of channels: the head size "
                                                          "n_embd/n_head=15 must be even"),
])
def test_bad_backbone_settings_are_rejected(kw, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        tiny(**kw)


def test_rope_scores_depend_only_on_the_distance_between_positions():
    model = GPT(tiny(position_encoding="rope", block_size=64, n_embd=64, n_head=2))
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 32).unbind(0)  # one head's query and key, (B, n_head, T, head_size)

    def score(m, n):
        rotated_q = apply_rotary(q, model.rope_cos[m:m + 1], model.rope_sin[m:m + 1])
        rotated_k = apply_rotary(k, model.rope_cos[n:n + 1], model.rope_sin[n:n + 1])
        return (rotated_q * rotated_k).sum().item()

    assert score(0, 0) == pytest.approx((q * k).sum().item(), rel=1e-6)  # position 0 is not rotated
    for m, n in [(5, 2), (40, 1), (17, 17)]:
        for shift in (1, 9, 63 - max(m, n)):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), rel=1e-4, abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)  # but the distance matters


def test_rope_model_sees_relative_positions_only():
    """The same tokens at positions [s, s + T) or [0, T) give the same attention output: no absolute position is
    stored anywhere (no wpe parameter, and the rotary tables are not in the state dict)."""
    torch.manual_seed(0)
    model = GPT(tiny(position_encoding="rope", **{k: v for k, v in PAPER.items() if k != "position_encoding"}))
    assert model.transformer.wpe is None
    assert not [k for k in model.state_dict() if "wpe" in k or "rope" in k]
    attn = model.transformer.h[0].attn
    with torch.no_grad():  # sharper attention than at init, where near-zero scores leave positions little to do
        attn.c_attn.weight[:64] *= 30
    x = torch.randn(2, 10, 32)
    at_start = attn(x, rope=model._rope(0, 10))
    shifted = attn(x, rope=model._rope(13, 10))
    torch.testing.assert_close(shifted, at_start, rtol=1e-3, atol=1e-7)
    assert (attn(x, rope=None) - at_start).abs().max() > 0.1 * at_start.abs().max()  # the rotation does something


@pytest.mark.parametrize("residual", RESIDUALS)
def test_rope_drops_only_the_position_embedding_from_the_counts(residual):
    learned = GPT(tiny(residual=residual))
    rope = GPT(tiny(residual=residual, position_encoding="rope"))
    assert rope.num_params(non_embedding=False) == learned.num_params(non_embedding=False) - 32 * 32
    assert rope.num_params() == learned.num_params()  # wpe is never counted in the default
    assert rope.flops_per_token() == learned.flops_per_token()


@pytest.mark.parametrize("residual", RESIDUALS)
def test_rmsnorm_replaces_every_layernorm(residual):
    torch.manual_seed(0)
    model = GPT(tiny(residual=residual, norm="rmsnorm", n_loop=2))
    assert not [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) == 2 * 2 + 1  # ln_1, ln_2 per block; ln_f (Pre-LN) or ln_e (Post-LN)
    assert all(norm.eps == 1e-5 and norm.weight.shape == (32,) for norm in norms)
    if residual not in PRE_LN:
        # a Post-LN stream leaves every visit with RMS 1 per position, and, unlike LayerNorm's, a non-zero mean
        x = model.transformer.h[0](model._embed(torch.randint(0, 128, (2, 16))))
        torch.testing.assert_close(x.pow(2).mean(-1), torch.ones(2, 16), rtol=1e-4, atol=1e-4)
        assert x.mean(-1).abs().max() > 1e-3


@pytest.mark.parametrize("norm", NORMS)
def test_branch_input_norms_exist_only_in_post_ln_and_start_as_identities(norm):
    """norm_branch_input adds a norm before each branch of a Post-LN block. The stream entering a block is already a
    norm's output, so at init (unit gains) the model computes what it computes without them; their gains then learn."""
    idx = torch.randint(0, 128, (2, 16))
    torch.manual_seed(0)
    plain = GPT(tiny(norm=norm, n_loop=2)).eval()
    torch.manual_seed(0)
    branched = GPT(tiny(norm=norm, n_loop=2, norm_branch_input=True)).eval()
    assert branched.num_params() == plain.num_params() + 2 * 2 * (32 if norm == "rmsnorm" else 64)
    torch.testing.assert_close(branched(idx)[0], plain(idx)[0], rtol=0, atol=1e-5)  # measured: 3e-7 apart
    with torch.no_grad():  # one gain changed: the outputs move by ~1e-3 (the branches are beta-scaled at init)
        branched.transformer.h[0].ln_mlp_input.weight.mul_(10.0)
    assert (branched(idx)[0] - plain(idx)[0]).abs().max() > 1e-4
    preln = GPT(tiny(norm=norm, residual="preln", norm_branch_input=True))
    assert preln.num_params() == GPT(tiny(norm=norm, residual="preln")).num_params()


def test_checkpoint_without_backbone_settings_loads_as_gpt2_blocks(tmp_path):
    """Checkpoints written before the backbone settings existed have no norm/position_encoding/norm_branch_input in
    model_args: they mean the defaults, which are the blocks those checkpoints hold."""
    torch.manual_seed(0)
    model = GPT(tiny(n_loop=2)).eval()
    old_args = dict(block_size=32, vocab_size=128, n_layer=2, n_loop=2, n_head=2, n_embd=32, dropout=0.0, bias=True,
                    residual="deeploop")
    torch.save(dict(program="deeploop-train", model=model.state_dict(), model_args=old_args), tmp_path / "ckpt.pt")
    loaded, _ = GPT.from_checkpoint(str(tmp_path / "ckpt.pt"))
    config = loaded.config
    assert (config.norm, config.position_encoding, config.norm_branch_input) == ("layernorm", "learned", False)
    idx = torch.randint(0, 128, (1, 12))
    assert torch.equal(loaded.eval()(idx)[0], model(idx)[0])


def test_coefficient_loops_sets_the_depth_of_alpha_and_beta():
    for loops, N in ((0, 2 * 3), (5, 2 * 5)):  # 0: n_loop
        model = GPT(tiny(n_layer=2, n_loop=3, coefficient_loops=loops))
        assert (model.alpha, model.beta) == pytest.approx((math.sqrt(2 * N), 1 / math.sqrt(8 * N)))
        preln = GPT(tiny(n_layer=2, n_loop=3, coefficient_loops=loops, residual="preln"))
        std = preln.transformer.h[0].mlp.c_proj.weight.std().item()
        assert std == pytest.approx(0.02 / math.sqrt(2 * N), rel=0.1)
    with pytest.raises(ValueError, match=r"^coefficient_loops must be from 0 \(= n_loop\) to 1024 \(model.MAX_LOOPS\), "
                                         r"got -1$"):
        tiny(coefficient_loops=-1)


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
    (lambda: tiny(n_loop=10 ** 12), f"n_loop must be a loop count from 1 to {MAX_LOOPS} (model.MAX_LOOPS), got "
                                     f"{10 ** 12}"),
    (lambda: tiny(coefficient_loops=MAX_LOOPS + 1),
     f"coefficient_loops must be from 0 (= n_loop) to {MAX_LOOPS} (model.MAX_LOOPS), got {MAX_LOOPS + 1}"),
    (lambda: TrainLoops("uniform", loop_min=1, loop_max=1000000000000),
     f"loop_sampling=uniform needs 1 <= loop_min <= loop_max <= {MAX_LOOPS} (model.MAX_LOOPS), got loop_min=1 "
     f"loop_max=1000000000000"),
    (lambda: TrainLoops("lognormal_poisson", loop_mean=float("1e400")),
     f"loop_sampling=lognormal_poisson needs 1 <= loop_mean <= {MAX_LOOPS} (model.MAX_LOOPS), got inf"),
    (lambda: GPT(tiny())(torch.zeros(1, 4, dtype=torch.long), n_loop=MAX_LOOPS + 1),
     f"n_loop must be a loop count from 1 to {MAX_LOOPS} (model.MAX_LOOPS), got {MAX_LOOPS + 1}"),
    (lambda: GPT(tiny()).generate(torch.zeros(1, 4, dtype=torch.long), 2, n_loop=-3),
     f"n_loop must be a loop count from 1 to {MAX_LOOPS} (model.MAX_LOOPS), got -3"),
])
def test_every_loop_count_is_bounded_by_max_loops(build, message):
    """A typo in a loop count would run a step that never ends (and that SIGTERM does not cut short), or grow the
    list of visits until memory runs out: every count a setting or a call can produce stops at MAX_LOOPS."""
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
    eager = model(idx, targets, n_loop=3)[1]
    torch._dynamo.reset()
    try:
        model.compile_blocks(backend=counting)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for n_loop in counts:
                model(idx, targets, n_loop=n_loop, backprop_loops=2)[1].backward()
            training = len(graphs)
            model.eval()
            with torch.no_grad():
                for n_loop in (1, 16, 40):
                    model(idx, targets, n_loop=n_loop)
            model.train()
            evaluation = len(graphs) - training
            for n_loop in counts[::-1]:
                model(idx, targets, n_loop=n_loop, backprop_loops=2)[1].backward()
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
    its own leaf copy of the weights (as loop_diagnostics does), so autograd hands back each visit's contribution;
    the truncated gradient of a block is the sum over the last k loops' visits, and nothing reaches the position
    embedding, which only the untracked first visits read."""
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=2, n_loop=2))
    idx = torch.randint(0, 128, (2, 16))
    targets = torch.roll(idx, -1, 1)
    R, k = 4, 1  # run at 4 loops, gradients through the last one
    model(idx, targets, n_loop=R, backprop_loops=k)[1].backward()

    x = model._embed(idx)
    visit_params = []
    for block in model._visits(R):
        params = {name: p.detach().requires_grad_() for name, p in block.named_parameters()}
        x = functional_call(block, params, (x, None, None))
        visit_params.append(params)
    loss = model._loss(model.lm_head(model.transformer.ln_f(x)), targets)
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
    model(idx, targets, n_loop=R, backprop_loops=R)[1].backward()
    full = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model(idx, targets, n_loop=R)[1].backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, full[name]), name


HUGINN = dict(n_prelude=1, n_coda=2)  # blocks run once before and after the looped core


@pytest.mark.parametrize("backbone", [{}, PAPER, dict(residual="preln")], ids=["gpt2", "paper", "preln"])
def test_defaults_are_the_plain_stack_bit_for_bit(backbone):
    """n_prelude = n_coda = 0 and loop_input none: the state dict holds only the embeddings, the looped blocks and
    the output layer, and the logits are, bit for bit, embed -> the blocks n_loop times -> ln_f -> lm_head."""
    torch.manual_seed(0)
    model = GPT(tiny(n_loop=3, **backbone)).eval()
    assert {k.split(".")[1] for k in model.state_dict() if k != "lm_head.weight"} <= {"wte", "wpe", "ln_e", "h", "ln_f"}
    t = model.transformer
    idx = torch.randint(0, 128, (2, 12))
    for loops in (3, 1, 5):
        x = t.wte(idx) + t.wpe(torch.arange(12)) if t.wpe is not None else t.wte(idx)
        x = t.ln_e(x)
        for block in [*t.h] * loops:
            x = block(x, None, model._rope(0, 12))
        assert torch.equal(model(idx, n_loop=loops)[0], model.lm_head(t.ln_f(x)))


@pytest.mark.parametrize("P,L,R,C", [(1, 2, 1, 1), (2, 4, 3, 2), (0, 2, 4, 1), (3, 1, 8, 0)])
def test_prelude_and_coda_count_once_in_the_depth_of_every_coefficient(P, L, R, C):
    N = P + L * R + C
    cfg = dict(n_layer=L, n_loop=R, n_prelude=P, n_coda=C)
    assert tiny(**cfg).unrolled_depth == N
    model = GPT(tiny(**cfg))
    assert (model.alpha, model.beta) == pytest.approx((math.sqrt(2 * N), 1 / math.sqrt(8 * N)))
    assert all(block.alpha == model.alpha for block in model._visits(1))
    # alpha and beta from coefficient_loops instead of n_loop: the prelude and coda still count once
    assert GPT(tiny(coefficient_loops=5, **cfg)).alpha == pytest.approx(math.sqrt(2 * (P + L * 5 + C)))
    # the rival's epsilon: every distinct block under the square root, the core's loops outside it
    rival = GPT(tiny(residual="preln_scaled", residual_lambda=2.0, **cfg))
    assert rival.epsilon == pytest.approx(2.0 / (R * math.sqrt(P + L + C)))
    assert all(block.epsilon == rival.epsilon for block in rival._visits(1))
    # Pre-LN's scaled init, in the prelude and coda blocks too (wide, so the sample std is near the true one)
    torch.manual_seed(0)
    preln = GPT(tiny(residual="preln", n_embd=256, n_head=4, **cfg))
    for block in preln._visits(1):
        assert block.mlp.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * N), rel=0.03)
    # DeepNorm's beta in every block
    torch.manual_seed(0)
    deep = GPT(tiny(residual="deepnorm", n_embd=256, n_head=4, **cfg))
    for block in deep._visits(1):
        assert block.mlp.c_fc.weight.std().item() == pytest.approx(0.02 * (8 * N) ** -0.25, rel=0.03)


@pytest.mark.parametrize("loop_input", LOOP_INPUTS)
@pytest.mark.parametrize("residual", ["deeploop", "preln"])
def test_parameter_count_with_a_prelude_and_coda_does_not_depend_on_n_loop(residual, loop_input):
    counts = {n_loop: GPT(tiny(residual=residual, n_loop=n_loop, loop_input=loop_input, **HUGINN)).num_params()
              for n_loop in (1, 2, 8)}
    assert len(set(counts.values())) == 1, counts
    block = 2 * 2 * 32 + (32 * 96 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32)
    injection = {"none": 0, "add": 0, "concat": 64 * 32 + 32}[loop_input]
    injection += 2 * 32 if loop_input != "none" and residual not in PRE_LN else 0  # its LayerNorm
    assert counts[1] == GPT(tiny(residual=residual)).num_params() + 3 * block + injection


def test_forward_runs_the_prelude_then_the_core_n_loop_times_then_the_coda():
    model = GPT(tiny(n_layer=2, n_loop=2, loop_input="add", **HUGINN))
    order = []
    t = model.transformer
    for name, blocks in (("p", t.prelude), ("h", t.h), ("c", t.coda)):
        for i, block in enumerate(blocks):
            block.register_forward_hook(lambda *_, tag=f"{name}{i}": order.append(tag))
    t.inject.register_forward_hook(lambda *_: order.append("in"))
    model(torch.zeros(1, 4, dtype=torch.long))
    assert order == ["p0", "h0", "h1", "in", "h0", "h1", "c0", "c1"]
    order.clear()
    model(torch.zeros(1, 4, dtype=torch.long), n_loop=3)  # test-time depth counts core loops
    assert order == ["p0", "h0", "h1", "in", "h0", "h1", "in", "h0", "h1", "c0", "c1"]


@pytest.mark.parametrize("loop_input", LOOP_INPUTS)
@pytest.mark.parametrize("backbone", [{}, PAPER, dict(residual="preln"), dict(residual="preln", **PAPER)],
                         ids=["gpt2", "paper", "preln", "preln-rope"])
def test_cached_generation_equals_recomputing_with_a_prelude_coda_and_loop_input(loop_input, backbone):
    torch.manual_seed(1)
    model = GPT(tiny(n_loop=2, block_size=16, loop_input=loop_input, **HUGINN, **backbone)).eval()
    with torch.no_grad():  # away from init, where concat's adapter ignores e
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompt = torch.randint(0, 128, (2, 5))
    for n_loop in (None, 3):
        cached = model.generate(prompt, 25, top_k=1, n_loop=n_loop)  # past block_size 16: the window slides
        assert torch.equal(cached, model.generate(prompt, 25, top_k=1, n_loop=n_loop, use_cache=False))
    cache = [KVCache() for _ in model._visits(3)]
    assert len(cache) == 1 + 2 * 3 + 2  # one entry per unrolled visit
    model(prompt, n_loop=3, kv_cache=cache)
    assert all(c.past == 5 for c in cache)
    assert model.decode_step_bytes(1, 10, 4, n_loop=3) - model.decode_step_bytes(1, 10, 4, n_loop=2) == \
        4 * 2 * 2 * 10 * 32  # the 2 visits of one more loop


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("residual", ["deeploop", "preln"])
def test_concat_at_init_passes_the_state_through(residual, norm):
    torch.manual_seed(0)
    model = GPT(tiny(residual=residual, norm=norm, n_loop=2, loop_input="concat", **HUGINN))
    adapter = model.transformer.inject.adapter
    assert torch.equal(adapter.weight, torch.cat((torch.eye(32), torch.zeros(32, 32)), dim=1))
    state, e = torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    if residual not in PRE_LN:  # a Post-LN state is a norm's output; the injection's own norm keeps it
        state = model.transformer.h[-1].ln_2(state)
    injected = model.transformer.inject(state, e)
    if residual in PRE_LN:
        assert torch.equal(injected, state)
    else:
        torch.testing.assert_close(injected, state, rtol=0, atol=1e-4)
    # and so the whole model at init computes what loop_input none computes with the same weights
    plain = GPT(tiny(residual=residual, norm=norm, n_loop=2, **HUGINN))
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "inject" not in k})
    idx = torch.randint(0, 128, (2, 12))
    torch.testing.assert_close(model(idx)[0], plain(idx)[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("loop_input", LOOP_INPUTS)
def test_backprop_loops_with_a_prelude_and_coda(loop_input):
    """Truncated backprop through the last k of R core loops, against a hand computation with a leaf copy of the
    core's weights per visit and of the embedded input e per loop: a core block gets the sum over the kept loops'
    visits; the prelude gets what the kept loops' reads of e send it, which is nothing with loop_input none (the
    first loop alone reads e, untracked): the prelude, position embedding and ln_e then learn nothing, as without a
    prelude. The coda, after the loops, gets its full gradient."""
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=2, n_loop=2, loop_input=loop_input, **HUGINN))
    with torch.no_grad():  # away from init, where concat's adapter ignores e
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    t = model.transformer
    idx = torch.randint(0, 128, (2, 16))
    targets = torch.roll(idx, -1, 1)
    R, k = 4, 2
    model(idx, targets, n_loop=R, backprop_loops=k)[1].backward()
    truncated = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad()
    model(idx, targets, n_loop=R)[1].backward()
    full = {name: p.grad for name, p in model.named_parameters()}

    e = t.prelude[0](model._embed(idx))
    x, reads, visit_params = None, [], []
    for r in range(R):
        reads.append(e.detach().requires_grad_())
        x = reads[r] if x is None else x if t.inject is None else t.inject(x, reads[r])
        for block in t.h:
            visit_params.append({name: p.detach().requires_grad_() for name, p in block.named_parameters()})
            x = functional_call(block, visit_params[-1], (x, None, None))
    loss = model._loss(model.lm_head(t.ln_f(model._run(t.coda, x, [None, None], None))), targets)
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


@pytest.mark.parametrize("loop_input", ["none", "concat"])
def test_loop_diagnostics_cover_the_core_visits(loop_input):
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=2, n_loop=3, loop_input=loop_input, **HUGINN))
    idx = torch.randint(0, 128, (2, 16))
    targets = torch.roll(idx, -1, 1)
    diag = model.loop_diagnostics(idx, targets)
    assert len(diag["residual_rms"]) == 6 and len(diag["grad_norm"]) == 2 and len(diag["grad_norm"][0]) == 3
    model(idx, targets)[1].backward()
    for b, block in enumerate(model.transformer.h):
        total = torch.cat([p.grad.flatten() for p in block.parameters()]).norm().item()
        assert total ** 2 == pytest.approx(diag["kappa"][b] * sum(n ** 2 for n in diag["grad_norm"][b]), rel=1e-4)


@pytest.mark.parametrize("kw,message", [
    (dict(n_prelude=-1), "n_prelude and n_coda must be >= 0 (0 = none), got n_prelude=-1 n_coda=0"),
    (dict(n_coda=-2), "n_prelude and n_coda must be >= 0 (0 = none), got n_prelude=0 n_coda=-2"),
    (dict(loop_input="gate"), "unknown loop_input 'gate'; choose one of none, add, concat"),
])
def test_bad_prelude_coda_and_loop_input_are_rejected(kw, message):
    with pytest.raises(ValueError) as e:
        tiny(**kw)
    assert str(e.value) == message


def test_linear_probe_reads_a_label_that_the_features_hold_and_not_one_they_do_not():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 24, (1024,), generator=g)
    fit = torch.arange(1024) < 512
    codes = torch.randn(24, 16, generator=g)  # 24 classes in 16 dimensions: not one-hot, still linearly apart
    holds = codes[labels] * 1e3 + 30 * torch.randn(1024, 16, generator=g)  # the scale does not matter
    assert linear_probe(holds, labels, fit) == 1.0
    # features independent of the labels: no better than the most frequent held-out label (chance is 1/24)
    unrelated = torch.randn(1024, 16, generator=g)
    assert linear_probe(unrelated, labels, fit) <= torch.bincount(labels[~fit]).max().item() / 512 + 0.02
    # a label that only the scored rows show is never predicted: it counts as missed
    labels[~fit] = 99
    assert linear_probe(holds, labels, fit) == 0.0


def test_loop_diagnostics_probe_what_the_stream_holds_after_each_visit():
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=2, n_loop=2, residual="preln", vocab_size=16))  # 16 tokens, 32 positions in 32 dims
    idx = torch.randint(0, 16, (16, 32))
    diag = model.loop_diagnostics(idx, torch.roll(idx, -1, 1))
    # the embedded input and, at init, every visit's output still tell the token and position apart
    assert diag["token_probe"] == [1.0] * 5 and diag["position_probe"] == [1.0] * 5
    # a Post-LN block whose last norm has no gain writes its bias, one vector for all positions: nothing to read
    model = GPT(tiny(n_layer=2, n_loop=2, residual="postln", vocab_size=16))
    with torch.no_grad():
        model.transformer.h[1].ln_2.weight.zero_()
        model.transformer.h[1].ln_2.bias.normal_()
    diag = model.loop_diagnostics(idx, torch.roll(idx, -1, 1))
    assert diag["token_probe"][:2] == [1.0, 1.0] and max(diag["token_probe"][2:]) < 0.2
    assert max(diag["position_probe"][2:]) < 0.2


def perturbed(model, scale=0.05):
    """The model moved away from init (where concat's adapter ignores e and Post-LN loops barely change the state)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model.eval()


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
        rope = model._rope(0, T)
        src = [{} for _ in range(T)]
        x = model._embed(torch.tensor([ids]))
        for i, block in enumerate(t.prelude):
            for w in range(T):
                src[w]["p", i] = x[0, w]
            x = block(x, None, rope)
        e = x

        def readout(state):
            inputs, x = [], state
            for block in t.coda:
                inputs.append(x)
                x = block(x, None, rope)
            logits = model.lm_head(t.ln_f(x))
            return logits, F.log_softmax(logits.float(), -1), inputs

        log_p = readout(e)[1]
        exits, state = [0] * T, None
        for r in range(1, max_loops + 1):
            x = model._loop_input(state, e)
            for b, block in enumerate(t.h):
                for w in range(T):
                    src[w]["h", r, b] = x[0, w]
                x = block(x, None, rope)
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
            block(torch.stack(sources)[None], cache, model._rope(0, u))  # the earlier positions' keys and values
            return block(x, cache, model._rope(u, 1))

        mine = {}
        x = model._embed(torch.tensor([[ids[u]]]), u)
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
            x = model._loop_input(state, e)
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
        out = model.generate(prompt, 11, top_k=1, n_loop=5, exit_threshold=threshold, kv_cache=kv_cache,
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
            logits, loss, used = model.exit_logits(idx, threshold, loops, targets)
            assert torch.equal(used, torch.full_like(idx, fixed))
            expected, expected_loss = model(idx, targets, n_loop=fixed)
            assert torch.equal(logits, expected) and torch.equal(loss, expected_loss)
    prompt = idx[:, :5]
    for kv_cache in KV_CACHES:
        used = []
        every = model.generate(prompt, 20, top_k=1, n_loop=4, exit_threshold=math.inf, kv_cache=kv_cache,
                               loops_used=used)
        assert torch.equal(every, model.generate(prompt, 20, top_k=1, n_loop=1))  # token for token, past block_size
        assert torch.equal(torch.stack(used), torch.ones(20, 2, dtype=torch.long))
    assert torch.equal(model.generate(prompt, 20, top_k=1, n_loop=3, exit_threshold=0.0),
                       model.generate(prompt, 20, top_k=1, n_loop=3))


@pytest.mark.parametrize("arch", EXIT_ARCHS, ids=list(EXIT_ARCHS))
def test_last_loop_cache_holds_one_entry_per_block_and_equals_per_visit_at_one_loop(arch):
    torch.manual_seed(4)
    model = perturbed(GPT(tiny(n_loop=2, block_size=16, **EXIT_ARCHS[arch])))
    prompt = torch.randint(0, 128, (2, 5))
    per_visit, last_loop = (model.generate(prompt, 25, top_k=1, n_loop=1, kv_cache=c) for c in KV_CACHES)
    assert torch.equal(per_visit, last_loop)
    torch.manual_seed(5)
    sampled = model.generate(prompt, 10, n_loop=1, kv_cache="last_loop")
    torch.manual_seed(5)
    assert torch.equal(sampled, model.generate(prompt, 10, n_loop=1))
    # memory: the buffers that a cache allocates, against kv_cache_bytes; last_loop's do not grow with n_loop
    cfg = model.config
    for n_loop in (1, 4):
        for kv_cache in KV_CACHES:
            cache = model.new_kv_cache(n_loop, kv_cache)
            with torch.no_grad():
                model(prompt, n_loop=n_loop, kv_cache=cache)
            stores = {id(c.store): c.store for c in cache}.values()
            allocated = sum(s.k.nbytes + s.v.nbytes for s in stores)
            assert allocated == model.kv_cache_bytes(2, cfg.block_size, 4, n_loop, kv_cache)
            entries = cfg.depth(n_loop) if kv_cache == "per_visit" else cfg.depth(1)
            assert len(stores) == entries
    # at 3 loops the prompt, whose positions run their loops together, is exact; a decoded token is not
    with torch.no_grad():
        steps = {}
        for kv_cache in KV_CACHES:
            cache = model.new_kv_cache(3, kv_cache)
            steps[kv_cache] = (model(prompt, n_loop=3, kv_cache=cache)[0], model(prompt[:, :1], n_loop=3,
                                                                               kv_cache=cache)[0])
        assert torch.equal(steps["per_visit"][0], steps["last_loop"][0])
        assert (steps["per_visit"][1] - steps["last_loop"][1]).abs().max() > 1e-3


GPT_LOOP = GPT.loop  # as model.py has it, whatever agree_after has patched


def agree_after(monkeypatch, m):
    """Make every GPT's loops agree after m loops: m an int, or a (T,) tensor, one count per position of a pass that
    starts at position 0. A loop leaves the state e + min(r, m) * d (d a fixed direction) in place of what its
    blocks computed (they still run on the state they get, and fill the cache), so the state, and with it p_r, is
    the same from loop m on: loop m + 1 is the first whose KL to its predecessor is 0."""
    count = [0]

    def loop(self, state, e, caches, rope):
        GPT_LOOP(self, state, e, caches, rope)
        count[0] = 1 if state is None else count[0] + 1
        steps = torch.as_tensor(m).clamp(max=count[0]).to(e.dtype)[..., None]
        direction = torch.randn(e.size(-1), generator=torch.Generator().manual_seed(0)).to(e.dtype)
        return e + steps * e.std() * direction

    monkeypatch.setattr(GPT, "loop", loop)


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
        _, _, loops = model.exit_logits(torch.randint(0, 128, (2, 12)), 1e-9, n_loop=8)
        assert torch.equal(loops, (settled + 1).expand(2, 12))
        loops = model.exit_logits(torch.randint(0, 128, (2, 12)), 1e-9, n_loop=3)[2]  # at most n_loop
        assert torch.equal(loops, (settled + 1).clamp(max=3).expand(2, 12))
    agree_after(monkeypatch, 3)
    used = []
    model.generate(torch.randint(0, 128, (2, 5)), 6, top_k=1, n_loop=8, exit_threshold=1e-9, loops_used=used)
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
            model.exit_logits(idx, **kw)
        assert str(e.value) == message
        with pytest.raises(ValueError) as e:
            model.generate(idx, 3, **kw)
        assert str(e.value) == message
    with pytest.raises(ValueError) as e:
        model.generate(idx, 3, kv_cache="last")
    assert str(e.value) == "unknown kv_cache 'last'; choose one of per_visit, last_loop"
    for kw in (dict(exit_threshold=1e-3), dict(kv_cache="last_loop")):
        with pytest.raises(ValueError) as e:
            model.generate(idx, 3, use_cache=False, **kw)
        assert str(e.value) == ("adaptive exit (exit_threshold > 0) and kv_cache=last_loop work on the KV cache: use "
                                "use_cache=True")
