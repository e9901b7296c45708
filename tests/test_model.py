import math
import os

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.nn import functional as F

from guard import load_checkpoint
from model import (CHOICES, GPT, MAX_LOOPS, PRE_LN, RESIDUALS, GPTConfig, KVCache, Rotary, branch_scale,
                   residual_coefficients)
from models import BACKBONES, HUGINN, HUGINN_BACKBONES, NO_CACHE, PAPER, backbone_id, perturbed, tiny

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def physical_blocks(model):
    """The blocks a model stores, in the order a pass first visits them: the prelude, the core, the coda."""
    t = model.transformer
    return [*t.prelude, *t.h, *t.coda]


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


@pytest.mark.parametrize("cached_loops", [1, 2, 4])
def test_forward_rejects_a_cache_made_for_another_loop_count(cached_loops):
    """A cache holds an entry per unrolled visit of the count it was made for: a pass through more visits would run
    blocks with no entry to read, one through fewer would hand the coda a core visit's entries."""
    model = GPT(tiny(n_loop=3, **HUGINN))
    idx = torch.zeros(1, 4, dtype=torch.long)
    depth = 1 + 2 * cached_loops + 2
    message = (f"a cache of {depth} visits for a pass through 9: make it with new_caches(n_loop) for the n_loop the "
               f"pass runs")
    for caches, n_loop in ((model.new_caches(cached_loops), None), ([KVCache() for _ in range(depth)], 3)):
        with pytest.raises(ValueError) as e:
            model(idx, n_loop=n_loop, caches=caches)
        assert str(e.value) == message


def test_kv_cache_fills_one_preallocated_buffer_per_visit():
    model = GPT(tiny(n_loop=2, block_size=16)).eval()
    cache = [KVCache() for _ in range(4)]
    model(torch.zeros(2, 5, dtype=torch.long), caches=cache)
    buffers = [(c.k.data_ptr(), c.v.data_ptr()) for c in cache]
    assert all(c.past == 5 and c.k.shape == c.v.shape == (2, 2, 16, 16) for c in cache)
    for _ in range(3):
        model(torch.zeros(2, 1, dtype=torch.long), caches=cache)
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


def test_load_checkpoint_reads_onto_the_cpu_then_moves_the_model(tmp_path):
    model = GPT(tiny())
    args = dict(block_size=32, vocab_size=128, n_layer=2, n_loop=1, n_head=2, n_embd=32, dropout=0.0, bias=True)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))[1].backward()
    optimizer.step()
    torch.save(dict(program="deeploop-train", model=model.state_dict(), model_args=args,
                    optimizer=optimizer.state_dict()), tmp_path / "ckpt.pt")
    # "meta" stands in for a GPU here: the model goes there, what the file held stays on the CPU
    loaded, ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"), device="meta")
    assert {p.device.type for p in loaded.parameters()} == {"meta"}
    assert {t.device.type for state in ckpt["optimizer"]["state"].values() for t in state.values()} == {"cpu"}
    loaded, _ = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_load_checkpoint_raises_with_the_fix_in_the_message(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*ckpt.pt; train one with `python train.py "
                                                r"config/smoke_cpu.py` or set --out_dir"):
        load_checkpoint(path)
    with open(path, "w") as f:
        f.write("not a checkpoint")
    with pytest.raises(ValueError, match=r"ckpt.pt is not a readable checkpoint \(UnpicklingError\); point --out_dir"):
        load_checkpoint(path)
    torch.save({"a": 1}, path)
    with pytest.raises(ValueError, match="ckpt.pt was not written by this project's train.py"):
        load_checkpoint(path)
    torch.save(dict(program="deeploop-train", weights=torch.zeros(10000)), path)
    with open(path, "rb") as f:
        whole = f.read()
    for cut in (len(whole) // 2, len(whole) - 100):  # a copy cut short: torch raises an OSError, a RuntimeError
        with open(path, "wb") as f:
            f.write(whole[:cut])
        with pytest.raises(ValueError, match=r"ckpt.pt is damaged: a checkpoint that does not load whole \(\w+\), cut "
                                             r"short or corrupted after it was written, e.g. by an interrupted copy; "
                                             r"copy it again from where it came from$"):
            load_checkpoint(path)


@pytest.mark.parametrize("name", ["plain", "huginn"])
def test_checkpoints_written_before_the_lab_split_compute_what_they_computed_then(name):
    """tests/fixtures: two checkpoints of train.py from before the model was split into the lesson and the lab, and
    the outputs that model computed from them: the logits at three loop counts, and greedy samples of 40 tokens that
    run past block_size 32 (the window slides). Today's model computes the same greedy tokens, and the same logits
    within float32 rounding: bit for bit on the CPU that wrote them, up to 7e-9 (of 0.33) on a Zen 3, whose kernels
    sum in another order."""
    expected = torch.load(os.path.join(FIXTURES, "outputs_before_lab.pt"), weights_only=True)[name]
    model, _ = load_checkpoint(os.path.join(FIXTURES, f"ckpt_{name}_before_lab.pt"))
    model.eval()
    idx = expected["idx"]
    assert len(expected["logits"]) == 3 and len(expected["greedy"]) == 2
    with torch.no_grad():
        for n_loop, logits in expected["logits"].items():
            torch.testing.assert_close(model(idx, n_loop=n_loop)[0], logits, rtol=0, atol=1e-6,
                                       msg=lambda m: f"n_loop={n_loop}: {m}")
    for n_loop, greedy in expected["greedy"].items():
        assert torch.equal(model.generate(idx[:1, :5], 40, top_k=1, n_loop=n_loop), greedy), n_loop


def test_model_module_imports_nothing_of_the_project_and_never_exits():
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model.py")) as f:
        source = f.read()
    imported = {line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert imported == {"inspect", "itertools", "math", "dataclasses", "torch"}
    assert "exit(" not in source and "die(" not in source


@pytest.mark.parametrize("kw,message", [
    (dict(norm="batchnorm"), "unknown norm 'batchnorm'; choose one of layernorm, rmsnorm"),
    (dict(position_encoding="alibi"), "unknown position_encoding 'alibi'; choose one of learned, rope"),
    (dict(position_encoding="rope", n_embd=30, n_head=2), "rope rotates pairs of channels: the head size "
                                                          "n_embd/n_head=15 must be even"),
    (dict(block_size=0), "block_size=0: sizes must be >= 1"),  # accepted, it trained on to a nan loss
    (dict(vocab_size=0, n_embd=0), "vocab_size=0, n_embd=0: sizes must be >= 1"),
])
def test_bad_backbone_settings_are_rejected(kw, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        tiny(**kw)


def test_rope_scores_depend_only_on_the_distance_between_positions():
    model = GPT(tiny(position_encoding="rope", block_size=64, n_embd=64, n_head=2))
    rotary = model.transformer.h[0].attn.rotary
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 32).unbind(0)  # one head's query and key, (B, n_head, T, head_size)

    def score(m, n):
        return (rotary(q, m) * rotary(k, n)).sum().item()

    assert score(0, 0) == pytest.approx((q * k).sum().item(), rel=1e-6)  # position 0 is not rotated
    for m, n in [(5, 2), (40, 1), (17, 17)]:
        for shift in (1, 9, 63 - max(m, n)):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), rel=1e-4, abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)  # but the distance matters


def test_rope_model_sees_relative_positions_only(monkeypatch):
    """The same tokens at positions [s, s + T) or [0, T) give the same attention output: no absolute position is
    stored anywhere (no wpe parameter, and the rotary tables are not in the state dict). A pass without a cache starts
    at position 0; the shifted one turns q and k as for positions from 13 on."""
    torch.manual_seed(0)
    model = GPT(tiny(position_encoding="rope", **{k: v for k, v in PAPER.items() if k != "position_encoding"}))
    assert model.transformer.wpe is None
    assert not [k for k in model.state_dict() if "wpe" in k or "rotary" in k]
    attn = model.transformer.h[0].attn
    rotary = attn.rotary
    with torch.no_grad():  # sharper attention than at init, where near-zero scores leave positions little to do
        attn.c_attn.weight[:64] *= 30
    x = torch.randn(2, 10, 32)
    at_start = attn(x)
    with monkeypatch.context() as patch:
        patch.setattr(rotary, "forward", lambda t, start: Rotary.forward(rotary, t, start + 13))
        shifted = attn(x)
    torch.testing.assert_close(shifted, at_start, rtol=1e-3, atol=1e-7)
    with monkeypatch.context() as patch:
        patch.setattr(attn, "rotary", None)
        unrotated = attn(x)
    assert (unrotated - at_start).abs().max() > 0.1 * at_start.abs().max()  # the rotation does something


@pytest.mark.parametrize("residual", RESIDUALS)
def test_rope_drops_only_the_position_embedding_from_the_counts(residual):
    learned = GPT(tiny(residual=residual))
    rope = GPT(tiny(residual=residual, position_encoding="rope"))
    assert rope.num_params(non_embedding=False) == learned.num_params(non_embedding=False) - 32 * 32
    assert rope.num_params() == learned.num_params()  # wpe is never counted in the default


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
        x = model.transformer.h[0](model.embed(torch.randint(0, 128, (2, 16)), 0, NO_CACHE))
        torch.testing.assert_close(x.pow(2).mean(-1), torch.ones(2, 16), rtol=1e-4, atol=1e-4)
        assert x.mean(-1).abs().max() > 1e-3


@pytest.mark.parametrize("norm", CHOICES["norm"])
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
    loaded, _ = load_checkpoint(str(tmp_path / "ckpt.pt"))
    config = loaded.config
    assert (config.norm, config.position_encoding, config.norm_branch_input) == ("layernorm", "learned", False)
    idx = torch.randint(0, 128, (1, 12))
    assert torch.equal(loaded.eval()(idx)[0], model(idx)[0])


def test_coefficient_loops_sets_the_depth_of_alpha_and_beta():
    for loops, N in ((0, 2 * 3), (5, 2 * 5)):  # 0: n_loop
        model = GPT(tiny(n_layer=2, n_loop=3, coefficient_loops=loops))
        assert (model.config.coefficient_depth, model.config.unrolled_depth) == (N, 6)
        assert (model.alpha, model.beta) == pytest.approx((math.sqrt(2 * N), 1 / math.sqrt(8 * N)))
        preln = GPT(tiny(n_layer=2, n_loop=3, coefficient_loops=loops, residual="preln"))
        std = preln.transformer.h[0].mlp.c_proj.weight.std().item()
        assert std == pytest.approx(0.02 / math.sqrt(2 * N), rel=0.1)
    with pytest.raises(ValueError, match=r"^coefficient_loops must be from 0 \(= n_loop\) to 1024 \(model.MAX_LOOPS\), "
                                         r"got -1$"):
        tiny(coefficient_loops=-1)


@pytest.mark.parametrize("build,message", [
    (lambda: tiny(n_loop=10 ** 12), f"n_loop must be a loop count from 1 to {MAX_LOOPS} (model.MAX_LOOPS), got "
                                     f"{10 ** 12}"),
    (lambda: tiny(coefficient_loops=MAX_LOOPS + 1),
     f"coefficient_loops must be from 0 (= n_loop) to {MAX_LOOPS} (model.MAX_LOOPS), got {MAX_LOOPS + 1}"),
    (lambda: GPT(tiny())(torch.zeros(1, 4, dtype=torch.long), n_loop=MAX_LOOPS + 1),
     f"n_loop must be a loop count from 1 to {MAX_LOOPS} (model.MAX_LOOPS), got {MAX_LOOPS + 1}"),
    (lambda: GPT(tiny()).generate(torch.zeros(1, 4, dtype=torch.long), 2, n_loop=-3),
     f"n_loop must be a loop count from 1 to {MAX_LOOPS} (model.MAX_LOOPS), got -3"),
])
def test_every_loop_count_is_bounded_by_max_loops(build, message):
    """A typo in a loop count would run a step that never ends (and that SIGTERM does not cut short), or grow the
    list of visits until memory runs out: every count a setting or a call can produce stops at MAX_LOOPS (the
    training loop draws: tests/lab/test_loops.py)."""
    with pytest.raises(ValueError) as error:
        build()
    assert str(error.value) == message


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
            x = block(x, None)
        assert torch.equal(model(idx, n_loop=loops)[0], model.lm_head(t.ln_f(x)))


@pytest.mark.parametrize("P,L,R,C", [(1, 2, 1, 1), (2, 4, 3, 2), (0, 2, 4, 1), (3, 1, 8, 0)])
def test_prelude_and_coda_count_once_in_the_depth_of_every_coefficient(P, L, R, C):
    N = P + L * R + C
    cfg = dict(n_layer=L, n_loop=R, n_prelude=P, n_coda=C)
    assert tiny(**cfg).unrolled_depth == N
    model = GPT(tiny(**cfg))
    assert (model.alpha, model.beta) == pytest.approx((math.sqrt(2 * N), 1 / math.sqrt(8 * N)))
    assert all(block.alpha == model.alpha for block in physical_blocks(model))
    # alpha and beta from coefficient_loops instead of n_loop: the prelude and coda still count once
    assert GPT(tiny(coefficient_loops=5, **cfg)).alpha == pytest.approx(math.sqrt(2 * (P + L * 5 + C)))
    # the rival's epsilon: every distinct block under the square root, the core's loops outside it
    rival = GPT(tiny(residual="preln_scaled", residual_lambda=2.0, **cfg))
    assert rival.epsilon == pytest.approx(2.0 / (R * math.sqrt(P + L + C)))
    assert all(block.epsilon == rival.epsilon for block in physical_blocks(rival))
    # Pre-LN's scaled init, in the prelude and coda blocks too (wide, so the sample std is near the true one)
    torch.manual_seed(0)
    preln = GPT(tiny(residual="preln", n_embd=256, n_head=4, **cfg))
    for block in physical_blocks(preln):
        assert block.mlp.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * N), rel=0.03)
    # DeepNorm's beta in every block
    torch.manual_seed(0)
    deep = GPT(tiny(residual="deepnorm", n_embd=256, n_head=4, **cfg))
    for block in physical_blocks(deep):
        assert block.mlp.c_fc.weight.std().item() == pytest.approx(0.02 * (8 * N) ** -0.25, rel=0.03)


@pytest.mark.parametrize("loop_input", CHOICES["loop_input"])
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


@pytest.mark.parametrize("loop_input", CHOICES["loop_input"])
@pytest.mark.parametrize("backbone", HUGINN_BACKBONES.values(), ids=list(HUGINN_BACKBONES))
def test_cached_generation_equals_recomputing_with_a_prelude_coda_and_loop_input(loop_input, backbone):
    torch.manual_seed(1)
    model = perturbed(GPT(tiny(n_loop=2, block_size=16, loop_input=loop_input, **HUGINN, **backbone)))
    prompt = torch.randint(0, 128, (2, 5))
    for n_loop in (None, 3):
        cached = model.generate(prompt, 25, top_k=1, n_loop=n_loop)  # past block_size 16: the window slides
        assert torch.equal(cached, model.generate(prompt, 25, top_k=1, n_loop=n_loop, use_cache=False))
    cache = model.new_caches(3)
    assert len(cache) == 1 + 2 * 3 + 2  # one entry per unrolled visit
    model(prompt, n_loop=3, caches=cache)
    assert all(c.past == 5 for c in cache)


@pytest.mark.parametrize("norm", CHOICES["norm"])
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


@pytest.mark.parametrize("kw,message", [
    (dict(n_prelude=-1), "n_prelude and n_coda must be >= 0 (0 = none), got n_prelude=-1 n_coda=0"),
    (dict(n_coda=-2), "n_prelude and n_coda must be >= 0 (0 = none), got n_prelude=0 n_coda=-2"),
    (dict(loop_input="gate"), "unknown loop_input 'gate'; choose one of none, add, concat"),
])
def test_bad_prelude_coda_and_loop_input_are_rejected(kw, message):
    with pytest.raises(ValueError) as e:
        tiny(**kw)
    assert str(e.value) == message


@pytest.mark.parametrize("residual", ["postln", "preln", "deeploop", "deepnorm"])
def test_blocks_compute_what_pytorchs_transformer_encoder_layer_computes_with_the_same_weights(residual):
    """A peer check of the blocks: nn.TransformerEncoderLayer (norm_first=False: Post-LN, True: Pre-LN; causal mask,
    exact GELU, no dropout) loaded with a block's weights gives its output within float32 rounding. PyTorch's layer
    has no alpha; a LayerNorm does not see the scale of its input but through eps, so Norm(alpha x + f(x)) is the
    layer's Norm(x + f(x) / alpha) with the branch outputs divided by alpha."""
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=2, n_loop=3, n_head=4, n_embd=32, residual=residual))
    block = model.transformer.h[1]
    with torch.no_grad():  # gains, biases and projections away from their init, so every weight shows
        for p in block.parameters():
            p.add_(0.05 * torch.randn_like(p))
    alpha = 1.0 if residual in PRE_LN else block.alpha
    assert (alpha == 1.0) == (residual in ("postln", "preln"))
    peer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=128, dropout=0.0, activation="gelu",
                                            batch_first=True, norm_first=residual in PRE_LN).eval()
    with torch.no_grad():
        peer.self_attn.in_proj_weight.copy_(block.attn.c_attn.weight)
        peer.self_attn.in_proj_bias.copy_(block.attn.c_attn.bias)
        peer.linear1.weight.copy_(block.mlp.c_fc.weight)
        peer.linear1.bias.copy_(block.mlp.c_fc.bias)
        for mine, theirs in ((block.attn.c_proj, peer.self_attn.out_proj), (block.mlp.c_proj, peer.linear2)):
            theirs.weight.copy_(mine.weight / alpha)
            theirs.bias.copy_(mine.bias / alpha)
        for mine, theirs in ((block.ln_1, peer.norm1), (block.ln_2, peer.norm2)):
            theirs.weight.copy_(mine.weight)
            theirs.bias.copy_(mine.bias)
    x = torch.randn(3, 16, 32)
    if residual not in PRE_LN:
        x = F.layer_norm(x, (32,))  # a Post-LN block reads a normalized stream
    mask = torch.nn.Transformer.generate_square_subsequent_mask(16)
    with torch.no_grad():
        expected = peer(x, src_mask=mask, is_causal=True)
        got = block(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5 if alpha == 1.0 else 1e-4)
    assert (got - x).abs().max() > 0.1  # the block did change its input
