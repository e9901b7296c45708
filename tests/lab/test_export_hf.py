"""lab/export_hf.py: the exported folders as transformers loads them (the looped model's logits and generations equal
the project's own, the plain GPT-2's logits too, the tokenizers give the project's ids), the harness's hf backend on
the export scores as eval_downstream does, the upload through huggingface_hub to a local hub (tests/hub_server.py),
and bad input as one line."""

import importlib
import json
import os
import signal
import socket
import time
from dataclasses import asdict

import pytest
import torch
from torch.nn import functional as F

import lab.export_hf as export_hf
from dataset import get_tokenizer
from hub_server import CurrentStderr, Hub
from model import GPT, GPTConfig, RESIDUALS
from models import learned_by_heart
from scripts import ROOT, Started, run_script

SENTENCE = "a quick brown fox jumps over lazy dogs."  # what the trained fixture model knows by heart
BYTES = get_tokenizer("bytes")
SCRIPT = "lab/export_hf.py"


def save_checkpoint(model, out_dir, tokenizer="bytes", val_losses=()):
    """A checkpoint in train.py's format at step 300, and a metrics.jsonl with evaluations {step: val loss}."""
    os.makedirs(out_dir, exist_ok=True)
    torch.save(dict(model=model.state_dict(), model_args=asdict(model.config), tokenizer=tokenizer, optimizer={},
                    scaler=None, iter_num=300, best_val_loss=2.5, evaluated=True, rng=None, program="deeploop-train",
                    config=dict(out_dir=str(out_dir), dataset="builtin_bytes", loop_sampling="fixed")),
               os.path.join(out_dir, "ckpt.pt"))
    if val_losses:
        with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
            for step, loss in val_losses:
                f.write(json.dumps(dict(type="eval", iter=step, val_loss=loss)) + "\n")
                f.write(json.dumps(dict(type="train", iter=step, loss=loss + 1)) + "\n")
    return str(out_dir)


def random_gpt(seed=0, **settings):
    torch.manual_seed(seed)
    config = dict(block_size=16, vocab_size=320, n_layer=2, n_loop=2, n_head=2, n_embd=32)
    return GPT(GPTConfig(**{**config, **settings})).eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A looped GPT (1 block x 2 loops, bytes, block_size 48) that has SENTENCE by heart, as a checkpoint with a
    metrics.jsonl -> (out_dir, model)."""
    model = learned_by_heart(BYTES.encode_ordinary(SENTENCE), block_size=48)
    out_dir = save_checkpoint(model, tmp_path_factory.mktemp("trained"), val_losses=[(0, 5.7), (300, 1.2345)])
    return out_dir, model


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """The trained checkpoint exported by the script (looped, remote code) -> its folder."""
    out_dir, _ = trained
    to = tmp_path_factory.mktemp("exports") / "tiny"
    r = run_script(SCRIPT, f"--out_dir={out_dir}", f"--to={to}")
    assert r.returncode == 0, r.stderr
    return str(to)


def load(folder, **kw):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kw).eval()


def export_looped(model, folder, loops=None, n_vocab=257):
    """The looped model's config, weights and code, as the script writes them (no tokenizer, card or check)."""
    os.makedirs(folder)
    export_hf.write_looped(model, str(folder), loops or model.config.n_loop, n_vocab, n_vocab - 1)
    return str(folder)


def logits_difference(hf_model, model, idx, n_vocab=257, **kw):
    with torch.no_grad():
        got = hf_model(idx, **kw).logits
        expected, _ = model(idx, **kw)
    assert got.shape == (*idx.shape, n_vocab)
    return (got - expected[..., :n_vocab]).abs().max().item()


# ---------------------------------------------------------------------------------------------------------------
# the looped model: one definition (model.py), the same numbers

LAYOUTS = {"plain": {}, "prelude+coda, concat": dict(n_prelude=1, n_coda=1, loop_input="concat"),
           "add": dict(loop_input="add")}
BACKBONES = {"layernorm, learned": {}, "rmsnorm, rope, normed branches": dict(norm="rmsnorm", position_encoding="rope",
                                                                           norm_branch_input=True)}


@pytest.mark.parametrize("residual", RESIDUALS)
def test_logits_equal_the_projects_for_every_scheme_backbone_and_layout(tmp_path, residual):
    """float32, at the trained loop count and at another one given to the call; the project's forward is model.py's
    own, so the difference is 0 here (at most 1e-5 is what an export may have)."""
    idx = torch.randint(257, (2, 16), generator=torch.Generator().manual_seed(1))
    for b, backbone in BACKBONES.items():
        for l, layout in LAYOUTS.items():
            extra = dict(residual_lambda=0.7) if residual == "preln_scaled" else {}
            model = random_gpt(**backbone, **layout, **extra, residual=residual)
            hf_model = load(export_looped(model, tmp_path / f"{b}-{l}".replace(" ", "").replace(",", "_")))
            assert type(hf_model).__name__ == "DeepLoopForCausalLM"
            assert logits_difference(hf_model, model, idx) <= 1e-5, (b, l)
            assert logits_difference(hf_model, model, idx, n_loop=3) <= 1e-5, (b, l)


def test_config_is_every_setting_and_n_loop_changes_depth_not_coefficients(tmp_path):
    model = random_gpt(residual="deeploop", n_prelude=1, loop_input="add")
    folder = export_looped(model, tmp_path / "m")
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert {k: v for k, v in config.items() if k in asdict(model.config)} == dict(
        asdict(model.config), vocab_size=257, coefficient_loops=2)
    assert config["auto_map"] == {"AutoConfig": "configuration_deeploop.DeepLoopConfig",
                                  "AutoModelForCausalLM": "modeling_deeploop.DeepLoopForCausalLM"}
    assert (config["n_loop_trained"], config["eos_token_id"], config["dtype"]) == (2, 256, "float32")
    assert sorted(os.listdir(folder)) == ["config.json", "configuration_deeploop.py", "model.py", "model.safetensors",
                                         "modeling_deeploop.py"]
    with open(os.path.join(folder, "model.py")) as f, open(os.path.join(ROOT, "model.py")) as g:
        assert f.read() == g.read()  # the project's model itself, no copy of its own
    idx = torch.randint(257, (1, 12), generator=torch.Generator().manual_seed(2))
    deeper = load(folder, n_loop=4)
    assert deeper.gpt.alpha == model.alpha and deeper.config.n_loop == 4
    assert logits_difference(deeper, model, idx, n_loop=4) == 0
    assert logits_difference(deeper, model, idx, n_loop=1) == 0  # a call's count overrides the config's


def test_loss_is_the_projects_over_the_tokenizers_ids_and_bad_inputs_are_refused(tmp_path):
    """transformers' labels (each predicted from the positions before it, -100 not scored) give the project's loss,
    with the softmax over the tokenizer's ids (the padding ids are not in the export)."""
    model = random_gpt()
    hf_model = load(export_looped(model, tmp_path / "m"))
    idx = torch.randint(257, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = idx.clone()
    labels[0, 5] = -100
    targets = labels[:, 1:].clone()
    targets[targets == -100] = -1
    with torch.no_grad():
        logits, _ = model(idx[:, :-1])
        expected = F.cross_entropy(logits[..., :257].flatten(0, 1), targets.flatten(), ignore_index=-1)
        loss = hf_model(idx, labels=labels).loss
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    rule = ("this model reads no attention mask, so padding may only end a row, with no token after it: a forward "
            "pass takes right-padded rows, but generate() appends its tokens after the padding, so generate prompts "
            "of unequal length one at a time")
    with pytest.raises(ValueError) as e:
        hf_model(idx, attention_mask=torch.tensor([[0] * 4 + [1] * 12, [1] * 16]))
    assert str(e.value) == rule
    right_padded = hf_model(idx, attention_mask=torch.tensor([[1] * 12 + [0] * 4, [1] * 16])).logits
    assert torch.equal(right_padded, hf_model(idx).logits)  # causal: padding after a row changes nothing before it
    with pytest.raises(ValueError) as e:  # the padding that the error asked for, and generate's first new token
        hf_model.generate(idx[:, :8], attention_mask=torch.tensor([[1] * 6 + [0] * 2, [1] * 8]), max_new_tokens=2,
                          do_sample=False)
    assert str(e.value) == rule
    cache = hf_model(idx[:, :4], use_cache=True).cache
    with pytest.raises(ValueError, match="the cache holds the visits of 2 loops, this pass runs 3"):
        hf_model(idx[:, 4:5], cache=cache, use_cache=True, n_loop=3)


@pytest.mark.parametrize("loops", [2, 3])
def test_generate_gives_the_projects_greedy_tokens_with_and_without_the_cache(trained, exported, loops):
    """At the trained loop count and another, past block_size (the window slides, the cache is rebuilt): the same
    tokens as the project's generate with top_k=1 (sample.py's greedy decoding)."""
    _, model = trained
    hf_model = load(exported)
    hf_model.generation_config.eos_token_id = None  # the project's generate runs on past a document's end
    prompt = torch.tensor([BYTES.encode_ordinary("a quick")])
    expected = model.generate(prompt, 60, top_k=1, n_loop=loops, vocab_size_limit=BYTES.n_vocab)
    assert prompt.size(1) + 60 > model.config.block_size
    for use_cache in (True, False):
        got = hf_model.generate(prompt, max_new_tokens=60, do_sample=False, n_loop=loops, use_cache=use_cache)
        assert torch.equal(got, expected), use_cache
    if loops == 2:
        assert BYTES.decode(expected[0].tolist()).startswith(SENTENCE)


@pytest.mark.parametrize("loops", [2, 3])
def test_generated_text_is_sample_pys_greedy_text(trained, exported, loops):
    out_dir, _ = trained
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(exported, trust_remote_code=True)
    hf_model = load(exported)
    hf_model.generation_config.eos_token_id = None
    ids = tokenizer("a quick", return_tensors="pt").input_ids
    text = tokenizer.decode(hf_model.generate(ids, max_new_tokens=30, do_sample=False, n_loop=loops)[0])
    r = run_script("sample.py", f"--out_dir={out_dir}", "--start=a quick", "--top_k=1", "--num_samples=1",
                   "--max_new_tokens=30", f"--n_loop={loops}", "--device=cpu", "--dtype=float32")
    assert r.returncode == 0, r.stderr
    assert r.stdout == text + "\n"


# ---------------------------------------------------------------------------------------------------------------
# tokenizers

TEXTS = ["Hello, world!", "  two  spaces\n\nand\ttabs ", "naïve café — 日本語 🙂", "<|endoftext|> is text",
         "\x00\x01\x7f", "it's 12,345 dollars; 'LL 's", ""]


def test_byte_tokenizer_gives_the_projects_ids_and_round_trips_any_text(tmp_path):
    from transformers import AutoTokenizer
    export_hf.write_tokenizer("bytes", str(tmp_path), 48)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == BYTES.encode_ordinary(text), text
        assert tokenizer.decode(ids) == text
    assert (len(tokenizer), tokenizer.eos_token_id, tokenizer.model_max_length) == (257, 256, 48)
    assert tokenizer.decode(BYTES.encode_ordinary("日")[:2]) == "\ufffd"  # a cut character, as the project decodes it
    # the separator decodes as the project's does (a blank line), its name spelt in text as that text
    ids = [*BYTES.encode_ordinary("one"), 256, *BYTES.encode_ordinary("two <|endoftext|>"), 256]
    assert tokenizer.decode(ids) == BYTES.decode(ids) == "one\n\ntwo <|endoftext|>\n\n"


def test_gpt2_tokenizer_gives_the_projects_ids(tmp_path):
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer
    export_hf.write_tokenizer("gpt2", str(tmp_path), 1024)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    enc = get_tokenizer("gpt2")
    for text in TEXTS + [topics[name] for name in sorted(topics)[:40]]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == enc.encode_ordinary(text), text[:80]
        assert tokenizer.decode(ids) == text
    assert (len(tokenizer), tokenizer.eos_token_id) == (50257, 50256)
    assert {"tokenizer.json", "vocab.json", "merges.txt"} <= set(os.listdir(tmp_path))


# ---------------------------------------------------------------------------------------------------------------
# the plain GPT-2

def test_plain_gpt2_export_equals_the_looped_model(tmp_path):
    """Pre-LN with a prelude, a coda, no biases and preln_scaled's epsilon (folded into the output projections),
    unrolled at another count than the trained one: a GPT2LMHeadModel with no code of its own, the same logits."""
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel
    model = random_gpt(residual="preln_scaled", residual_lambda=0.7, n_prelude=1, n_coda=1, bias=False)
    out_dir = save_checkpoint(model, tmp_path / "run")
    r = run_script(SCRIPT, f"--out_dir={out_dir}", f"--to={tmp_path / 'gpt2'}", "--gpt2=True", "--n_loop=3")
    assert r.returncode == 0, r.stderr
    folder = tmp_path / "gpt2"
    assert not [name for name in os.listdir(folder) if name.endswith(".py")]
    gpt2 = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert isinstance(gpt2, GPT2LMHeadModel) and gpt2.config.n_layer == 1 + 2 * 3 + 1
    idx = torch.randint(257, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected, _ = model(idx, n_loop=3)
        assert (gpt2(idx).logits - expected[..., :257]).abs().max().item() <= 1e-5
    card = (folder / "README.md").read_text()
    assert "the weights are 3 times the looped model's core" in card and "GPT2LMHeadModel" in card
    pre = random_gpt(residual="preln")
    r = run_script(SCRIPT, f"--out_dir={save_checkpoint(pre, tmp_path / 'pre')}", f"--to={tmp_path / 'pre-gpt2'}",
                   "--gpt2=True")
    assert r.returncode == 0, r.stderr
    assert "GPT2LMHeadModel, 4 layers" in r.stdout


# ---------------------------------------------------------------------------------------------------------------
# the script

def test_script_writes_a_complete_folder_with_a_model_card(trained, exported, tmp_path):
    _, model = trained
    assert sorted(os.listdir(exported)) == ["README.md", "config.json", "configuration_deeploop.py", "model.py",
                                            "model.safetensors", "modeling_deeploop.py", "tokenizer.json",
                                            "tokenizer_config.json"]
    assert not [name for name in os.listdir(os.path.dirname(exported)) if name.startswith(".")]  # no leftovers
    umask = os.umask(0)
    os.umask(umask)
    modes = {os.stat(os.path.join(exported, name)).st_mode & 0o777 for name in os.listdir(exported)}
    assert modes == {0o666 & ~umask} and os.stat(exported).st_mode & 0o777 == 0o777 & ~umask  # not private
    card = open(os.path.join(exported, "README.md")).read()
    for words in ("1 physical block run 2 times", "300 steps on `builtin_bytes`, 2 loops at every step",
                  "val loss 1.2345 nats per byte at step 300", "trust_remote_code=True, n_loop=4",
                  "| `vocab_size` | `257` (the checkpoint's 320, padded) |", "vLLM serves it with the DeepLoop project's `python -m lab.serve`"):
        assert words in card, words
    # an empty folder is taken, with its mode and group (a setgid folder of a group's share: its files get that group);
    # --n_loop sets the loops of a forward pass, not the coefficients
    (tmp_path / "empty").mkdir()
    group = 4242 if os.geteuid() == 0 else os.getegid()  # root may give a folder any group, others their own
    os.chown(tmp_path / "empty", -1, group)
    os.chmod(tmp_path / "empty", 0o2750)
    r = run_script(SCRIPT, f"--out_dir={trained[0]}/ckpt.pt", f"--to={tmp_path / 'empty'}", "--n_loop=3")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith(f"{tmp_path / 'empty'}: {trained[0]}/ckpt.pt (step 300, 1 blocks x 2 loops trained)")
    assert r.stdout.strip().endswith("differ from the checkpoint's by at most 0")
    deeper = load(tmp_path / "empty")
    assert deeper.config.n_loop == 3 and deeper.config.n_loop_trained == 2
    idx = torch.tensor([BYTES.encode_ordinary(SENTENCE)])
    assert logits_difference(deeper, model, idx, n_loop=3) == 0
    assert "| `n_loop` | `3` (trained at 2) |" in (tmp_path / "empty" / "README.md").read_text()
    folder = os.stat(tmp_path / "empty")
    assert (folder.st_mode & 0o7777, folder.st_gid) == (0o2750, group)
    assert {os.stat(tmp_path / "empty" / name).st_gid for name in os.listdir(tmp_path / "empty")} == {group}
    assert sorted(os.listdir(tmp_path)) == ["empty"]  # nothing left aside


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
@pytest.mark.parametrize("to_exists", [False, True])
def test_a_signal_while_writing_leaves_nothing_aside_and_an_empty_folder_as_it_was(trained, tmp_path, monkeypatch,
                                                                                   signum, to_exists):
    """SIGTERM or SIGHUP while the weights are written (made endless) ends the export like Ctrl-C: the hidden
    staging folder is removed, and an empty --to stays, with its mode; the exit code is the shell's for the signal."""
    import safetensors.torch
    out_dir, _ = trained
    to, marker = tmp_path / "to", tmp_path / "writing"
    if to_exists:
        to.mkdir()
        os.chmod(to, 0o2750)

    def endless(*args, **kwargs):
        marker.touch()
        time.sleep(600)
    monkeypatch.setattr(safetensors.torch, "save_file", endless)  # in the forked export too
    with open(tmp_path / "log", "w+") as log:
        proc = Started(SCRIPT, f"--out_dir={out_dir}", f"--to={to}", cwd=ROOT, log=log)
        monkeypatch.undo()
        try:
            deadline = time.monotonic() + 120
            while not marker.exists():
                assert proc.poll() is None and time.monotonic() < deadline, log.read()
                time.sleep(0.01)
            proc.send_signal(signum)
            assert proc.wait(timeout=60) == 128 + signum
        finally:
            proc.kill()  # if it did not stop
            proc.wait()
        log.seek(0)
        assert "Traceback" not in log.read()
    assert sorted(os.listdir(tmp_path)) == (["log", "to", "writing"] if to_exists else ["log", "writing"])
    if to_exists:
        assert os.listdir(to) == [] and os.stat(to).st_mode & 0o7777 == 0o2750


def one_line_error(r, quiet=True):
    """The one line of a run that stopped with exit code 2 (quiet: and printed nothing else)."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and (r.stdout == "" or not quiet), r.stdout
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, trained):
    out_dir, _ = trained
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "ckpt.pt").write_text("not a checkpoint")
    torch.save({"model": {}}, tmp_path / "other.pt")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    cases = {
        (f"--out_dir={tmp_path / 'text'}",): f"{tmp_path / 'text' / 'ckpt.pt'} is not a readable checkpoint",
        (f"--out_dir={tmp_path / 'other.pt'}",): "was not written by this project's train.py",
        (f"--out_dir={tmp_path / 'none'}",): f"no checkpoint at {tmp_path / 'none' / 'ckpt.pt'}",
        (f"--out_dir={out_dir}", f"--to={tmp_path / 'full'}"): f"{tmp_path / 'full'} exists and is not an empty "
                                                               f"folder: choose another --to, or delete it first",
        (f"--out_dir={out_dir}", f"--to={tmp_path / 'file'}"): "exists and is not an empty folder",
        (f"--out_dir={out_dir}", f"--to={tmp_path / 'file' / 'sub' / 'hf'}"): (
            f"--to={tmp_path / 'file' / 'sub' / 'hf'} lies under {tmp_path / 'file'}, which is a file, not a folder: "
            f"choose another --to"),
        (f"--out_dir={out_dir}", "--to="): "--to is empty",
        (f"--out_dir={out_dir}", "--n_loop=2000"): "--n_loop must be a loop count from 1 to 1024",
        (f"--out_dir={out_dir}", "--push_to_hub=nobody"): "--push_to_hub must name a model repository as owner/name",
    }
    before = sorted(os.listdir(tmp_path))
    for args, words in cases.items():
        args = args if any(a.startswith("--to=") for a in args) else (*args, f"--to={tmp_path / 'new'}")
        assert words in one_line_error(run_script(SCRIPT, *args)), args
    for settings, named in ((dict(residual="deeploop"), "residual=deeploop"),
                            (dict(residual="preln", norm="rmsnorm", position_encoding="rope"),
                             "norm=rmsnorm, position_encoding=rope"),
                            (dict(residual="preln", loop_input="concat"), "loop_input=concat")):
        run = save_checkpoint(random_gpt(**settings), tmp_path / "runs" / named)
        line = one_line_error(run_script(SCRIPT, f"--out_dir={run}", f"--to={tmp_path / 'new'}", "--gpt2=True"))
        assert line == (f"error: --gpt2=True writes a plain GPT-2, whose blocks are Pre-LN with LayerNorm and learned "
                        f"positions and take no loop input; {run}/ckpt.pt has {named}: export it without --gpt2 (its "
                        f"own code, loaded with trust_remote_code=True)")
    assert sorted(os.listdir(tmp_path)) == sorted(before + ["runs"])  # nothing written, nothing left aside
    assert os.listdir(tmp_path / "full") == ["keep.txt"] and (tmp_path / "file").read_text() == "mine"


def test_an_export_that_does_not_reproduce_the_checkpoint_is_removed(tmp_path, trained, monkeypatch):
    out_dir, _ = trained
    monkeypatch.setattr(export_hf, "max_logit_difference", lambda *args: 2e-5)
    (tmp_path / "empty").mkdir()
    model, checkpoint, path, loops = export_hf.load(out_dir, str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="the exported model's logits differ from the checkpoint's by 2e-05 "
                                         r"\(more than 1e-05\): the export is wrong and was removed"):
        export_hf.write(model, checkpoint, path, str(tmp_path / "empty"), loops)
    assert os.listdir(tmp_path) == ["empty"] and os.listdir(tmp_path / "empty") == []  # as it was


def test_harness_hf_backend_scores_the_export_as_eval_downstream_scores_the_checkpoint(trained, exported,
                                                                                       monkeypatch, tmp_path):
    """lm-eval's own hf model (AutoModelForCausalLM with trust_remote_code) on docs/eval_demo: the same accuracies and
    the same log-likelihood of every choice as eval_downstream's CheckpointLM."""
    from datasets import config
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lab.eval_downstream import CheckpointLM
    monkeypatch.setattr(config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    monkeypatch.chdir(ROOT)  # the demo's data_files path is relative to the repository root
    _, model = trained
    copy = GPT(model.config)
    copy.load_state_dict(model.state_dict())
    tasks = TaskManager(include_path=os.path.join(ROOT, "docs", "eval_demo"), include_defaults=False)
    results = {}
    for name, lm in (("hf", "hf"), ("checkpoint", CheckpointLM(copy, BYTES))):
        results[name] = simple_evaluate(model=lm, model_args=f"pretrained={exported},trust_remote_code=True,"
                                                             f"dtype=float32" if lm == "hf" else None,
                                        tasks=["deeploop_demo"], device="cpu", batch_size=4, log_samples=True,
                                        task_manager=tasks, random_seed=1234, numpy_random_seed=1234,
                                        torch_random_seed=1234, fewshot_random_seed=1234)
    scores = {name: r["results"]["deeploop_demo"] for name, r in results.items()}
    assert (scores["hf"]["acc,none"], scores["hf"]["acc_norm,none"]) == (scores["checkpoint"]["acc,none"],
                                                                         scores["checkpoint"]["acc_norm,none"])
    lls = {name: [[resp[0][0] for resp in sample["resps"]] for sample in r["samples"]["deeploop_demo"]]
           for name, r in results.items()}
    assert len(lls["hf"]) == 10 and torch.allclose(torch.tensor(lls["hf"]), torch.tensor(lls["checkpoint"]),
                                                   atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# the hub: huggingface_hub itself, unpatched, uploading to a local server of the hub's API (tests/hub_server.py)

@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A hub of the test's own that the real huggingface_hub talks to (HF_ENDPOINT), with a token that may write;
    huggingface_hub reads these variables into huggingface_hub.constants when it is imported, hence the reloads
    (set_endpoint points it elsewhere). Uploads go over LFS: the hub's Xet transfers are not spoken here."""
    import huggingface_hub.constants
    import huggingface_hub.utils.logging
    for handler in huggingface_hub.utils.logging.get_logger().handlers:
        handler.setStream(CurrentStderr())
    server = Hub()
    server.write_token = "hf_writersecret"

    def set_endpoint(url):
        monkeypatch.setenv("HF_ENDPOINT", url)
        importlib.reload(huggingface_hub.constants)
    for key in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in dict(HF_HUB_CACHE=str(tmp_path / "hf_cache"), HF_HOME=str(tmp_path / "hf_home"),
                           HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1", HF_HUB_ETAG_TIMEOUT="5",
                           HF_HUB_DOWNLOAD_TIMEOUT="5").items():
        monkeypatch.setenv(key, value)
    set_endpoint(server.url)
    server.set_endpoint = set_endpoint
    try:
        yield server
    finally:
        server.close()
        monkeypatch.undo()
        importlib.reload(huggingface_hub.constants)
    assert not server.errors, server.errors


def test_push_to_hub_uploads_what_a_fresh_download_gets_back(trained, tmp_path, hub):
    from huggingface_hub import snapshot_download
    out_dir, _ = trained
    to = tmp_path / "tiny"
    r = run_script(SCRIPT, f"--out_dir={out_dir}", f"--to={to}", "--push_to_hub=me/tiny",
                   env=dict(HF_TOKEN=hub.write_token))
    assert r.returncode == 0, r.stderr
    assert f"uploaded to me/tiny at {hub.url}: {hub.url}/me/tiny/commit/" in r.stdout
    assert hub.write_token not in r.stdout + r.stderr
    assert hub.count("PUT", "/lfs/") == 1  # the weights, over LFS; the other files inline in the commit
    downloaded = snapshot_download("me/tiny", cache_dir=str(tmp_path / "fresh"))
    names = sorted(os.listdir(to))
    assert sorted(os.listdir(downloaded)) == sorted(names + [".gitattributes"])  # the hub's own file
    for name in names:
        assert (to / name).read_bytes() == open(os.path.join(downloaded, name), "rb").read(), name
    assert "me/tiny" in (to / "README.md").read_text()  # the card loads the model from the hub
    sent = {headers.get("authorization") for method, path, headers in hub.requests if method == "POST"}
    assert sent == {f"Bearer {hub.write_token}"}


def test_push_without_a_token_or_a_hub_is_one_line_and_writes_nothing(trained, tmp_path, hub):
    out_dir, _ = trained
    to = tmp_path / "tiny"
    line = one_line_error(run_script(SCRIPT, f"--out_dir={out_dir}", f"--to={to}", "--push_to_hub=me/tiny"))
    assert line == (f"error: cannot create the model repository me/tiny at {hub.url} (HTTP 401 Invalid username or "
                    f"password.): log in with `hf auth login`, or set HF_TOKEN to a token with write access, then "
                    f"rerun; nothing was written")
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    hub.set_endpoint(closed)
    line = one_line_error(run_script(SCRIPT, f"--out_dir={out_dir}", f"--to={to}", "--push_to_hub=me/tiny",
                                     env=dict(HF_TOKEN=hub.write_token)))
    assert line.startswith(f"error: cannot create the model repository me/tiny at {closed} (ConnectError: ")
    assert line.endswith(f"check the network and HF_ENDPOINT (now {closed}), then rerun; nothing was written")
    assert not to.exists() and not [name for name in os.listdir(tmp_path) if name.startswith(".")]


def test_failed_upload_keeps_the_export_and_says_how_to_upload_it(trained, tmp_path, hub):
    out_dir, _ = trained
    to = tmp_path / "tiny"
    hub.failing["/api/models/me/tiny/commit/"] = 403
    line = one_line_error(run_script(SCRIPT, f"--out_dir={out_dir}", f"--to={to}", "--push_to_hub=me/tiny",
                                     env=dict(HF_TOKEN=hub.write_token)), quiet=False)  # the export's line first
    assert line.startswith(f"error: upload of {to} to me/tiny at {hub.url} failed (HTTP 403 ")
    assert line.endswith(f"the export in {to} is complete: upload it with `hf upload me/tiny {to}`")
    assert "model.safetensors" in os.listdir(to)
