import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1")  # one thread: see tests/test_sample.py
NUM = r"([0-9.]+)"


def bench(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)


def test_bench_prints_throughput_mfu_and_generation_speed_for_both_depths():
    result = bench("--n_layer=1", "--n_loop=3", "--n_head=2", "--n_embd=32", "--block_size=32", "--vocab_size=128",
                   "--batch_size=2", "--warmup_steps=1", "--timed_steps=3", "--gen_tokens=8", "--gen_prompt_len=4",
                   "--compare_depths=True", "--device=cpu", "--dtype=float32", "--compile=False")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 7, result.stdout
    patterns = [
        r"model: n_layer=(\d+) x n_loop=(\d+) \(unrolled depth 3\), n_embd 32, .*",
        rf"train: {NUM} tokens/s, {NUM} ms/step \(median of 3\), MFU {NUM}% of {NUM} GFLOP/s",
        rf"generate: 8 new tokens x 2 sequences: cached {NUM} tokens/s, uncached {NUM} tokens/s, "
        rf"cache speed-up {NUM}x",
    ]
    figures = []
    for line, pattern in zip(lines[:6], patterns * 2):
        m = re.fullmatch(pattern, line)
        assert m, line
        figures.append([float(x) for x in m.groups()])
    assert figures[0] == [1, 3] and figures[3] == [3, 1]  # the looped model, then the untied one of equal depth
    assert all(x > 0 for numbers in figures for x in numbers)
    m = re.fullmatch(rf"compare: n_layer=1 x n_loop=3 trains at {NUM}x the tokens/s of n_layer=3 x n_loop=1 "
                     r"\(same unrolled FLOPs\)", lines[6])
    assert m, lines[6]
    assert float(m.group(1)) == pytest.approx(figures[1][0] / figures[4][0], rel=0.01)  # the ratio of the two lines

