import json
import math
import os
import runpy
import subprocess
import sys
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

import eval_downstream as ed
from model import GPT, GPTConfig
from dataset import get_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "eval_downstream.py")
ENC = get_tokenizer("bytes")
SENTENCE = "a quick brown fox jumps over lazy dogs."  # what the trained fixture model knows by heart


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # these models are tiny: on 2 busy shared cores a second intra-op thread only adds contention (10x slower)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tokens(text):
    return ENC.encode_ordinary(text)


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def save_checkpoint(model, out_dir, optimizer=None):
    """A checkpoint in the INTERFACES.md format, as train.py writes it."""
    os.makedirs(out_dir, exist_ok=True)
    torch.save(dict(model=model.state_dict(), model_args=asdict(model.config), tokenizer="bytes",
                    optimizer=optimizer.state_dict() if optimizer else {}, scaler=None, iter_num=100,
                    best_val_loss=0.0, config=dict(out_dir=str(out_dir)), rng=dict(torch=torch.get_rng_state()),
                    program="deeploop-train"), os.path.join(out_dir, "ckpt.pt"))
    return str(out_dir)


def random_gpt(block_size=32, **kw):
    torch.manual_seed(0)
    args = dict(block_size=block_size, vocab_size=320, n_layer=2, n_loop=2, n_head=2, n_embd=32, dropout=0.0)
    return GPT(GPTConfig(**{**args, **kw})).eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A looped GPT (1 block x 2 loops, padded vocab 320) trained until it has SENTENCE by heart, saved as a
    checkpoint: under it the sentence's own ending is the most likely one, for real and not by construction."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=48, vocab_size=320, n_layer=1, n_loop=2, n_head=2, n_embd=32, dropout=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    ids = torch.tensor(tokens(SENTENCE))[None]
    for _ in range(300):
        _, loss = model(ids[:, :-1], ids[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.01:
            break
    assert loss.item() < 0.01, "the fixture model did not learn its sentence"
    return save_checkpoint(model.eval(), tmp_path_factory.mktemp("trained"), optimizer), model


class Bigram(torch.nn.Module):
    """A stand-in model with the GPT call signature whose next-token distribution depends only on the current
    token and is given exactly: probs[prev][next] = p, the rest of each row spread evenly over the other ids."""

    def __init__(self, probs, vocab=ENC.n_vocab, block_size=64):
        super().__init__()
        self.config = SimpleNamespace(block_size=block_size)
        table = torch.full((vocab, vocab), 1.0 / vocab, dtype=torch.float64)
        for prev, row in probs.items():
            table[prev] = (1 - sum(row.values())) / (vocab - len(row))
            for nxt, p in row.items():
                table[prev, nxt] = p
        self.logprobs = torch.nn.Parameter(table.log(), requires_grad=False)

    def forward(self, idx, targets=None, n_loop=None):
        return self.logprobs[idx], None


def run_script(argv, monkeypatch, capsys):
    """Run eval_downstream.py in this process (no second torch import) -> (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", [SCRIPT, *argv])
    code = 0
    try:
        runpy.run_path(SCRIPT, run_name="__main__")
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------------------------------------------
# the scorer


def test_acc_and_acc_norm_differ_on_a_constructed_case():
    # " x" is 1 token with log-prob -1; " yyy" is 3 tokens: -1.5 for the first, then 0.99 twice. The sum prefers x
    # (-1 > -1.52), the per-token mean prefers yyy (-0.51 > -1). The joining space counts as context.
    space, x, y = tokens(" xy")
    model = Bigram({space: {x: math.exp(-1.0), y: math.exp(-1.5)}, y: {y: 0.99}})
    records = [("t", "Q", ["x", "yyy"], label) for label in (0, 1, 1)]
    examples = ed.encode_records(records, ENC, block_size=64)
    assert examples[0] == ([(tokens("Q "), [x]), (tokens("Q "), [y, y, y])], 0)
    scores = ed.score(model, examples[0][0])
    assert scores[0] == (pytest.approx(-1.0), 1, True)  # x is also the argmax after " "
    assert scores[1][:2] == (pytest.approx(-1.5 + 2 * math.log(0.99)), 3)
    acc, acc_norm = ed.choice_accuracy(model, examples, batch_size=2)
    assert (acc, acc_norm) == (pytest.approx(1 / 3), pytest.approx(2 / 3))


def test_lambada_needs_every_token_of_the_last_word_greedy():
    # the model's favourite after " " is "o", after "o" is "k", after "k" is "s" (z is only second best)
    space, o, k, s, z = tokens(" oksz")
    model = Bigram({space: {o: 0.9}, o: {k: 0.6}, k: {s: 0.5, z: 0.3}})
    records = [ed.parse_lambada({"text": text}, "t") for text in ("the oks", "the okz", "the zks")]
    assert records[0] == ("the ", ["oks"], 0)
    examples = ed.encode_records([("t", *r) for r in records], ENC, block_size=64)
    assert examples[0] == ([(tokens("the "), [o, k, s])], 0)  # a 3-token last word; the space joins the context
    scores = [s for _, [s] in ed.scored_examples(model, examples)]
    assert [greedy for _, _, greedy in scores] == [True, False, False]  # okz fails at its last token, zks at its first
    assert scores[0][:2] == (pytest.approx(math.log(0.9 * 0.6 * 0.5)), 3)
    acc, ppl = ed.lambada_accuracy(model, examples, batch_size=3)
    assert acc == pytest.approx(1 / 3)
    assert ppl == pytest.approx(math.exp(-sum(lp for lp, _, _ in scores) / 3))  # per word, not per token


def test_padding_never_changes_a_score():
    model = random_gpt()
    rows = [(tokens("The cat"), tokens(" sat.")), (tokens("A much longer context here"), tokens(" and more")),
            (tokens("x"), tokens(" a long ending, the longest"))]
    alone = [ed.score(model, [row])[0] for row in rows]  # B=1: no padding at all
    together = ed.score(model, rows)  # B=3: right-padded to the longest row
    for (lp_a, n_a, g_a), (lp_t, n_t, g_t) in zip(alone, together):
        assert lp_t == pytest.approx(lp_a, abs=1e-5) and (n_t, g_t) == (n_a, g_a)


def test_batching_examples_gives_the_same_accuracy():
    model = random_gpt()
    records = [("t", f"Context {i}" * (i + 1), ["one", "two two", "three three three"], i % 3) for i in range(5)]
    examples = ed.encode_records(records, ENC, model.config.block_size)
    one = [lp for _, s in ed.scored_examples(model, examples, batch_size=1) for lp, _, _ in s]
    many = [lp for _, s in ed.scored_examples(model, examples, batch_size=4) for lp, _, _ in s]  # 12 rows + 3 rows
    assert len(many) == 15 and many == pytest.approx(one, abs=1e-5)
    assert ed.choice_accuracy(model, examples, batch_size=4) == ed.choice_accuracy(model, examples, batch_size=1)


def test_long_contexts_are_cut_from_the_left():
    model = random_gpt(block_size=16)
    ctx, cont = tokens("a context far longer than the sixteen token window"), tokens(" end.")
    assert len(ctx) + len(cont) > 17
    [(lp, n, _)] = ed.score(model, [(ctx, cont)])  # would raise inside the model if not cut
    keep = 16 + 1 - len(cont)  # the model reads 16 tokens; the last continuation token is only a target
    assert n == len(cont) and lp == pytest.approx(ed.score(model, [(ctx[-keep:], cont)])[0][0], abs=1e-5)
    assert lp != pytest.approx(ed.score(model, [(ctx[-keep + 1:], cont)])[0][0], abs=1e-5)  # as much as fits
    # cut inside a padded batch too
    assert ed.score(model, [(tokens("hi"), tokens(" x")), (ctx, cont)])[1][0] == pytest.approx(lp, abs=1e-5)


def test_a_choice_longer_than_block_size_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as e:
        ed.encode_records([("f.jsonl:3", "ctx", ["short", "x" * 20], 0)], ENC, block_size=16)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: f.jsonl:3: a choice is 20 tokens long") and err.count("\n") == 1


def test_empty_context_starts_at_the_document_separator():
    assert ed.encode_pair(ENC, "", "word") == ([ENC.eot_token, *tokens(" ")], tokens("word"))
    assert ed.parse_lambada({"text": "single"}, "t") == ("", ["single"], 0)


def test_n_loop_reaches_the_model():
    model = random_gpt()
    rows = [(tokens("some context"), tokens(" an ending"))]
    assert ed.score(model, rows, n_loop=0) == ed.score(model, rows, n_loop=2)  # 0 means as built
    assert ed.score(model, rows, n_loop=3)[0][0] != pytest.approx(ed.score(model, rows)[0][0], abs=1e-5)


# --------------------------------------------------------------------------------------------------------------
# the script


def test_cli_end_to_end_on_a_trained_checkpoint(trained, tmp_path):
    out_dir, _ = trained
    data = write_jsonl(tmp_path / "hs.jsonl", [
        {"ctx": "a quick brown fox jumps over lazy", "endings": ["cats.", "dogs.", "frogs.", "birds."], "label": 1},
        {"ctx": "a quick brown", "endings": ["cow sleeps", "fox jumps", "fox sleeps", "dog jumps"], "label": "1"},
    ])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, SCRIPT, f"--out_dir={out_dir}", "--task=hellaswag", f"--data={data}",
                             "--device=cpu", "--dtype=float32"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "hellaswag acc=1.0000 acc_norm=1.0000 n=2 n_loop=2"


def test_lambada_and_multiple_choice_on_a_trained_checkpoint(trained, tmp_path, monkeypatch, capsys):
    out_dir, _ = trained
    lambada = write_jsonl(tmp_path / "lambada.jsonl", [
        {"text": "a quick brown fox jumps over lazy dogs"},  # every token of "dogs" is the model's argmax
        {"text": "a quick brown fox jumps over lazy cats"},  # wrong from its first token
        {"text": "a quick brown fox jumps over lazy dogz"},  # "dog" right, "z" wrong: the whole word counts
        "",  # blank lines are skipped
    ])
    code, out, _ = run_script([f"--out_dir={out_dir}", "--task=lambada", f"--data={lambada}", "--device=cpu",
                               "--batch_size=2"], monkeypatch, capsys)
    assert code == 0
    assert out.splitlines()[-1].startswith("lambada acc=0.3333 ppl=")
    assert out.splitlines()[-1].endswith(" n=3 n_loop=2")
    mc = write_jsonl(tmp_path / "mc.jsonl", [
        {"context": "a quick brown fox", "choices": ["sleeps", "jumps over lazy dogs.", "runs"], "label": 1},
        {"context": "a quick brown fox jumps over lazy", "choices": ["cats.", "dogs."], "label": 0},
    ])
    code, out, _ = run_script([f"--out_dir={out_dir}", "--task=multiple_choice", f"--data={mc}", "--device=cpu",
                               "--n_loop=2", "--limit=2"], monkeypatch, capsys)
    assert code == 0 and out.splitlines()[-1] == "multiple_choice acc=0.5000 acc_norm=0.5000 n=2 n_loop=2"
    code, out, _ = run_script([f"--out_dir={out_dir}", "--task=multiple_choice", f"--data={mc}", "--device=cpu",
                               "--n_loop=3", "--limit=1"], monkeypatch, capsys)
    assert code == 0 and out.splitlines()[-1].endswith(" n=1 n_loop=3")  # test-time depth, first example only


def test_malformed_line_is_a_one_line_error_naming_file_and_line(tmp_path):
    data = write_jsonl(tmp_path / "bad.jsonl", [
        {"ctx": "fine", "endings": ["a", "b", "c", "d"], "label": 0},
        '{"ctx": "broken", "endings": ["a", "b"',
    ])
    result = subprocess.run([sys.executable, SCRIPT, "--out_dir=nowhere", "--task=hellaswag", f"--data={data}"],
                            capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {data}:2: not valid JSON") and result.stderr.count("\n") == 1


@pytest.mark.parametrize("task,line,message", [
    ("hellaswag", {"ctx": "c", "label": 0}, "missing field endings"),
    ("hellaswag", {"ctx": "c", "endings": ["a", "b"], "label": 2}, '"label" must be an index into "endings" (0..1)'),
    ("hellaswag", {"ctx": "c", "endings": ["a", "b"], "label": True}, '"label" must be an index'),
    ("hellaswag", {"ctx": 3, "endings": ["a", "b"], "label": 0}, '"ctx" must be a string'),
    ("multiple_choice", {"context": "c", "choices": ["a"], "label": 0}, '"choices" must be a list of at least 2'),
    ("multiple_choice", {"context": "c", "choices": ["a", " "], "label": 0}, "non-empty strings"),
    ("multiple_choice", [1, 2], "expected a JSON object, got list"),
    ("lambada", {"txt": "a b"}, 'expected a non-empty string field "text"'),
])
def test_bad_fields_are_one_line_errors(task, line, message, tmp_path, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "bad.jsonl", ["", line])
    code, _, err = run_script([f"--task={task}", f"--data={data}"], monkeypatch, capsys)
    assert code == 2 and err.startswith(f"error: {data}:2: ") and err.count("\n") == 1
    assert message in err


def test_a_line_that_is_not_utf8_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9 au lait"}\n')
    code, _, err = run_script(["--task=lambada", f"--data={path}"], monkeypatch, capsys)
    assert code == 2 and err.startswith(f"error: {path}:2: not valid JSON (") and err.count("\n") == 1


@pytest.mark.parametrize("argv,message", [
    (["--task=piqa"], "unknown --task=piqa; choose one of hellaswag, lambada, multiple_choice"),
    (["--task=multiple_choice"], "--task=multiple_choice needs --data=file.jsonl"),
    (["--data=missing.jsonl"], "no data file at missing.jsonl"),
    (["--batch_size=0"], "--batch_size must be >= 1"),
])
def test_bad_settings_are_one_line_errors(argv, message, monkeypatch, capsys):
    code, _, err = run_script(argv, monkeypatch, capsys)
    assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1


def test_download_fails_fast_offline_and_uses_the_cache(trained, tmp_path, monkeypatch, capsys):
    path = tmp_path / "hellaswag_val.jsonl"
    with pytest.raises(SystemExit) as e:  # port 9 on this machine: the connection is refused at once
        ed.download("http://127.0.0.1:9/hellaswag_val.jsonl", str(path), timeout=2.0)
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 2  # "downloading ..." and the error
    assert err[1].startswith("error: could not download http://127.0.0.1:9/hellaswag_val.jsonl (")
    assert "--data=path/to/file.jsonl" in err[1] and not os.listdir(tmp_path)
    # a file already in the cache is used as it is, with no network at all
    monkeypatch.setattr(ed.urllib.request, "urlopen", None)
    write_jsonl(path, [{"ctx": "a quick brown fox", "endings": ["jumps", "sleeps"], "label": 0}])
    code, out, _ = run_script([f"--out_dir={trained[0]}", "--task=hellaswag", f"--cache_dir={tmp_path}",
                               "--device=cpu"], monkeypatch, capsys)
    assert code == 0 and out.splitlines()[-1] == "hellaswag acc=1.0000 acc_norm=1.0000 n=1 n_loop=2"
