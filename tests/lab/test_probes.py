"""probes.py: the visits' gradients and kappa_R, the linear probe, the stream probes that loop_diagnostics adds to
those numbers, and a batch too small to probe."""

import pytest
import torch

from lab.probes import linear_probe, loop_diagnostics, stream_probes, visit_diagnostics
from model import GPT
from models import HUGINN, tiny


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
    diag = loop_diagnostics(model, idx, torch.roll(idx, -1, 1))
    # the embedded input and, at init, every visit's output still tell the token and position apart
    assert diag["token_probe"] == [1.0] * 5 and diag["position_probe"] == [1.0] * 5
    # a Post-LN block whose last norm has no gain writes its bias, one vector for all positions: nothing to read
    model = GPT(tiny(n_layer=2, n_loop=2, residual="postln", vocab_size=16))
    with torch.no_grad():
        model.transformer.h[1].ln_2.weight.zero_()
        model.transformer.h[1].ln_2.bias.normal_()
    diag = loop_diagnostics(model, idx, torch.roll(idx, -1, 1))
    assert diag["token_probe"][:2] == [1.0, 1.0] and max(diag["token_probe"][2:]) < 0.2
    assert max(diag["position_probe"][2:]) < 0.2


def test_a_batch_of_one_sequence_gets_the_models_numbers_without_probes():
    """The probes fit on the first half of a batch's sequences and score on the second: one sequence has no second
    half. loop_diagnostics then records kappa, the gradient norms and the RMS alone, and stream_probes says why."""
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=2, n_loop=2))
    idx = torch.randint(0, 128, (1, 16))
    targets = torch.roll(idx, -1, 1)
    numbers = visit_diagnostics(model, idx, targets)
    streams = numbers.pop("streams")
    assert loop_diagnostics(model, idx, targets) == numbers
    assert set(numbers) == {"kappa", "grad_norm", "residual_rms"}
    with pytest.raises(ValueError) as error:
        stream_probes(streams, idx)
    assert str(error.value) == ("the stream probes fit on half of a batch's sequences and score on the other half: "
                                "they need a batch of 2 sequences or more")
    # two sequences are enough
    idx = torch.randint(0, 128, (2, 16))
    assert len(loop_diagnostics(model, idx, torch.roll(idx, -1, 1))["token_probe"]) == 5


@pytest.mark.parametrize("residual", ["deeploop", "preln_scaled"])
def test_loop_diagnostics_per_visit_gradients_sum_to_the_real_gradient(residual):
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=2, n_loop=3, residual=residual))
    idx = torch.randint(0, 128, (2, 16))
    targets = torch.roll(idx, -1, 1)
    diag = visit_diagnostics(model, idx, targets)
    assert len(diag["residual_rms"]) == 6 and len(diag["grad_norm"]) == 2 and len(diag["grad_norm"][0]) == 3
    # the streams the lab's probes read: the core's input, then every visit's output, whose RMS residual_rms holds
    assert set(diag) == {"kappa", "grad_norm", "residual_rms", "streams"} and len(diag["streams"]) == 7
    assert diag["residual_rms"] == [s.pow(2).mean().sqrt().item() for s in diag["streams"][1:]]
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
    assert visit_diagnostics(model, idx, torch.roll(idx, -1, 1))["kappa"] == pytest.approx([1.0] * 3)


@pytest.mark.parametrize("loop_input", ["none", "concat"])
def test_loop_diagnostics_cover_the_core_visits(loop_input):
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=2, n_loop=3, loop_input=loop_input, **HUGINN))
    idx = torch.randint(0, 128, (2, 16))
    targets = torch.roll(idx, -1, 1)
    diag = visit_diagnostics(model, idx, targets)
    assert len(diag["residual_rms"]) == 6 and len(diag["grad_norm"]) == 2 and len(diag["grad_norm"][0]) == 3
    model(idx, targets)[1].backward()
    for b, block in enumerate(model.transformer.h):
        total = torch.cat([p.grad.flatten() for p in block.parameters()]).norm().item()
        assert total ** 2 == pytest.approx(diag["kappa"][b] * sum(n ** 2 for n in diag["grad_norm"][b]), rel=1e-4)
