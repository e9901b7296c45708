"""eval_downstream.py: CheckpointLM's answers against the model's own log-probabilities computed here by hand, and the
script end to end through lm-evaluation-harness on local task files (no network, no downloads)."""

import json
import os
import runpy
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch.nn import functional as F

import lab.eval_downstream as ed
from model import GPT, GPTConfig
from models import learned_by_heart
from dataset import get_tokenizer

from scripts import ROOT

SECOND_PROCESS = True  # ~15 s of the harness's runs, beside the rest of the session (conftest.py)

SCRIPT = os.path.join(ROOT, "lab", "eval_downstream.py")
DEMO = os.path.join(ROOT, "docs", "eval_demo")
ENC = get_tokenizer("bytes")
SENTENCE = "a quick brown fox jumps over lazy dogs."  # what the trained fixture model knows by heart


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """The datasets library's cache (where it keeps its copy of a local jsonl) in a tmp dir, not in ~/.cache."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    from datasets import config
    monkeypatch.setattr(config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


def tokens(text):
    return ENC.encode_ordinary(text)


def save_checkpoint(model, out_dir):
    """A checkpoint in train.py's format."""
    os.makedirs(out_dir, exist_ok=True)
    torch.save(dict(model=model.state_dict(), model_args=asdict(model.config), tokenizer="bytes", optimizer={},
                    scaler=None, iter_num=300, best_val_loss=0.0, config=dict(out_dir=str(out_dir)), rng=None,
                    program="deeploop-train"), os.path.join(out_dir, "ckpt.pt"))
    return str(out_dir)


def random_gpt(block_size=16):
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=block_size, vocab_size=320, n_layer=2, n_loop=2, n_head=2, n_embd=32)).eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A looped GPT (1 block x 2 loops, bytes, block_size 64) trained until it has SENTENCE by heart, saved as a
    checkpoint -> (out_dir, model)."""
    model = learned_by_heart(tokens(SENTENCE), block_size=64)
    return save_checkpoint(model, tmp_path_factory.mktemp("trained")), model


def by_hand(model, ids, n, n_loop=None):
    """Sum of log P(ids[-n:]) over the model's real tokens, from one plain float32 forward pass over all of ids."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids[:-1]]), n_loop=n_loop)
    logprobs = F.log_softmax(logits[0, :, :ENC.n_vocab].double(), dim=-1)
    return sum(logprobs[p - 1, ids[p]].item() for p in range(len(ids) - n, len(ids)))


def requests(kind, *args_list):
    return [Instance(kind, {}, args, i) for i, args in enumerate(args_list)]


def lm_for(model, **kwargs):
    """A CheckpointLM over a copy of model (CheckpointLM swaps the output layer of the model it is given)."""
    copy = GPT(model.config)
    copy.load_state_dict(model.state_dict())
    return ed.CheckpointLM(copy, ENC, **kwargs)


def run_script(argv, monkeypatch, capsys):
    """Run eval_downstream.py in this process (torch and the harness are imported once) -> (exit code, out, err).
    Offline the script sets the hub's offline switches in os.environ: monkeypatch puts them back afterwards."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, os.environ.get(name, "0"))
    monkeypatch.setattr(sys, "argv", [SCRIPT, "--device=cpu", "--dtype=float32", *argv])
    code = 0
    try:
        runpy.run_path(SCRIPT, run_name="__main__")
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------------------------------------------
# CheckpointLM


def test_loglikelihood_is_the_models_and_greedy_means_every_token_is_the_argmax(trained):
    _, model = trained
    lm = lm_for(model)
    context = "a quick brown fox jumps over lazy"
    [(right, right_greedy), (wrong, wrong_greedy)] = lm.loglikelihood(requests(
        "loglikelihood", (context, " dogs."), (context, " dogz.")))
    assert right == pytest.approx(by_hand(model, tokens(SENTENCE), len(" dogs.")), abs=1e-4)
    assert wrong == pytest.approx(by_hand(model, tokens(SENTENCE.replace("dogs", "dogz")), len(" dogz.")), abs=1e-4)
    assert right_greedy and not wrong_greedy and right > wrong


def test_a_batch_gives_the_one_by_one_values():
    """Also for a context of spaces only: the harness moves them into the continuation, and the empty context left is
    read as the document separator, as an empty one is."""
    model = random_gpt(block_size=16)
    pairs = [("The cat", " sat."), ("A much longer context, longer than the window", " and more"), ("", "x"),
             ("x", " a long ending, longer than sixteen bytes"), ("hi", " there"), ("Q: 2+2?\nA:", " 4"), (" ", "x"),
             ("  ", ""), ("x", "")]
    one = [lm_for(model, batch_size=1).loglikelihood(requests("loglikelihood", pair))[0] for pair in pairs]
    together = lm_for(model, batch_size=4).loglikelihood(requests("loglikelihood", *pairs))  # padded batches
    assert [greedy for _, greedy in together] == [greedy for _, greedy in one]
    assert [lp for lp, _ in together] == pytest.approx([lp for lp, _ in one], abs=1e-5)
    eot = ENC.eot_token
    assert one[6][0] == pytest.approx(by_hand(model, [eot, *tokens(" x")], 2), abs=1e-5)
    assert one[7][0] == pytest.approx(by_hand(model, [eot, *tokens("  ")], 2), abs=1e-5)
    assert one[8] == (0.0, True)  # nothing to score


def test_a_long_context_is_cut_from_the_left_and_the_continuation_scored_whole():
    model = random_gpt(block_size=16)
    ctx, cont = "a context far longer than the sixteen token window", " end."
    [(lp, _)] = lm_for(model).loglikelihood(requests("loglikelihood", (ctx, cont)))
    ids = tokens(ctx + cont)
    assert lp == pytest.approx(by_hand(model, ids[-17:], len(cont)), abs=1e-5)  # reads 16 tokens, the last one a target
    assert lp != pytest.approx(by_hand(model, ids[-16:], len(cont)), abs=1e-5)  # and as many as fit


def test_rolling_loglikelihood_is_the_sum_over_the_harness_windows():
    model = random_gpt(block_size=16)
    text = "Every token of a text longer than the window is predicted once, from its own window."
    ids = tokens(text)
    assert len(ids) > 3 * 16
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(ids, ENC.eot_token, 16, 1)]
    expected = sum(by_hand(model, ctx + pred, len(pred)) for ctx, pred in windows)
    lm = lm_for(model, batch_size=3)
    assert lm.loglikelihood_rolling(requests("loglikelihood_rolling", (text,))) == [pytest.approx(expected, abs=1e-4)]
    # a continuation longer than the window is scored in the same pieces
    assert lm.loglikelihood(requests("loglikelihood", ("", text)))[0][0] == pytest.approx(expected, abs=1e-4)


def test_generate_until_stops_at_the_stop_string_or_the_token_limit(trained):
    _, model = trained
    lm = lm_for(model)
    outputs = lm.generate_until(requests(
        "generate_until", ("a quick brown", {"until": ["lazy"], "max_gen_toks": 64}),
        ("a quick brown", {"until": ["zzz"], "max_gen_toks": 4}),
        ("a quick brown", {"until": ["s", "ump"], "max_gen_toks": 64, "do_sample": False})))
    assert outputs == [" fox jumps over ", " fox", " fox j"]  # cut at the earliest stop string


def test_n_loop_changes_the_scores(trained):
    _, model = trained
    pair = ("a quick brown fox jumps over lazy", " dogs.")
    trained_depth = lm_for(model).loglikelihood(requests("loglikelihood", pair))[0][0]
    assert lm_for(model, n_loop=2).loglikelihood(requests("loglikelihood", pair))[0][0] == trained_depth
    deeper = lm_for(model, n_loop=3).loglikelihood(requests("loglikelihood", pair))[0][0]
    assert deeper == pytest.approx(by_hand(model, tokens(SENTENCE), len(pair[1]), n_loop=3), abs=1e-4)
    assert deeper != pytest.approx(trained_depth, abs=1e-3)


def test_scores_are_float32_under_bfloat16_autocast():
    model = random_gpt()
    lm = lm_for(model, autocast=torch.autocast("cpu", dtype=torch.bfloat16))
    x = torch.randn(3, 32)
    with lm.autocast:
        logits = lm.model.lm_head(x)
        rounded = model.lm_head(x)  # what the model's own output layer gives under autocast
    assert logits.dtype == torch.float32 and rounded.dtype == torch.bfloat16
    assert torch.equal(logits, x @ model.lm_head.weight[:ENC.n_vocab].T)  # no padded ids, no bfloat16 steps


# --------------------------------------------------------------------------------------------------------------
# the script


def test_demo_task_accuracy_is_the_hand_computed_one(trained, monkeypatch, capsys):
    """docs/eval_demo through the harness: acc and acc_norm equal what the model's log-likelihoods give by hand
    (acc: the choice with the highest log-likelihood; acc_norm: the highest per character of the choice)."""
    out_dir, model = trained
    monkeypatch.chdir(ROOT)  # the demo's data_files path is relative to the repository root
    code, out, err = run_script([f"--out_dir={out_dir}", f"--include_path={DEMO}", "--tasks=deeploop_demo"],
                                monkeypatch, capsys)
    assert code == 0, err
    with open(os.path.join(DEMO, "deeploop_demo.jsonl")) as f:
        docs = [json.loads(line) for line in f]
    acc = acc_norm = 0
    for doc in docs:
        lls = [by_hand(model, tokens(doc["context"] + " " + c), len(" " + c)) for c in doc["choices"]]
        acc += max(range(len(lls)), key=lambda i: lls[i]) == doc["label"]
        acc_norm += max(range(len(lls)), key=lambda i: lls[i] / len(doc["choices"][i])) == doc["label"]
    with open(os.path.join(out_dir, "eval_deeploop_demo_0shot_loop2_iter300.json")) as f:
        results = json.load(f)
    scores = results["results"]["deeploop_demo"]
    assert (scores["acc,none"], scores["acc_norm,none"]) == (acc / len(docs), acc_norm / len(docs))
    assert results["config"]["n_loop"] == 2 and results["n-samples"]["deeploop_demo"]["effective"] == len(docs)
    table = out.splitlines()
    assert table[0].split("|")[1].strip() == "Tasks" and table[2].startswith("|deeploop_demo|")  # the harness's table


def test_other_settings_write_other_files(trained, tmp_path, monkeypatch, capsys):
    out_dir, _ = trained
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in [
        {"q": "a quick brown fox jumps over lazy", "choices": ["cats.", "dogs."], "label": 1},
        {"q": "a quick brown", "choices": ["fox jumps", "cow sleeps"], "label": 1},  # the model prefers "fox"
        {"q": "a quick", "choices": ["brown fox", "red hen"], "label": 0},
    ]))
    (tmp_path / "mc.yaml").write_text(f"task: mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
                                      f"{tmp_path / 'mc.jsonl'}\noutput_type: multiple_choice\ntest_split: test\n"
                                      f"doc_to_text: '{{{{q}}}}'\ndoc_to_choice: '{{{{choices}}}}'\n"
                                      f"doc_to_target: label\nmetric_list:\n  - metric: acc\n")
    before = set(os.listdir(out_dir))
    for argv in ([], ["--n_loop=3"], ["--num_fewshot=1", "--limit=2"]):
        code, _, err = run_script([f"--out_dir={out_dir}", f"--tasks={tmp_path / 'mc.yaml'}", *argv],
                                  monkeypatch, capsys)
        assert code == 0, err
    written = set(os.listdir(out_dir)) - before
    assert written == {"eval_mc_0shot_loop2_iter300.json", "eval_mc_0shot_loop3_iter300.json",
                       "eval_mc_1shot_loop2_iter300_limit2.json"}
    results = {name: json.load(open(os.path.join(out_dir, name))) for name in written}
    assert results["eval_mc_0shot_loop2_iter300.json"]["results"]["mc"]["acc,none"] == pytest.approx(2 / 3)
    assert results["eval_mc_0shot_loop3_iter300.json"]["config"]["unrolled_depth"] == 3
    assert results["eval_mc_1shot_loop2_iter300_limit2.json"]["n-shot"]["mc"] == 1


def test_an_evaluation_never_overwrites_an_earlier_ones_result(trained, tmp_path, monkeypatch, capsys):
    """The same evaluation of the same checkpoint step replaced the file: after train.py's start_over (which now moves
    it aside) the first run's result existed nowhere."""
    out_dir = save_checkpoint(trained[1], tmp_path / "run")
    monkeypatch.chdir(ROOT)
    argv = [f"--out_dir={out_dir}", f"--include_path={DEMO}", "--tasks=deeploop_demo"]
    code, _, err = run_script(argv, monkeypatch, capsys)
    assert code == 0, err
    path = os.path.join(out_dir, "eval_deeploop_demo_0shot_loop2_iter300.json")
    with open(path, "a") as f:
        f.write("\n")  # told apart from what a second evaluation would write
    first = open(path).read()
    line = one_line_error(*run_script(argv, monkeypatch, capsys))
    assert line == (f"error: {path} holds this evaluation of {out_dir}/ckpt.pt (step 300) already: move it aside or "
                    f"delete it to evaluate again")
    assert open(path).read() == first and sorted(os.listdir(out_dir)) == ["ckpt.pt", os.path.basename(path)]


def one_line_error(code, out, err):
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_missing_checkpoint_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    line = one_line_error(*run_script([f"--out_dir={tmp_path / 'nothing'}"], monkeypatch, capsys))
    assert line.startswith(f"error: no checkpoint at {tmp_path / 'nothing' / 'ckpt.pt'}")


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "gpu"])
def test_a_device_this_machine_lacks_is_a_one_line_error(trained, device, monkeypatch, capsys):
    """As on a machine without a GPU (whatever this one has): CUDA's was an AssertionError's traceback."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    out_dir, _ = trained
    line = one_line_error(*run_script([f"--out_dir={out_dir}", f"--device={device}"], monkeypatch, capsys))
    assert line == f"error: --device={device} is not usable here (the devices here: cpu); use one of them"


def test_offline_without_task_data_is_one_line_and_writes_nothing(trained, monkeypatch, capsys):
    out_dir, _ = trained
    before = sorted(os.listdir(out_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a machine without network, whatever this one has
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", os.path.join(out_dir, "no hub cache"))
    line = one_line_error(*run_script([f"--out_dir={out_dir}", "--tasks=hellaswag,no_such_task"], monkeypatch,
                                      capsys))
    assert line == ("error: no data for hellaswag, no_such_task: the Hugging Face hub cannot be reached and no hub "
                    "dataset is cached here; run once with network access, or evaluate local task files with "
                    "--include_path=folder")
    assert sorted(os.listdir(out_dir)) == before


def absent_task(folder):
    """A task YAML over a hub dataset that is not there."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "absent.yaml")
    with open(path, "w") as f:
        f.write("task: absent\ndataset_path: someone/absent_dataset\noutput_type: multiple_choice\n"
                "test_split: test\ndoc_to_text: q\ndoc_to_choice: c\ndoc_to_target: 0\n")
    return path


def test_unknown_task_is_a_one_line_error(trained, tmp_path, monkeypatch, capsys):
    out_dir, _ = trained
    import lm_eval.tasks
    from huggingface_hub import constants
    # some hub data in the cache, so that the script looks the names up in the harness's index; here the index is
    # built from --include_path alone (the harness's own 14,000 task files take many seconds), the lookup is the same
    os.makedirs(tmp_path / "hub" / "datasets--someone--something")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    harness_task_manager = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_path=None, include_defaults=True:
                        harness_task_manager(include_path=include_path, include_defaults=False))
    absent_task(tmp_path / "tasks")
    line = one_line_error(*run_script([f"--out_dir={out_dir}", f"--include_path={tmp_path / 'tasks'}",
                                       "--tasks=absent,no_such_task"], monkeypatch, capsys))
    assert line.startswith("error: unknown task no_such_task: not a task, group or tag of lm-eval ")
    assert line.endswith(" or of --include_path; list them with `lm-eval ls tasks`")


def test_task_data_that_cannot_load_offline_is_a_one_line_error(trained, tmp_path):
    # a fresh process: the hub's offline switches work only when set before the libraries are imported
    out_dir, _ = trained
    before = sorted(os.listdir(out_dir))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"))
    result = subprocess.run([sys.executable, "-m", "lab.eval_downstream", f"--out_dir={out_dir}", f"--tasks={absent_task(tmp_path)}",
                             "--device=cpu"], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    line = one_line_error(result.returncode, result.stdout, result.stderr)
    assert line.startswith("error: cannot load the task data (") and "someone/absent_dataset" in line
    assert line.endswith("; run once with network access, or check the task's dataset_path and data_files")
    assert sorted(os.listdir(out_dir)) == before


@pytest.mark.parametrize("argv,message", [
    (["--tasks= ,"], "--tasks is empty"),
    (["--batch_size=0"], "--batch_size must be >= 1"),
    (["--num_fewshot=-1"], "--num_fewshot must be >= 0"),
    (["--n_loop=5000"], "--n_loop must be a loop count from 1 to 1024 (model.MAX_LOOPS), or 0 (the trained one), got "
                        "5000"),
    (["--include_path=no/such/folder"], "--include_path=no/such/folder is not a folder"),
])
def test_bad_settings_are_one_line_errors(argv, message, monkeypatch, capsys):
    assert one_line_error(*run_script(argv, monkeypatch, capsys)).startswith(f"error: {message}")


def test_a_checkpoint_of_the_depth_task_points_to_depth_eval(tmp_path, monkeypatch, capsys):
    out_dir = tmp_path / "depth"
    save_checkpoint(random_gpt(), out_dir)
    checkpoint = torch.load(out_dir / "ckpt.pt", weights_only=True)
    checkpoint.update(tokenizer="chains(values=8, hops=6, cells=16)", config=dict(dataset="chains"))
    torch.save(checkpoint, out_dir / "ckpt.pt")
    line = one_line_error(*run_script([f"--out_dir={out_dir}", "--tasks=mc"], monkeypatch, capsys))
    assert line == (f"error: {out_dir} was trained on the chains task, not on text: show its answers with python "
                    f"-m lab.depth_eval --out_dir={out_dir}")
