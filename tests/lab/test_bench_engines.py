"""lab/bench_engines.py: the engines agree on greedy tokens, and the table has a row of figures for each engine, whose
counts of tokens and seconds add up; bad settings are one line. The run with vLLM is skipped where it is not
installed, and runs in a process of its own (vLLM starts its engine in the bench's process) started with the
session."""

import importlib.util
import re

import pytest

from scripts import run_script

TINY = ["--n_layer=1", "--n_loop=2", "--n_head=2", "--n_embd=64", "--block_size=32", "--sequences=1,3",
        "--gen_tokens=6", "--prompt_len=4", "--repeats=1"]
NUM = r"([0-9.]+)"


def check_output(out, engines):
    lines = out.splitlines()
    assert re.fullmatch(r"model: the bench model, random weights: 1 blocks x 2 loops \(deeploop\), n_embd 64, 50257 "
                        r"tokens, [0-9.]+M parameters; float32 on .+, \d+ threads, load average .+", lines[0]), lines[0]
    floor = re.fullmatch(rf"memory: reads {NUM} GB/s; a cached decode step of one sequence reads {NUM} MB: floor "
                         rf"{NUM} ms", lines[1])
    assert floor and float(floor.group(1)) > 0, lines[1]
    assert lines[2] == f"greedy, 16 tokens of one prompt: the same tokens from {', '.join(engines)}"
    for line, engine in zip(lines[3:], engines):
        m = re.fullmatch(rf"{engine}: started in {NUM} s, \d+ threads; 1 x 6 tokens in {NUM} s \({NUM} tokens/s\), "
                         rf"3 x 6 tokens in {NUM} s \({NUM} tokens/s\); decode step {NUM} ms, {NUM}x the floor", line)
        assert m, line
        _, one, one_rate, three, three_rate, step, ratio = map(float, m.groups())
        assert one_rate == pytest.approx(6 / one, rel=0.01, abs=1) and three_rate == pytest.approx(18 / three, rel=0.01,
                                                                                                   abs=1)
        assert ratio == pytest.approx(step / float(floor.group(3)), rel=0.06, abs=0.1)
    table = lines[lines.index("| engine | 1 seq, tokens/s | 3 seq, tokens/s | decode step (1 seq) | x floor |"):]
    assert [row.split(" | ")[0] for row in table[2:]] == [f"| {engine}" for engine in engines]


def test_project_and_transformers_agree_and_are_timed():
    r = run_script("lab/bench_engines.py", *TINY, "--engines=project,transformers")
    assert r.returncode == 0, r.stderr
    check_output(r.stdout, ["project", "transformers"])


HAS_VLLM = importlib.util.find_spec("vllm") is not None
# started with the session (conftest.py): a process of its own, whose vLLM import and engine take ~15 s
EARLY = {"test_vllm_agrees_with_the_project_and_is_timed":
         lambda folder: [["-m", "lab.bench_engines", *TINY, "--engines=vllm,project"]]} if HAS_VLLM else {}


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (requirements-serve.txt)")
def test_vllm_agrees_with_the_project_and_is_timed(early):
    r, _ = early
    assert r.returncode == 0, r.stderr[-3000:]
    check_output(r.stdout, ["vllm", "project"])


@pytest.mark.parametrize("args,message", [
    (["--engines=vllm,sglang"], "--engines takes a list of vllm, project, transformers, onnx, got 'vllm,sglang'"),
    (["--onnx_optimization=max"], "--onnx_optimization takes one of none, basic, extended, all, got 'max'"),
    (["--sequences=0,8"], "--sequences takes counts of sequences >= 1 like 1,8,32, got '0,8'"),
    (["--gen_tokens=1"], "need --gen_tokens >= 2, --prompt_len >= 1, --repeats >= 1 and --top_k >= 1"),
    (["--gen_tokens=300"], "--prompt_len + --gen_tokens (at least 16) must fit in the model's context (256)"),
])
def test_bad_settings_are_one_line_errors(args, message):
    r = run_script("lab/bench_engines.py", *args)
    assert (r.returncode, r.stdout, r.stderr) == (2, "", f"error: {message}\n")


def test_a_missing_checkpoint_is_one_line(tmp_path):
    r = run_script("lab/bench_engines.py", f"--out_dir={tmp_path / 'none'}", "--engines=project")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"error: no checkpoint at {tmp_path / 'none' / 'ckpt.pt'}")


def test_onnx_row_agrees_and_is_timed():
    """ONNX Runtime (the lab.export_onnx folder's generate.py) beside the project: the same greedy tokens, a timed row."""
    r = run_script("lab/bench_engines.py", *TINY, "--engines=project,onnx", "--onnx_profile=True")
    assert r.returncode == 0, r.stderr
    *table, blank, profile = r.stdout.splitlines()
    check_output("\n".join(table), ["project", "onnx"])
    assert blank == ""
    assert profile.startswith("ONNX Runtime's profiler, the nodes' time over the whole run: ") and "MatMul " in profile
