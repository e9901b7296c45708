import ctypes
import io
import platform
import random
import sys

import numpy as np
import pytest
import torch

import runtime
from model import GPT
from models import tiny
from runtime import (autocast_context, choose_dtype, default_peak_flops, rng_states, set_rng_states, synchronize,
                    tune_malloc)


@pytest.fixture
def gpu(monkeypatch):
    """A made-up CUDA device: set its name and whether it computes bfloat16 natively."""
    card = dict(name="NVIDIA A100-SXM4-80GB", native_bf16=True, synchronized=[])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: card["name"])
    # only the native answer counts: called without including_emulation=False this returns True for every card
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation or card["native_bf16"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: card["synchronized"].append(device))
    return card


def test_cuda_with_native_bf16_gets_bfloat16_older_cuda_float16(gpu):
    assert choose_dtype("cuda") == ("bfloat16", "NVIDIA A100-SXM4-80GB computes bfloat16 natively")
    gpu.update(name="Tesla V100-SXM2-16GB", native_bf16=False)
    assert choose_dtype("cuda:1") == ("float16", "Tesla V100-SXM2-16GB has no native bfloat16, so float16 with loss "
                                                 "scaling")


@pytest.fixture
def timings(monkeypatch):
    """Made-up measurements on a CPU with bfloat16 instructions: set the milliseconds of each timed training step that
    time_training_steps reports per dtype; its calls."""
    made_up = dict(ms=dict(float32=[10.0, 10.0, 10.0], bfloat16=[5.0, 5.0, 5.0]), calls=[])

    def measure(model, batch_shape):
        made_up["calls"].append((model, batch_shape))
        return {dtype: [t / 1e3 for t in ms] for dtype, ms in made_up["ms"].items()}, 4, 1.25
    monkeypatch.setattr(runtime, "time_training_steps", measure)
    monkeypatch.setattr(runtime, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    return made_up


MODEL = object()  # what choose_dtype hands on to the (made-up) measurement


@pytest.mark.parametrize("float32_ms,bfloat16_ms,expected,spread,needed", [
    ([10.0, 12.0, 10.2], [5.0, 9.0, 5.1], "bfloat16", "2%", 1.05),  # the fastest steps count: others only add time
    ([5.0, 5.1, 5.2], [10.0, 10.0, 10.0], "float32", "2%", 1.05),  # float32 the faster
    ([10.0, 10.0, 10.0], [9.6, 9.6, 9.6], "float32", "0%", 1.05),  # 1.04x: within the margin, so float32
    ([10.0, 10.0, 10.0], [8.0, 9.6, 30.0], "bfloat16", "20%", 1.20),  # 1.25x, beyond a spread of 20%
    ([10.0, 10.0, 10.0], [8.0, 10.4, 10.8], "float32", "30%", 1.30),  # 1.25x, but the next step was 30% slower
])
def test_a_cpu_takes_the_faster_precision_by_training_steps_and_float32_when_close(float32_ms, bfloat16_ms, expected,
                                                                                   spread, needed, timings, gpu):
    timings["ms"] = dict(float32=float32_ms, bfloat16=bfloat16_ms)
    gain = min(float32_ms) / min(bfloat16_ms)
    assert choose_dtype("cpu", "auto", MODEL, (16, 128)) == (
        expected, f"training steps of this model on 4 of the batch's 16 sequences of 128 tokens, measured in 1.2 s: "
                  f"the fastest of 3 steps: bfloat16 {min(bfloat16_ms):.1f} ms, float32 {min(float32_ms):.1f} ms, "
                  f"bfloat16 {gain:.2f}x as fast; it needs {needed:.2f}x (the second-fastest steps up to {spread} "
                  f"slower, and at least 5%)")
    assert timings["calls"] == [(MODEL, (16, 128))]
    assert choose_dtype("cuda") == ("bfloat16", "NVIDIA A100-SXM4-80GB computes bfloat16 natively")  # per device


def test_a_cpu_without_bfloat16_instructions_keeps_float32_unmeasured(timings, monkeypatch):
    monkeypatch.setattr(runtime, "cpu_flags", lambda: {"avx2", "fma"})  # a Zen 3: bfloat16 ran at 0.07x-0.10x
    assert choose_dtype("cpu", "auto", MODEL, (16, 128)) == (
        "float32", "this CPU has no bfloat16 instructions (avx512_bf16, amx_bf16): it would emulate them")
    assert timings["calls"] == []


def test_auto_on_a_cpu_needs_a_model_to_measure(timings):
    with pytest.raises(ValueError, match="dtype=auto on a CPU measures training steps of the model"):
        choose_dtype("cpu", "auto")


def test_a_script_that_runs_no_training_step_gets_float32_for_auto_on_a_cpu_unmeasured(timings, gpu, monkeypatch):
    """sample.py and lab.eval_downstream: auto's rule on a CPU times training steps, which is not their work."""
    dtype, why, _ = runtime.precision("cpu", "auto", untrained_because="it only reads")
    assert (dtype, why, timings["calls"]) == ("float32", "auto on a CPU: it only reads", [])
    assert runtime.precision("cpu", "bfloat16", untrained_because="it only reads")[:2] == ("bfloat16", "as set")
    monkeypatch.setattr(runtime, "allow_tf32", lambda device: None)  # a process-wide switch, not this test's to flip
    assert runtime.precision("cuda", "auto", untrained_because="it only reads")[:2] == (
        "bfloat16", "NVIDIA A100-SXM4-80GB computes bfloat16 natively")  # a GPU's rule times nothing


def test_an_explicit_dtype_or_a_resumed_cpu_runs_own_wins_over_a_measurement(timings, gpu):
    assert choose_dtype("cpu", "float32", MODEL, (16, 128)) == ("float32", "as set")
    assert choose_dtype("cpu", "bfloat16", MODEL, (16, 128), trained_on=("float32", "cpu")) == ("bfloat16", "as set")
    for trained in ("float32", "bfloat16", "float16"):  # float16 only as set, but a CPU run's own all the same
        assert choose_dtype("cpu", "auto", MODEL, (16, 128), trained_on=(trained, "cpu")) == (
            trained, "the precision its checkpoint was trained in on a CPU (a measurement could differ)")
    assert timings["calls"] == []  # nothing measured
    # a GPU's rule does not depend on a measurement: it stays
    assert choose_dtype("cuda", "auto", trained_on=("float32", "cpu"))[0] == "bfloat16"


@pytest.mark.parametrize("trained_on", [("bfloat16", "cuda"), ("float16", "cuda:1"), ("bfloat16", None), (None, "cpu")])
def test_a_cpu_resuming_a_gpu_checkpoint_measures(trained_on, timings):
    """A GPU's bfloat16 (or a V100's float16 with loss scaling) is no CPU's choice: kept, it ran 3.1x slower than
    float32 on a CPU that emulates bfloat16. A checkpoint of another device, or of unknown device or dtype (written
    before the config held them), gets the CPU's own rule."""
    timings["ms"] = dict(float32=[10.0] * 3, bfloat16=[30.0] * 3)
    dtype, why = choose_dtype("cpu", "auto", MODEL, (16, 128), trained_on=trained_on)
    assert dtype == "float32" and why.startswith("training steps of this model") and timings["calls"]


def test_the_measurement_trains_a_copy_within_its_bounds_and_leaves_seeds_and_threads_alone(monkeypatch):
    monkeypatch.setattr(runtime, "MEASURE_SECONDS", 0.0)  # the fewest rounds
    torch.manual_seed(0)
    model = GPT(tiny())
    weights, threads, state = {k: v.clone() for k, v in model.state_dict().items()}, torch.get_num_threads(), \
        torch.get_rng_state()
    times, sequences, seconds = runtime.time_training_steps(model, (3, 32))
    assert set(times) == {"float32", "bfloat16"} and all(len(steps) == runtime.MEASURE_ROUNDS[0]
                                                         for steps in times.values())
    assert sequences == 1 and seconds >= sum(map(sum, times.values())) > 0  # a step over 0 s: one sequence
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert torch.get_num_threads() == threads and torch.equal(torch.get_rng_state(), state)
    monkeypatch.setattr(runtime, "MEASURE_SECONDS", 1e6)  # the most rounds, on the whole batch
    times, sequences, _ = runtime.time_training_steps(model, (3, 32))
    assert sequences == 3 and all(len(steps) == runtime.MEASURE_ROUNDS[1] for steps in times.values())


def test_explicit_dtype_is_kept_and_unknown_is_an_error():
    assert choose_dtype("cpu", "float16") == ("float16", "as set")
    assert choose_dtype("mps") == ("float32", "no half-precision rule for mps")
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; choose auto, float32, bfloat16 or float16"):
        choose_dtype("cpu", "fp8")
    with pytest.raises(ValueError, match="unknown dtype 'auto'; choose float32, bfloat16 or float16"):
        autocast_context("cpu", "auto")  # resolve auto first


@pytest.mark.parametrize("flags,times", [("avx512f", {"bfloat16": 1, "float16": 1}),
                                         ("avx512f avx512_bf16 avx512_fp16", {"bfloat16": 2, "float16": 2}),
                                         ("avx512f avx512_bf16 amx_bf16 amx_tile", {"bfloat16": 16, "float16": 1})])
def test_mfu_on_a_cpu_is_against_the_peak_of_the_precision_it_computes_in(flags, times, monkeypatch):
    """Divided by float32's peak, a bfloat16 run reads 122.9% MFU on a Xeon with AMX: each precision has its own peak,
    derived from float32's by what the CPU's instructions for it compute per cycle, and says so."""
    cpuinfo = f"processor\t: 0\ncpu MHz\t\t: 2000.000\nflags\t\t: fpu {flags}\n"
    monkeypatch.setattr(runtime, "open", lambda path, *args: io.StringIO(cpuinfo), raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    float32 = 2 * 2000e6 * 2 * 16 * 2
    assert default_peak_flops("cpu", "float32") == (float32, "2 threads x 2000 MHz x AVX512 in float32")
    for dtype in ("bfloat16", "float16"):
        flops, source = default_peak_flops("cpu", dtype)
        assert flops == float32 * times[dtype]
        assert source.startswith(f"2 threads x 2000 MHz x AVX512 in float32, x {times[dtype]} in {dtype} (")
        assert source.endswith(f"(no {dtype} instructions: float32's)") == (times[dtype] == 1)


def test_synchronize_and_peak_flops_use_the_device_given(gpu):
    synchronize("cuda:1")
    synchronize("cpu")  # nothing to wait for
    assert gpu["synchronized"] == ["cuda:1"]
    for name, flops in (("NVIDIA H100 NVL", 835e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA H100 PCIe", 756e12),
                        ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12)):
        gpu["name"] = name
        assert default_peak_flops("cuda:1", "bfloat16") == (flops, f"{name} datasheet")


class FakeLibc:
    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 1


@pytest.mark.parametrize("system,libc,applies", [("linux", ("glibc", "2.36"), True), ("linux", ("musl", ""), False),
                                                 ("darwin", ("", ""), False), ("win32", ("", ""), False)])
def test_malloc_is_tuned_on_glibc_linux_only(system, libc, applies, monkeypatch):
    fake = FakeLibc()
    monkeypatch.setattr(sys, "platform", system)
    monkeypatch.setattr(platform, "libc_ver", lambda *args, **kwargs: libc)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    assert tune_malloc() is applies
    # M_MMAP_THRESHOLD (-3) and M_TRIM_THRESHOLD (-1) raised to the largest int mallopt takes
    assert fake.calls == ([(-3, 2**31 - 1), (-1, 2**31 - 1)] if applies else [])


MALLINFO = """
import ctypes, sys
import torch
from runtime import tune_malloc
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
if sys.argv[1] == "tuned":
    assert tune_malloc()
t = torch.ones(64 << 20)  # 256 MB, like a training step's logits
mmapped = libc.mallinfo2().hblkhd
del t
print(mmapped >> 20, libc.mallinfo2().fordblks >> 20)  # MB served by mmap while alive; MB kept free in the heap
"""


EARLY = {"test_tuned_malloc_keeps_a_freed_large_buffer_in_the_process":
         lambda folder: [["-c", MALLINFO, "stock"], ["-c", MALLINFO, "tuned"]]}


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_tuned_malloc_keeps_a_freed_large_buffer_in_the_process(early):
    result, _ = early  # a process of its own per allocator, started with the session (conftest.py)
    assert result.returncode == 0, result.stderr
    (stock_mmapped, stock_kept), (tuned_mmapped, tuned_kept) = [map(int, line.split()) for line in
                                                                result.stdout.splitlines()]
    assert stock_mmapped >= 256 and stock_kept < 256  # glibc's default: mapped for the buffer, unmapped on free
    assert tuned_mmapped < 256 and tuned_kept >= 256  # tuned: from the heap, and still there to reuse after free


def test_random_generator_states_restore_every_generator():
    states = rng_states("cpu")
    assert states["cuda"] is None and all(states[k].dtype == torch.float64 for k in ("numpy", "python"))
    first = torch.rand(3), np.random.rand(3), random.random(), random.gauss(0, 1)
    set_rng_states(states, "cpu")
    again = torch.rand(3), np.random.rand(3), random.random(), random.gauss(0, 1)
    assert torch.equal(first[0], again[0]) and (first[1] == again[1]).all() and first[2:] == again[2:]


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "gpu", "mps", "meta", "", "cuda:x"])
def test_a_device_this_machine_lacks_is_named_with_the_ones_it_has(device, monkeypatch):
    """As on a machine without CUDA or MPS (whatever this one has): one line for every way of naming a device that
    is not there, where torch fails with an AssertionError, a RuntimeError or not at all (meta: nothing to train on)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ValueError) as e:
        runtime.check_device(device)
    assert str(e.value) == f"--device={device} is not usable here (the devices here: cpu); use one of them"


def test_the_devices_this_machine_has_pass(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for device in ("cpu", "cpu:0", "cuda", "cuda:0", "cuda:1"):
        runtime.check_device(device)
    with pytest.raises(ValueError, match=r"^--device=cuda:2 is not usable here \(the devices here: cpu, cuda:0, "
                                         r"cuda:1\); use one of them$"):
        runtime.check_device("cuda:2")
