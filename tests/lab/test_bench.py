import re

import pytest

from scripts import run_script

NUM = r"([0-9.]+)"
TINY = ["--n_layer=1", "--n_loop=3", "--n_head=2", "--n_embd=32", "--block_size=32", "--vocab_size=128",
        "--batch_size=2", "--warmup_steps=1", "--timed_steps=3", "--gen_tokens=8", "--gen_prompt_len=4", "--device=cpu"]
MODEL = r"model: n_layer=(\d+) x n_loop=(\d+) \(unrolled depth 3\), n_embd 32, .*, cpu (\w+)(, compiled)?"
TRAIN = rf"train: {NUM} tokens/s, {NUM} ms/step \(median of 3\), MFU {NUM}% of {NUM} GFLOP/s"
MEMORY = rf"memory: reads {NUM} GB/s \(best of sums and vector-matrix products over 256 MiB\)"
GENERATE = rf"generate: 8 new tokens x (\d) sequences?: cached {NUM} ms/step \({NUM} tokens/s\), uncached {NUM} " \
           rf"ms/step \({NUM} tokens/s\), cache speed-up {NUM}x; a cached step reads {NUM} MB: floor {NUM} ms, " \
           rf"cached step {NUM}x the floor"


def bench(*args):
    """bench.py in this process; the runs that compile are EARLY below, in processes of their own (dynamo's caches
    and limits would outlive them here)"""
    return run_script("lab/bench.py", *TINY, *args)


def rows(lines):
    """(model line's groups, train figures, {sequences: generate figures}) for each model benched."""
    found = []
    for i, line in enumerate(lines):
        if line.startswith("model: "):
            model = re.fullmatch(MODEL, line)
            train = re.fullmatch(TRAIN, lines[i + 1])
            memory = re.fullmatch(MEMORY, lines[i + 2])
            generate = [re.fullmatch(GENERATE, lines[i + 3 + j]) for j in range(2)]
            assert model and train and memory and float(memory.group(1)) > 0 and all(generate), lines[i:i + 5]
            found.append((model.groups(), [float(x) for x in train.groups()],
                          {int(m.group(1)): [float(x) for x in m.groups()[1:]] for m in generate}))
    return found


def test_bench_prints_throughput_mfu_and_generation_speed_for_both_depths():
    result = bench("--compare_depths=True", "--dtype=float32", "--compile=False")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # Linux with glibc here
    assert re.fullmatch(rf"allocator: glibc malloc keeps freed memory \(runtime.tune_malloc\); load average {NUM} on "
                        r"\d+ CPUs, torch threads 1", lines[0]), lines[0]
    assert lines[1] == "dtype float32: as set"
    found = rows(lines)
    assert [(model[:2], model[2]) for model, _, _ in found] == [(("1", "3"), "float32"), (("3", "1"), "float32")]
    for _, train, generate in found:
        assert set(generate) == {1, 2}  # one sequence and batch_size sequences
        assert all(x > 0 for x in train + generate[1] + generate[2])
        for sequences, (cached_ms, tokens_per_s, _, _, _, _, floor_ms, ratio) in generate.items():
            assert tokens_per_s == pytest.approx(sequences * 1000 / cached_ms, rel=0.01)
            assert ratio == pytest.approx(cached_ms / floor_ms, rel=0.02)  # the ratio of the printed figures
    m = re.fullmatch(rf"compare: n_layer=1 x n_loop=3 trains at {NUM}x the tokens/s of n_layer=3 x n_loop=1 "
                     r"\(same unrolled FLOPs\)", lines[-1])
    assert m, lines[-1]
    assert float(m.group(1)) == pytest.approx(found[0][1][0] / found[1][1][0], rel=0.01)  # the ratio of the lines


# bench.py with a line on stdout each time it builds a model, to see which rows were printed before
BUILDS_LOGGED = """
import runpy, sys
import model
init = model.GPT.__init__
def logged(self, *args, **kwargs):
    print("(a model is built)", flush=True)
    init(self, *args, **kwargs)
model.GPT.__init__ = logged
runpy.run_module("lab.bench", run_name="__main__", alter_sys=True)
"""
# started with the session (conftest.py): compiling takes 5-20 s
EARLY = {"test_compiled_depths_with_generation_stay_within_the_recompile_limit": lambda folder: [[
    "-m", "lab.bench", *TINY, "--compare_depths=True", "--compile=True", "--compile_backend=eager", "--dtype=float32"]],
    "test_compare_dtypes_prints_three_rows_and_their_ratios": lambda folder: [[
    "-m", "lab.bench", *TINY, "--compare_dtypes=True", "--compile_backend=eager", "--warmup_steps=0"]],
    "test_compare_dtypes_prints_each_precision_before_the_next_and_cuts_steps_to_its_share": lambda folder: [[
    "-c", BUILDS_LOGGED, *TINY, "--compare_dtypes=True", "--compile_backend=eager", "--warmup_steps=2",
    "--compare_seconds=0"]]}


def test_compiled_depths_with_generation_stay_within_the_recompile_limit(early):
    """Two compiled models, each training and generating cached and uncached for 1 and 2 sequences: 14 graphs of one
    forward, past dynamo's default limit of 8, after which the last calls would silently run uncompiled. bench.py
    raises the limit to what it needs and makes hitting it an error; the eager backend captures the same graphs
    without the compiler's minutes."""
    result, _ = early
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [model[2:] for model, _, _ in rows(lines)] == [("float32", ", compiled")] * 2
    m = re.fullmatch(r"compile: (\d+) graphs, within the recompile limit of (\d+)", lines[-1])
    assert m and 8 < int(m.group(1)) <= int(m.group(2)), lines[-1]


def test_compare_dtypes_prints_three_rows_and_their_ratios(early):
    result, _ = early
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[1] == ("compare_dtypes: training only (generation: one precision at a time, by --dtype and "
                        "--compile), each precision in turn in about 20 s of compare_seconds=60 (compiling is not cut)")
    assert not any(line.startswith(("generate: ", "memory: ")) for line in lines)  # training only
    assert all("(median of 3)" in line for line in lines if line.startswith("train: "))  # all fit the share
    models = [re.fullmatch(MODEL, line) for line in lines if line.startswith("model: ")]
    train = [float(re.fullmatch(TRAIN, line).group(1)) for line in lines if line.startswith("train: ")]
    assert [m.groups()[2:] for m in models] == [("float32", None), ("bfloat16", None), ("bfloat16", ", compiled")]
    m = re.fullmatch(rf"compare: n_layer=1 x n_loop=3: bfloat16 trains at {NUM}x the tokens/s of float32, "
                     rf"bfloat16 compiled at {NUM}x", lines[-2])
    assert m, lines[-2]
    assert [float(x) for x in m.groups()] == pytest.approx([train[1] / train[0], train[2] / train[0]], abs=0.01)
    assert re.fullmatch(r"compile: \d+ graphs, within the recompile limit of \d+", lines[-1])


def test_compare_dtypes_prints_each_precision_before_the_next_and_cuts_steps_to_its_share(early):
    """Each precision's rows come before the next precision's model is built; with no time to share, every one skips
    its second warm-up step and is timed on one step, not three."""
    result, _ = early
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split(":")[0] for line in result.stdout.splitlines()]
    assert lines[2:] == ["(a model is built)", "model", "train"] * 3 + ["compare", "compile"], result.stdout
    lines = result.stdout.splitlines()
    assert "each precision in turn in about 0 s of compare_seconds=0 " in lines[1]
    train = [line for line in lines if line.startswith("train: ")]
    assert all("(median of 1)" in line for line in train), train
    assert re.fullmatch(rf"compare: n_layer=1 x n_loop=3: bfloat16 trains at {NUM}x the tokens/s of float32, "
                        rf"bfloat16 compiled at {NUM}x", lines[-2]), lines[-2]


CACHE = rf"cache (per_visit|last_loop): {NUM} MB for (\d) x 32 positions, cached {NUM} ms/step \({NUM} tokens/s\)"
EXIT_TEST = rf"exit test: all 3 loops, each followed by the KL test: {NUM} ms/step \({NUM} tokens/s\); a loop costs " \
            r"(-?[0-9.]+) ms, a test (-?[0-9.]+) ms"


def test_compare_caches_prints_each_layouts_bytes_and_decode_speed_and_the_exit_tests_cost():
    result = bench("--compare_caches=True", "--dtype=float32", "--compile=False")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    caches = [re.fullmatch(CACHE, line) for line in lines if line.startswith("cache ")]
    assert all(caches) and [(m.group(1), m.group(3)) for m in caches] == [
        ("per_visit", "1"), ("last_loop", "1"), ("per_visit", "2"), ("last_loop", "2")]
    for m in caches:  # 3 visits of 1 block, or the block once: keys and values of 32 positions x 32 channels, float32
        entries = 3 if m.group(1) == "per_visit" else 1
        assert float(m.group(2)) == float(f"{entries * 2 * int(m.group(3)) * 32 * 32 * 4 / 1e6:.3g}")
        assert float(m.group(5)) == pytest.approx(int(m.group(3)) * 1000 / float(m.group(4)), rel=0.01)
    tests = [re.fullmatch(EXIT_TEST, line) for line in lines if line.startswith("exit test: ")]
    assert len(tests) == 2 and all(tests), lines
    # the generate lines are still there, one per sequence count, each followed by its comparison
    generate = [i for i, line in enumerate(lines) if line.startswith("generate: ")]
    assert [lines[i + 1].startswith("cache per_visit: ") for i in generate] == [True, True]
