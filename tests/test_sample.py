import json
import os
import re
import shutil
import signal
import time

import pytest
import torch

import runtime
from model import GPT, GPTConfig
from guard import load_checkpoint
from dataset import get_tokenizer
from prepare_data import prepare
from scripts import Started, block_calls_counted, run_script
from agreeing_loops import agree_after

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# English with multi-byte UTF-8 characters, so that byte-level samples split characters across tokens
CORPUS = ("The cat sat on the mat. The dog sat on the log. A café in Zürich serves crème brûlée — naïve but nice. "
          "Über den Wolken scheint die Sonne. ")


def run(script, *args, cwd=ROOT):
    return run_script(script, *args, cwd=cwd)


def test_a_loop_count_above_max_loops_is_a_one_line_error(bytes_run):
    result = run("sample.py", f"--out_dir={bytes_run}", "--device=cpu", "--dtype=float32", "--n_loop=5000",
                 "--num_samples=1", "--max_new_tokens=1")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == ("error: --n_loop must be a loop count from 1 to 1024 (model.MAX_LOOPS), or 0 (the "
                             "trained one), got 5000\n")


@pytest.mark.parametrize("args,message", [
    (["--MAX_LOOPS=4096", "--n_loop=2000"], "unknown config key 'MAX_LOOPS' in --MAX_LOOPS; known keys: compile, "),
    (["--device=cuda:1"], "--device=cuda:1 is not usable here (the devices here: cpu"),
    (["--device=gpu"], "--device=gpu is not usable here (the devices here: cpu"),
])
def test_an_imported_name_or_a_device_this_machine_lacks_is_a_one_line_error(bytes_run, args, message):
    """sample.py imports model.MAX_LOOPS: not a setting, so its own check of n_loop stands (raised, 2000 passed it
    and the model's failed in a traceback). A device that is not here fails before the checkpoint is loaded."""
    if torch.cuda.device_count() > 1 and "--device=cuda:1" in args:
        pytest.skip("this machine has a second GPU")
    result = run("sample.py", f"--out_dir={bytes_run}", "--dtype=float32", "--num_samples=1", "--max_new_tokens=1",
                 *args)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.stderr


def test_auto_precision_on_a_cpu_samples_in_float32(bytes_run):
    """Whatever a CPU's training measurement would pick: a generation step is a matrix-vector product per sequence."""
    result = run("sample.py", f"--out_dir={bytes_run}", "--device=cpu", "--num_samples=1", "--max_new_tokens=2")
    assert result.returncode == 0, result.stderr
    assert ", dtype float32 (auto on a CPU: a generation step reads every weight, which bfloat16 would cast each " \
           "step)" in result.stderr


def sample(out_dir, *args):
    """sample.py's stdout; under python -m lab.sample where an argument is one of the lab's settings."""
    lab = any(a.startswith(("--exit_threshold=", "--kv_cache=")) for a in args)
    result = run("-m lab.sample" if lab else "sample.py", f"--out_dir={out_dir}", "--device=cpu", "--dtype=float32",
                 *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def bytes_run(tmp_path_factory):
    """A checkpoint that train.py wrote after a few seconds on a tiny byte-level corpus (val loss ~0.4)."""
    tmp = tmp_path_factory.mktemp("bytes_run")
    with open(tmp / "corpus.jsonl", "w", encoding="utf-8") as f:
        for _ in range(60):
            f.write(json.dumps({"text": CORPUS * 3}) + "\n")
    prepare([str(tmp / "corpus.jsonl")], tokenizer="bytes", out_dir=str(tmp / "data" / "tiny_bytes"), quiet=True)
    result = run("train.py", "--dataset=tiny_bytes", "--out_dir=out", "--device=cpu", "--dtype=float32",
                 "--compile=False", "--n_layer=1", "--n_loop=2", "--n_head=2", "--n_embd=64", "--block_size=32",
                 "--batch_size=8", "--gradient_accumulation_steps=1", "--max_iters=600", "--learning_rate=3e-3",
                 "--min_lr=1e-4", "--warmup_iters=10", "--lr_decay_iters=600", "--eval_interval=600",
                 "--eval_iters=2", "--log_interval=100", cwd=tmp)
    assert result.returncode == 0, result.stderr[-2000:]
    return tmp / "out"


def test_greedy_bytes_sample_is_readable_same_without_cache_other_with_more_loops(bytes_run, tmp_path):
    (tmp_path / "prompt.txt").write_text("The ", encoding="utf-8")
    args = (f"--start=FILE:{tmp_path / 'prompt.txt'}", "--num_samples=1", "--max_new_tokens=100", "--top_k=1")
    text = sample(bytes_run, *args)
    assert text.startswith("The ")
    assert "\ufffd" not in text
    words = text.replace(".", " ").split()
    known = [w for w in words if w in CORPUS.replace(".", " ").split()]
    assert len(known) >= len(words) // 2 and len(set(known)) >= 5, text  # mostly the corpus's words, and not just one
    assert sample(bytes_run, *args, "--use_cache=False") == text  # greedy: the cache changes the speed, not the text
    assert sample(bytes_run, *args, "--n_loop=5") != text  # 5 loops instead of the trained 2


def test_cached_greedy_generation_in_bfloat16_equals_recomputing_the_context(bytes_run):
    """In bfloat16 (autocast: the blocks' weights cast once, the model computing in bfloat16) the cache
    changes the speed, not the first 50 tokens of the trained model's greedy output."""
    model, checkpoint = load_checkpoint(str(bytes_run / "ckpt.pt"))
    model.eval()
    prompt = torch.tensor([get_tokenizer(checkpoint["tokenizer"]).encode_ordinary("The ")])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cached, recomputed = (model.generate(prompt, 50, top_k=1, use_cache=use_cache) for use_cache in (True, False))
        assert model(prompt)[0].dtype == torch.bfloat16  # the steps did compute in bfloat16
    assert torch.equal(cached, recomputed)


def test_fixed_seed_gives_identical_samples_streamed_as_decoded(bytes_run):
    """Two runs with one seed print the same, and what sample.py printed piece by piece equals decoding each finished
    sample at once, though the bytes of a multi-byte character arrive in separate steps."""
    args = dict(seed=7, num_samples=2, max_new_tokens=150, temperature=1.0, top_k=0)
    argv = ["--start=A caf", *(f"--{k}={v}" for k, v in args.items())]
    streamed = sample(bytes_run, *argv)
    assert sample(bytes_run, *argv) == streamed
    model, checkpoint = load_checkpoint(str(bytes_run / "ckpt.pt"))
    enc = get_tokenizer(checkpoint["tokenizer"])
    model.eval()
    prompt = enc.encode_ordinary("A caf")
    torch.manual_seed(args["seed"])
    samples = [model.generate(torch.tensor([prompt]), args["max_new_tokens"], args["temperature"],
                              vocab_size_limit=enc.n_vocab)[0].tolist()
               for _ in range(args["num_samples"])]
    expected = "---------------\n".join(enc.decode(prompt) + enc.decode(s[len(prompt):]) + "\n" for s in samples)
    assert any(ord(c) > 127 for c in expected)  # the samples do contain multi-byte characters
    assert streamed == expected


@pytest.mark.parametrize("top_k", [0, 200])
def test_a_tiny_temperature_samples_the_greedy_tokens(bytes_run, top_k):
    """logits / 1e-40 overflowed to inf, whose softmax is nan: torch.multinomial raised."""
    args = ("--start=The ", "--num_samples=1", "--max_new_tokens=40")
    assert sample(bytes_run, *args, "--temperature=1e-40", f"--top_k={top_k}") == sample(bytes_run, *args, "--top_k=1")


def test_a_lone_surrogate_in_the_prompt_becomes_the_replacement_character(bytes_run):
    """It has no UTF-8 form (no bytes to tokenize or print): U+FFFD instead, as GPT-2's tokenizer makes it."""
    assert sample(bytes_run, '--start="a\\ud800b"', "--num_samples=1", "--max_new_tokens=1").startswith("a\ufffdb")


def test_padded_vocabulary_ids_are_never_sampled(tmp_path):
    """GPT-2 ids 50257..50303 only pad the output layer and cannot be decoded: make them the most likely outputs of a
    hand-built checkpoint (in train.py's format) and check that sampling still only produces decodable text."""
    args = dict(block_size=32, vocab_size=50304, n_layer=1, n_loop=2, n_head=2, n_embd=16, dropout=0.0, bias=True,
                residual="deeploop")
    model = GPT(GPTConfig(**args))
    with torch.no_grad():
        model.lm_head.weight[50257:] = 1.0
    os.makedirs(tmp_path / "out")
    torch.save(dict(program="deeploop-train", model=model.state_dict(), model_args=args, tokenizer="gpt2",
                    optimizer=None, scaler=None, iter_num=0, best_val_loss=None, config={}, rng=None),
               tmp_path / "out" / "ckpt.pt")
    text = sample(tmp_path / "out", "--start=Hello", "--num_samples=1", "--max_new_tokens=20")
    assert text.startswith("Hello") and len(text) > len("Hello\n")


def test_a_checkpoint_with_a_prelude_coda_and_loop_input_samples_the_same_with_and_without_cache(tmp_path):
    args = dict(block_size=32, vocab_size=320, n_layer=1, n_loop=2, n_head=2, n_embd=16, n_prelude=1, n_coda=2,
                loop_input="concat")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**args))
    with torch.no_grad():  # away from init, where the adapter passes the state through
        model.transformer.inject.adapter.weight.add_(0.3 * torch.randn(16, 32))
    os.makedirs(tmp_path / "out")
    torch.save(dict(program="deeploop-train", model=model.state_dict(), model_args=args, tokenizer="bytes",
                    optimizer=None, scaler=None, iter_num=0, best_val_loss=None, config={}, rng=None),
               tmp_path / "out" / "ckpt.pt")
    argv = ["--start=The ", "--num_samples=1", "--max_new_tokens=40", "--top_k=1", "--n_loop=3"]
    result = run("sample.py", f"--out_dir={tmp_path / 'out'}", "--device=cpu", "--dtype=float32", *argv)
    assert result.returncode == 0, result.stderr
    assert "sampling with 3 loops (unrolled depth 6)" in result.stderr  # 1 + 1 x 3 + 2
    assert sample(tmp_path / "out", *argv, "--use_cache=False") == result.stdout


@pytest.mark.parametrize("case", ["missing checkpoint", "foreign checkpoint", "missing prompt"])
def test_bad_input_is_a_one_line_error(case, bytes_run, tmp_path):
    out_dir, start = bytes_run, "--start=hi"
    if case == "missing checkpoint":
        out_dir = tmp_path / "nothing here"
    elif case == "foreign checkpoint":
        out_dir = tmp_path
        torch.save({"a": 1}, tmp_path / "ckpt.pt")
    else:
        start = f"--start=FILE:{tmp_path / 'missing.txt'}"
    result = run("sample.py", f"--out_dir={out_dir}", start, "--device=cpu", "--dtype=float32")
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "missing.txt" in lines[0] if case == "missing prompt" else "ckpt.pt" in lines[0]


def test_adaptive_exit_reports_the_loops_each_token_used(bytes_run, monkeypatch):
    """Against a model whose loops agree after 2 (agreeing_loops.agree_after): every token takes 3 loops."""
    args = ("--start=The ", "--num_samples=2", "--max_new_tokens=30", "--top_k=1", "--n_loop=6")
    agree_after(monkeypatch, 2)
    result = run("-m lab.sample", f"--out_dir={bytes_run}", "--device=cpu", "--dtype=float32", *args,
                 "--exit_threshold=1e-9")
    assert result.returncode == 0, result.stderr
    assert "sampling with adaptive exit at KL 1e-09, at most 6 loops" in result.stderr
    assert result.stderr.splitlines()[-1] == "loops per token: mean 3.00, 3: 60 tokens"


def test_exit_every_kl_passes_is_one_loop_and_last_loop_at_one_loop_is_per_visit(bytes_run):
    args = ("--start=The ", "--num_samples=1", "--max_new_tokens=60", "--top_k=1")
    one_loop = sample(bytes_run, *args, "--n_loop=1")
    assert sample(bytes_run, *args, "--n_loop=4", "--exit_threshold=1e30") == one_loop
    assert sample(bytes_run, *args, "--n_loop=1", "--kv_cache=last_loop") == one_loop
    assert sample(bytes_run, *args, "--exit_threshold=0.0") == sample(bytes_run, *args)


@pytest.mark.parametrize("script", ["sample.py", "-m lab.sample"])
def test_compile_step_generates_every_token_through_the_step_the_model_compiles(bytes_run, monkeypatch, script):
    """sample.py --compile_step=True (also under lab.sample, without its settings) hands runtime.compile_decode_step's
    next_logits to generation (here an uncompiled stand-in, which counts its calls: compiling is
    tests/test_greedy_tokens.py's) and says how long its first decode step took; the text is what sample.py prints
    without it."""
    calls = []

    def counted_step(model, n_loop=None):
        calls.append(("made", n_loop))
        return lambda ids, caches: calls.append(ids.size(1)) or model(ids, None, n_loop, caches, True)[0]

    monkeypatch.setattr(runtime, "compile_decode_step", counted_step)
    args = (f"--out_dir={bytes_run}", "--device=cpu", "--dtype=float32", "--start=The ", "--num_samples=2",
            "--max_new_tokens=30", "--top_k=1", "--n_loop=3")
    result = run(script, *args, "--compile_step=True")
    assert result.returncode == 0, result.stderr
    # per sample: the prompt "The ", a token a step until the cache holds block_size 32, then the slid window
    assert calls == [("made", 3)] + ([4] + [1] * 28 + [32]) * 2
    assert re.search(r"60 tokens in [0-9.]+ s \([0-9.]+ tokens/s, use_cache=True\), of which [0-9.]+ s in the first "
                     r"compiled decode step, which compiles it\n", result.stderr), result.stderr
    assert result.stdout == run("sample.py", *args).stdout


def test_compile_step_with_a_prompt_that_fills_the_context_says_that_nothing_compiled(bytes_run, monkeypatch):
    """A prompt of block_size - 1 tokens or more: every step fills or refills the cache, which runs uncompiled; the
    line says so rather than that the first step compiled the graph."""
    monkeypatch.setattr(runtime, "compile_decode_step",
                        lambda model, n_loop=None: lambda ids, caches: model(ids, None, n_loop, caches, True)[0])
    for prompt in ("x" * 31, "x" * 40):  # block_size 32
        result = run("sample.py", f"--out_dir={bytes_run}", "--device=cpu", "--dtype=float32", f"--start={prompt}",
                     "--num_samples=1", "--max_new_tokens=5", "--top_k=1", "--compile_step=True")
        assert result.returncode == 0, result.stderr
        assert re.search(r"5 tokens in [0-9.]+ s \([0-9.]+ tokens/s, use_cache=True\); no step ran compiled, so "
                         r"nothing was compiled: the prompt's pass and the steps that fill the cache run uncompiled, "
                         r"and from a prompt of 31 tokens on \(block_size 32\) every step is one of them\n$",
                         result.stderr), result.stderr


def test_a_checkpoint_whose_model_args_do_not_fit_its_weights_is_one_line(bytes_run, tmp_path):
    ckpt = torch.load(bytes_run / "ckpt.pt", weights_only=True)
    ckpt["model_args"]["n_embd"] = 32
    (tmp_path / "run").mkdir()
    torch.save(ckpt, tmp_path / "run" / "ckpt.pt")
    for script in ("sample.py", "-m lab.sample"):
        result = run(script, f"--out_dir={tmp_path / 'run'}", "--device=cpu", "--max_new_tokens=1")
        assert (result.returncode, result.stdout) == (2, ""), result.stderr
        assert re.fullmatch(r"error: \S+/run/ckpt.pt is marked as a checkpoint of this project's train.py, but \d+ of "
                            r"its weights do not fit the model its model_args make, e\.g\. .*\n", result.stderr)


@pytest.mark.parametrize("script", ["sample.py", "-m lab.sample"])
def test_ctrl_c_ends_sampling_with_one_line_and_the_shells_code(bytes_run, tmp_path, script):
    """SIGINT in the middle of a sample (the lab's entry run as python -m runs it): exit code 130 and one line, no
    KeyboardInterrupt traceback; the text printed so far stays."""
    with open(tmp_path / "log", "w+") as log:
        proc = Started(script, f"--out_dir={bytes_run}", "--device=cpu", "--dtype=float32", "--start=ZZ",
                       "--num_samples=1", "--max_new_tokens=1000000", cwd=tmp_path, log=log)
        try:
            deadline = time.monotonic() + 60
            while "ZZ" not in (tmp_path / "log").read_text():  # the prompt is printed once sampling starts
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()
                time.sleep(0.01)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 130
        finally:
            proc.kill()
            proc.wait()
        text = (tmp_path / "log").read_text()
    assert "Traceback" not in text and re.search(r"ZZ.*\nstopped by SIGINT\n$", text, re.S), text[-3000:]


@pytest.mark.parametrize("setting,message", [
    (["--exit_threshold=-1e-3"], "--exit_threshold must be >= 0 (0 = off), got -0.001"),
    (["--kv_cache=last"], "--kv_cache must be one of per_visit, last_loop, got 'last'"),
    (["--exit_threshold=1e-3", "--use_cache=False"],
     "--exit_threshold and --kv_cache=last_loop work on the KV cache: drop --use_cache=False"),
    (["--n_loop=-1", "--exit_threshold=1e-3"], "--n_loop must be a loop count from 1 to 1024 (model.MAX_LOOPS), or 0 "
                                               "(the trained one), got -1"),
    (["--compile_step=True", "--exit_threshold=1e-3"], "--compile_step compiles the plain decode step: with "
     "--exit_threshold or --kv_cache=last_loop use --compile=True, which compiles the blocks"),
    (["--compile_step=True", "--use_cache=False"],
     "--compile_step compiles the cached decode step as a whole: drop --compile and --use_cache=False"),
])
def test_bad_exit_and_cache_settings_are_one_line_errors(bytes_run, setting, message):
    result = run("-m lab.sample", f"--out_dir={bytes_run}", "--device=cpu", *setting)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"error: {message}\n")


FIXTURE = os.path.join(ROOT, "tests", "fixtures", "ckpt_plain_before_lab.pt")  # 2 blocks x 2 loops, bytes
# started with the session (conftest.py): compiling takes seconds
EARLY = {"test_compiled_adaptive_exit_runs_every_block_compiled": lambda folder: [
    ["-c", f"import os, shutil; os.mkdir({str(folder / 'run')!r}); shutil.copy({FIXTURE!r}, "
           f"{str(folder / 'run' / 'ckpt.pt')!r})"],
    ["-c", block_calls_counted("lab.sample", "stderr", eager_backend=True), f"--out_dir={folder / 'run'}", "--device=cpu",
     "--dtype=float32", "--compile=True", "--n_loop=4", "--exit_threshold=1e-12", "--num_samples=2",
     "--max_new_tokens=60"]]}


def test_compiled_adaptive_exit_runs_every_block_compiled(early):
    """--compile=True compiles the blocks, so that adaptive exit, which runs the loops one by one, runs them compiled
    (compiling forward would leave it uncompiled): every block call of 120 tokens of up to 4 loops, the window
    sliding past block_size 32, within dynamo's recompile limit (hitting it is an error in sample.py)."""
    result, _ = early
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    loops = re.fullmatch(r"loops per token: mean ([0-9.]+), .* tokens", lines[-2])
    assert loops and float(loops.group(1)) > 1.5, lines[-2]  # most tokens ran more than one loop
    m = re.fullmatch(r"block calls: (\d+) compiled, 0 not", lines[-1])
    assert m and int(m.group(1)) > 240, lines[-1]  # more than 120 tokens x 2 blocks x 1 loop


@pytest.mark.parametrize("name", ["plain", "huginn"])
def test_a_checkpoint_written_before_the_lesson_and_the_lab_split_samples_what_it_sampled(name, tmp_path):
    """tests/fixtures: checkpoints of the model before the split and its greedy samples (past block_size), at the
    trained loop count and at 4."""
    reference = torch.load(os.path.join(ROOT, "tests", "fixtures", "outputs_before_lab.pt"))[name]["greedy"]
    (tmp_path / "run").mkdir()
    shutil.copy(os.path.join(ROOT, "tests", "fixtures", f"ckpt_{name}_before_lab.pt"), tmp_path / "run" / "ckpt.pt")
    enc = get_tokenizer("bytes")
    for loops, tokens in reference.items():
        prompt, new = enc.decode(tokens[0, :5].tolist()), enc.decode(tokens[0, 5:].tolist())
        (tmp_path / "prompt.txt").write_text(prompt)
        assert sample(tmp_path / "run", f"--start=FILE:{tmp_path / 'prompt.txt'}", "--top_k=1", "--num_samples=1",
                      f"--max_new_tokens={len(tokens[0]) - 5}", f"--n_loop={loops}") == prompt + new + "\n"


def test_adaptive_exit_at_most_one_loop_warns_that_it_cannot_exit_earlier(bytes_run):
    result = run("-m lab.sample", f"--out_dir={bytes_run}", "--device=cpu", "--dtype=float32", "--exit_threshold=0.1",
                 "--n_loop=1", "--num_samples=1", "--max_new_tokens=2")
    assert result.returncode == 0
    assert "warning: adaptive exit at most 1 loop: every token runs that one loop; set --n_loop above 1" in \
        result.stderr.splitlines()
