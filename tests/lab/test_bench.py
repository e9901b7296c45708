import contextlib
import re
import time

import pytest
import torch
import torch._dynamo

from model import GPT
from scripts import block_calls_counted, run_script

NUM = r"([0-9.]+)"
TINY = ["--n_layer=1", "--n_loop=3", "--n_head=2", "--n_embd=32", "--block_size=32", "--vocab_size=128",
        "--batch_size=2", "--warmup_steps=1", "--timed_steps=3", "--gen_tokens=8", "--gen_prompt_len=4", "--device=cpu"]
MODEL = r"model: n_layer=(\d+) x n_loop=(\d+) \(unrolled depth 3\), n_embd 32, .*, cpu (\w+)(, compiled)?"
TRAIN = rf"train: {NUM} tokens/s, {NUM} ms/step \(median of 3\), MFU {NUM}% of {NUM} GFLOP/s"
MEMORY = rf"memory: reads {NUM} GB/s \(best of sums and vector-matrix products over 256 MiB\); computes {NUM} GFLOP/s " \
         r"in (?:float32|bfloat16) \(best of large square matrix products\)"
GENERATE = rf"generate: 8 new tokens x (\d) sequences?: cached {NUM} ms/step \({NUM} tokens/s\), uncached {NUM} " \
           rf"ms/step \({NUM} tokens/s\), cache speed-up {NUM}x; a cached step reads {NUM} MB: floor {NUM} ms, " \
           rf"cached step {NUM}x the floor; its {NUM} MFLOP take {NUM} ms or more \({NUM}x the floor\)"


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
            for m in generate:  # the arithmetic's bound: the step's FLOPs at the rate the memory line gives
                mflop, arithmetic_ms, ratio, floor_ms = (float(m.group(k)) for k in (10, 11, 12, 8))
                assert arithmetic_ms == pytest.approx(mflop / float(memory.group(2)), rel=0.02)
                assert ratio == pytest.approx(arithmetic_ms / floor_ms, rel=0.02, abs=0.006)
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
        for sequences, (cached_ms, tokens_per_s, _, _, _, _, floor_ms, ratio, *_) in generate.items():
            # the figures as printed, rounded: ms to 0.01 (a fast CPU's step is a few tenths of one), floor to 3 digits
            low_ms, high_ms = cached_ms - 0.005, cached_ms + 0.005
            assert sequences * 1000 / high_ms * 0.999 <= tokens_per_s <= sequences * 1000 / low_ms * 1.001
            assert low_ms / (floor_ms * 1.005) - 0.005 <= ratio <= high_ms / (floor_ms * 0.995) + 0.005
        assert generate[2][8] == pytest.approx(2 * generate[1][8], rel=0.01)  # MFLOP: twice the work for 2 sequences
    m = re.fullmatch(rf"compare: n_layer=1 x n_loop=3 trains at {NUM}x the tokens/s of n_layer=3 x n_loop=1 "
                     r"\(same unrolled FLOPs\)", lines[-1])
    assert m, lines[-1]
    assert float(m.group(1)) == pytest.approx(found[0][1][0] / found[1][1][0], rel=0.01)  # the ratio of the lines


def test_bench_with_dtype_auto_benches_the_precision_choose_dtype_picks():
    """The default dtype, "auto", is resolved (runtime.choose_dtype) before any model is built in it."""
    result = bench("--compile=False")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    m = re.fullmatch(r"dtype (float32|bfloat16): training steps of this model on \d+ of the batch's \d+ sequences of "
                     r"\d+ tokens, measured in [0-9.]+ s: the fastest of \d+ steps: bfloat16 [0-9.]+ ms, .*", lines[1]) \
        or re.fullmatch(r"dtype (float32): this CPU has no bfloat16 instructions .*", lines[1])  # not measured
    assert m, lines[1]
    assert [model[2] for model, _, _ in rows(lines)] == [m.group(1)]


# started with the session (conftest.py): compiling takes 5-20 s
EARLY = {"test_compiled_depths_with_generation_stay_within_the_recompile_limit": lambda folder: [[
    "-m", "lab.bench", *TINY, "--compare_depths=True", "--compile=True", "--compile_backend=eager", "--dtype=float32"]],
    "test_compare_dtypes_prints_three_rows_and_their_ratios": lambda folder: [[
    "-m", "lab.bench", *TINY, "--compare_dtypes=True", "--compile_backend=eager", "--warmup_steps=0"]],
    "test_compiled_compare_caches_runs_every_block_compiled_within_the_recompile_limit": lambda folder: [[
    "-c", block_calls_counted("lab.bench", "stdout"), *TINY, "--compare_caches=True", "--compile=True",
    "--compile_backend=eager", "--dtype=float32", "--gen_tokens=40"]]}


def test_compiled_depths_with_generation_stay_within_the_recompile_limit(early):
    """Two compiled models, each training and generating cached and uncached for 1 and 2 sequences, within the
    recompile limit that bench.py sets (hitting it is an error there: past it the calls would silently run
    uncompiled); the eager backend captures the same graphs without the compiler's minutes."""
    result, _ = early
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [model[2:] for model, _, _ in rows(lines)] == [("float32", ", compiled")] * 2
    m = re.fullmatch(r"compile: (\d+) graphs, at most (\d+) of one function, within the recompile limit of (\d+)",
                     lines[-1])
    assert m and int(m.group(1)) > 1 and 1 < int(m.group(2)) <= int(m.group(3)), lines[-1]


def test_compare_dtypes_prints_three_rows_and_their_ratios(early):
    result, _ = early
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[1] == ("compare_dtypes: training only (generation: one precision at a time, by --dtype and "
                        "--compile), each precision in turn within about 20 s of compare_seconds=60, compiling "
                        "included")
    assert not any(line.startswith(("generate: ", "memory: ")) for line in lines)  # training only
    assert all("(median of 3)" in line for line in lines if line.startswith("train: "))  # all fit the share
    models = [re.fullmatch(MODEL, line) for line in lines if line.startswith("model: ")]
    train = [float(re.fullmatch(TRAIN, line).group(1)) for line in lines if line.startswith("train: ")]
    assert [m.groups()[2:] for m in models] == [("float32", None), ("bfloat16", None), ("bfloat16", ", compiled")]
    m = re.fullmatch(rf"compare: n_layer=1 x n_loop=3: bfloat16 trains at {NUM}x the tokens/s of float32, "
                     rf"bfloat16 compiled at {NUM}x", lines[-2])
    assert m, lines[-2]
    assert [float(x) for x in m.groups()] == pytest.approx([train[1] / train[0], train[2] / train[0]], abs=0.01)
    assert re.fullmatch(r"compile: \d+ graphs, at most \d+ of one function, within the recompile limit of \d+",
                        lines[-1])


CACHE = rf"cache (per_visit|last_loop): {NUM} MB for (\d) x 32 positions, cached {NUM} ms/step \({NUM} tokens/s\)"
EXIT_TEST = rf"exit test: all 3 loops, each followed by the KL test: {NUM} ms/step \({NUM} tokens/s\); a loop costs " \
            r"(-?[0-9.]+) ms, a test (-?[0-9.]+) ms"


def compare_caches_lines(lines):
    """compare_caches' lines checked: the bytes of each layout, the tokens/s of the printed steps, the exit test's
    line after each generate line's comparison."""
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


def test_compare_caches_prints_each_layouts_bytes_and_decode_speed_and_the_exit_tests_cost():
    """40 new tokens after 4: past block_size 32, where the window slides, also in the exit test's decoding."""
    result = bench("--compare_caches=True", "--dtype=float32", "--compile=False", "--gen_tokens=40")
    assert result.returncode == 0, result.stderr
    compare_caches_lines(result.stdout.splitlines())


def test_compiled_compare_caches_runs_every_block_compiled_within_the_recompile_limit(early):
    """Compiled, compare_caches decodes with the last_loop cache, at one loop and with the exit test, and here past
    block_size: more graphs of one function than dynamo's default limit of 8, all within the limit bench.py sets, and
    every call of a block, the exit test's too, runs compiled (a limit hit fails the run instead)."""
    result, _ = early
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    compare_caches_lines(lines)
    m = re.fullmatch(r"compile: \d+ graphs, at most (\d+) of one function, within the recompile limit of (\d+)",
                     lines[-2])
    assert m and 8 < int(m.group(1)) <= int(m.group(2)), lines[-2]
    m = re.fullmatch(r"block calls: (\d+) compiled, 0 not", lines[-1])
    assert m and int(m.group(1)) > 1000, lines[-1]


@pytest.mark.parametrize("setting, message", [
    ("--loop_input=foo", "unknown loop_input 'foo'; choose one of none, add, concat"),
    ("--n_prelude=-1", "n_prelude and n_coda must be >= 0 (0 = none), got n_prelude=-1 n_coda=0"),
    ("--n_loop=5000", "n_loop must be a loop count from 1 to 1024 (model.MAX_LOOPS), got 5000"),
    ("--n_head=0", "need --warmup_steps >= 0, --timed_steps >= 1, --gen_tokens 0 or >= 2, "),
    ("--gen_tokens=1", "need --warmup_steps >= 0, --timed_steps >= 1, --gen_tokens 0 or >= 2, "),
    ("--gen_compile_step=True", "--gen_compile_step times the uncompiled model's decode step against the compiled "
     "step: drop --compile=True and --compare_dtypes, keep --gen_tokens above 0"),
    ("--compile_backend=foo", "Invalid backend: 'foo'"),
    ("--device=foo", "--device=foo is not usable here (Expected one of cpu, cuda, "),
])
def test_bad_settings_are_one_line_errors_before_any_work(setting, message):
    result = run_script("lab/bench.py", *TINY, "--compile=True", setting)
    assert result.returncode == 2 and result.stdout == "" and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: {message}"), result.stderr


@contextlib.contextmanager
def dynamo_settings_kept():
    """Dynamo's settings that bench.py changes for its process, put back afterwards. By hand: monkeypatch (pytest
    9.2) undoes a setattr on torch._dynamo.config by deleting the attribute, which hides it from every later test."""
    saved = {name: getattr(torch._dynamo.config, name) for name in ("recompile_limit", "fail_on_recompile_limit_hit")}
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch._dynamo.config, name, value)


@pytest.fixture
def dynamo_settings():
    with dynamo_settings_kept():
        yield


def test_dynamo_settings_kept_puts_the_values_back_and_keeps_the_settings():
    limit, fail = torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit
    with dynamo_settings_kept():
        torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit = limit + 7, not fail
    assert (torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit) == (limit, fail)
    assert {"recompile_limit", "fail_on_recompile_limit_hit"} <= set(torch._dynamo.config.get_config_copy())


@pytest.fixture
def slow_steps(monkeypatch, dynamo_settings):
    """slow_steps({(dtype, whole batch): seconds}): every forward pass in that precision (float32, or bfloat16 under
    autocast) on the whole batch of 2 sequences (True) or on fewer, bench's prediction (False), sleeps that long
    first; and a line on stdout each time a model is built."""
    forward, init = GPT.forward, GPT.__init__

    def logged(self, *args, **kwargs):
        print("(a model is built)", flush=True)
        init(self, *args, **kwargs)

    def setup(seconds):
        def slowed(self, idx, *args, **kwargs):
            precision = "bfloat16" if torch.is_autocast_enabled("cpu") else "float32"
            time.sleep(seconds.get((precision, idx.size(0) == 2), 0))
            return forward(self, idx, *args, **kwargs)
        monkeypatch.setattr(GPT, "forward", slowed)
        monkeypatch.setattr(GPT, "__init__", logged)
    return setup


def test_compare_dtypes_cuts_a_precision_to_its_share_and_reports_one_whose_first_step_overran_it(slow_steps):
    """A share of 2 s each. float32, 0.3 s a step: two warm-up steps, then steps timed until another would end past
    its share. bfloat16, 2.5 s a step, on the batch only: its prediction (on 16 of the 64 tokens, not slowed; 0.89 s
    once on a busy machine) fits, its first step overruns: reported and not timed further. bfloat16 compiled, as slow
    as bfloat16, is not even built (nothing compiles here). The comparison goes on to its last lines."""
    slow_steps({("float32", True): 0.3, ("bfloat16", True): 2.5})
    result = bench("--compare_dtypes=True", "--compare_seconds=6", "--warmup_steps=2", "--compile_backend=eager")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[2:]] == [
        "(a model is built)", "model", "train", "(a model is built)", "model", "bfloat16", "bfloat16 compiled",
        "compare", "compile"], result.stdout
    assert "each precision in turn within about 2 s of compare_seconds=6, compiling included" in lines[1]
    float32 = re.fullmatch(r"train: ([0-9.]+) tokens/s, ([0-9.]+) ms/step \(median of [1-5]\), .*", lines[4])
    assert float32 and float(float32.group(2)) >= 300, lines[4]
    m = re.fullmatch(r"bfloat16: one step took ([0-9.]+) s, ([0-9.]+)x float32's speed, past its share of 2 s; not "
                     r"timed further", lines[7])
    assert m and float(m.group(1)) >= 2.5, lines[7]
    assert float(m.group(2)) == pytest.approx(float(float32.group(2)) / 1000 / float(m.group(1)), rel=0.06)
    m = re.fullmatch(r"bfloat16 compiled: one training step would take about ([0-9.]+) s, [0-9.]+x float32's speed "
                     r"\(as bfloat16 took\), more than its share of 2 s; not timed", lines[8])
    assert m and float(m.group(1)) >= 2.5, lines[8]
    assert lines[9] == ("compare: n_layer=1 x n_loop=3: bfloat16 trains at (not timed) the tokens/s of float32, "
                        "bfloat16 compiled at (not timed)")


def test_compare_dtypes_skips_a_precision_whose_predicted_step_overruns_its_share(slow_steps):
    """bfloat16 takes 0.5 s for any forward pass, so that the prediction (16 of the 64 tokens, scaled by 4) says 2 s,
    past its share of 1 s, and a try on 4 times the tokens would not fit either: neither bfloat16 precision runs a
    step, and float32's rows are printed in full."""
    slow_steps({("bfloat16", True): 0.5, ("bfloat16", False): 0.5})
    result = bench("--compare_dtypes=True", "--compare_seconds=3", "--compile_backend=eager")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[2:]] == [
        "(a model is built)", "model", "train", "(a model is built)", "bfloat16", "bfloat16 compiled", "compare",
        "compile"], result.stdout
    assert re.fullmatch(TRAIN, lines[4]), lines[4]  # float32 on all 3 timed steps
    m = re.fullmatch(r"bfloat16: one training step would take about ([0-9.]+) s, [0-9.]+x float32's speed "
                     r"\(predicted from a forward and backward on 16 of its 64 tokens\), more than its share of 1 s; "
                     r"not timed", lines[6])
    assert m and float(m.group(1)) >= 2, lines[6]
    assert lines[7].startswith(f"bfloat16 compiled: one training step would take about {m.group(1)} s, ")
    assert "bfloat16 trains at (not timed) the tokens/s of float32, bfloat16 compiled at (not timed)" in lines[8]


def test_compare_dtypes_with_no_time_runs_no_step(dynamo_settings):
    result = bench("--compare_dtypes=True", "--compare_seconds=0", "--compile_backend=eager")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(": one training step would take about ")[0] for line in lines[2:5]] == [
        "float32", "bfloat16", "bfloat16 compiled"], result.stdout
    assert lines[5] == ("compare: n_layer=1 x n_loop=3: bfloat16 trains at (not timed) the tokens/s of float32, "
                        "bfloat16 compiled at (not timed)")
