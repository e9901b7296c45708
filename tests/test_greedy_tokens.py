"""Faster decoding samples the same tokens: 200 greedy tokens of two sequences in float32, cached and uncached at 2
and 3 loops and with adaptive exit (lab.decode, both cache layouts), equal those recorded from the generation of commit
7e378f4 (tests/fixtures/greedy_tokens.json, which this file writes when run as a script); and the uncached ones equal
a plain reference: the argmax of a forward pass with gradients on, through lm_head itself, over the cropped context."""

import copy
import json
import os

import pytest
import torch

from lab.decode import generate_stream
from model import GPT
from models import HUGINN, perturbed, tiny
from runtime import compile_decode_step

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "greedy_tokens.json")
# {arch: (seed, perturbation, exit threshold, settings)}: random models that greedy decoding does not send into a loop
# of a few tokens (18 to 29 distinct ones), whose top two logits stay at least 27 times further apart than cached and
# recomputed logits differ (rounding), and whose tokens exit at every loop count at their threshold. block_size 160:
# single-token cached steps up to position 160, then the window slides for the last 48 tokens.
ARCHS = {"preln": (2, 0.5, 0.3, dict(residual="preln")),
         "huginn-rope": (1, 0.3, 2.0, dict(residual="preln", position_encoding="rope", loop_input="concat", **HUGINN))}
PROMPT_LEN, NEW_TOKENS = 8, 200
CASES = ["loops2-cached", "loops2-uncached", "loops3-cached", "loops3-uncached", "exit-per_visit", "exit-last_loop"]
SECOND_PROCESS = True  # ~50 s of decoding and compiling, run beside the rest of the session (conftest.py)


def fixture_model(arch):
    """(model, prompt of 2 sequences, exit threshold)"""
    seed, scale, threshold, settings = ARCHS[arch]
    torch.manual_seed(seed)
    model = GPT(tiny(n_loop=2, block_size=160, vocab_size=512, n_embd=64, n_head=4, **settings))
    return perturbed(model, scale), torch.randint(0, 512, (2, PROMPT_LEN)), threshold


def greedy(model, prompt, threshold, case):
    """The new tokens of one case, a list per sequence."""
    kind, setting = case.split("-")
    with torch.no_grad():
        if kind == "exit":
            steps = generate_stream(model, prompt, NEW_TOKENS, top_k=1, n_loop=3, exit_threshold=threshold,
                                    kv_cache=setting)
        else:
            steps = model.generate_stream(prompt, NEW_TOKENS, top_k=1, n_loop=int(kind[-1]),
                                          use_cache=setting == "cached")
        return torch.cat(list(steps), dim=1).tolist()


def all_tokens():
    """{arch: {case: tokens}}: what the fixture holds."""
    tokens = {}
    for arch in ARCHS:
        model, prompt, threshold = fixture_model(arch)
        tokens[arch] = {case: greedy(model, prompt, threshold, case) for case in CASES}
    return tokens


@pytest.fixture(scope="module")
def recorded():
    with open(FIXTURE) as f:
        return json.load(f)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_those_recorded_before(arch, recorded):
    model, prompt, threshold = fixture_model(arch)
    for case in CASES:
        assert greedy(model, prompt, threshold, case) == recorded[arch][case], case


@pytest.mark.parametrize("arch", ARCHS)
def test_uncached_greedy_tokens_equal_the_argmax_of_a_training_mode_forward(arch, recorded):
    """The reference runs with gradients on, where generation's inference shortcuts do not apply."""
    model, prompt, _ = fixture_model(arch)
    for n_loop in (2, 3):
        idx = prompt
        for _ in range(NEW_TOKENS):
            logits, _ = model(idx[:, -model.config.block_size:], n_loop=n_loop)
            idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
        assert idx[:, PROMPT_LEN:].tolist() == recorded[arch][f"loops{n_loop}-uncached"], n_loop


def test_greedy_tokens_through_the_compiled_decode_step_equal_those_recorded_before(recorded):
    """runtime.compile_decode_step: the single-token steps of both sequences run one graph (autotuned, the weights
    frozen in); the prompt, the step that fills the cache and the refills of the sliding window after it run
    uncompiled."""
    model, prompt, _ = fixture_model("preln")  # the smaller graph: compiling costs about 20 s
    steps = model.generate_stream(prompt, NEW_TOKENS, top_k=1, n_loop=2, next_logits=compile_decode_step(model, 2))
    assert torch.cat(list(steps), dim=1).tolist() == recorded["preln"]["loops2-cached"]


if __name__ == "__main__":  # records the fixture: PYTHONPATH=. python tests/test_greedy_tokens.py
    torch.set_num_threads(1)  # as the tests run (conftest.py)
    with open(FIXTURE, "w") as f:
        json.dump(all_tokens(), f, separators=(",", ":"))


def test_the_packed_output_layer_lives_within_a_generation_step_and_follows_fused_adamw():
    """The packed copy of the output layer (GPT.packed_output_layer) is made at each generation's start and set for
    its steps only: a fused AdamW step, which changes the weight in place without a version bump, and an abandoned
    generation leave no stale copy for a no-grad forward (train.py's evaluations); greedy tokens after a step equal
    the argmax of a forward pass; it is no entry of state_dict, and the model deep-copies."""
    torch.manual_seed(0)
    model = GPT(tiny(vocab_size=512))
    idx = torch.randint(0, 512, (2, 6))
    keys = set(model.state_dict())
    optimizer = model.configure_optimizers(0.1, 0.1, (0.9, 0.95), "cpu")  # fused on a CPU, as train.py's
    next(model.generate_stream(idx, 3, top_k=1))  # a generation abandoned after its first token
    assert model.packed_head is None
    model(idx, idx)[1].backward()
    optimizer.step()
    with torch.no_grad():
        after = model(idx)[0]
    torch.testing.assert_close(after, model(idx)[0].detach(), rtol=0, atol=0)
    tokens = model.generate(idx, 1, top_k=1)[:, -1]
    assert torch.equal(tokens, after[:, -1].argmax(-1))
    assert set(model.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(copy.deepcopy(model)(idx)[0], model(idx)[0])
