import ctypes
import platform
import random
import sys

import numpy as np
import pytest
import torch

import runtime
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
    """Made-up measurements: set the (float32, bfloat16) milliseconds that time_block_matmuls reports; its calls."""
    made_up = dict(ms=(10.0, 5.0), calls=[])

    def measure(n_embd, rows):
        made_up["calls"].append((n_embd, rows))
        return made_up["ms"][0] / 1e3, made_up["ms"][1] / 1e3, min(rows, 64)
    monkeypatch.setattr(runtime, "time_block_matmuls", measure)
    return made_up


@pytest.mark.parametrize("float32_ms,bfloat16_ms,expected", [
    (10.0, 5.0, "bfloat16"),
    (10.0, 8.6, "bfloat16"),  # 1.16x
    (10.0, 9.0, "float32"),  # 1.11x: close, so float32, which reproduces bit for bit
    (10.0, 30.0, "float32"),  # a CPU that emulates bfloat16
])
def test_a_cpu_takes_bfloat16_only_when_measured_clearly_faster(float32_ms, bfloat16_ms, expected, timings, gpu):
    timings["ms"] = (float32_ms, bfloat16_ms)
    assert choose_dtype("cpu", "auto", 256, 2048) == (
        expected, f"one block's matrix products (64 x 256, forward and backward) measured "
                  f"{float32_ms / bfloat16_ms:.2f}x as fast in bfloat16 as in float32 ({bfloat16_ms:.1f} ms against "
                  f"{float32_ms:.1f} ms of CPU time); bfloat16 needs 1.15x")
    assert timings["calls"] == [(256, 2048)]
    assert choose_dtype("cuda") == ("bfloat16", "NVIDIA A100-SXM4-80GB computes bfloat16 natively")  # per device


def test_an_explicit_dtype_or_a_resumed_cpu_runs_own_wins_over_a_measurement(timings, gpu):
    assert choose_dtype("cpu", "float32") == ("float32", "as set")
    assert choose_dtype("cpu", "bfloat16", trained_on=("float32", "cpu")) == ("bfloat16", "as set")
    for trained in ("float32", "bfloat16", "float16"):  # float16 only as set, but a CPU run's own all the same
        assert choose_dtype("cpu", "auto", trained_on=(trained, "cpu")) == (
            trained, "the precision its checkpoint was trained in on a CPU (a measurement could differ)")
    assert timings["calls"] == []  # nothing measured
    # a GPU's rule does not depend on a measurement: it stays
    assert choose_dtype("cuda", "auto", trained_on=("float32", "cpu"))[0] == "bfloat16"


@pytest.mark.parametrize("trained_on", [("bfloat16", "cuda"), ("float16", "cuda:1"), ("bfloat16", None), (None, "cpu")])
def test_a_cpu_resuming_a_gpu_checkpoint_measures(trained_on, timings):
    """A GPU's bfloat16 (or a V100's float16 with loss scaling) is no CPU's choice: kept, it ran 3.1x slower than
    float32 on a CPU that emulates bfloat16. A checkpoint of another device, or of unknown device or dtype (written
    before the config held them), gets the CPU's own rule."""
    timings["ms"] = (10.0, 30.0)  # bfloat16 emulated
    dtype, why = choose_dtype("cpu", "auto", 256, 2048, trained_on=trained_on)
    assert dtype == "float32" and why.startswith("one block's matrix products (64 x 256") and timings["calls"]


def test_the_measurement_is_capped_in_size_and_leaves_seeds_and_threads_alone(monkeypatch):
    monkeypatch.setattr(runtime, "MEASURE_FLOPS", 72 * 32 ** 2 * 20)  # 20 rows of width 32
    threads, state = torch.get_num_threads(), torch.get_rng_state()
    float32_seconds, bfloat16_seconds, rows = runtime.time_block_matmuls(32, 2048)
    assert rows == 20 and 0 < float32_seconds < 1 and 0 < bfloat16_seconds < 1
    assert runtime.time_block_matmuls(32, 12)[2] == 12  # fewer rows than the cap: as given
    assert torch.get_num_threads() == threads and torch.equal(torch.get_rng_state(), state)


def test_explicit_dtype_is_kept_and_unknown_is_an_error():
    assert choose_dtype("cpu", "float16") == ("float16", "as set")
    assert choose_dtype("mps") == ("float32", "no half-precision rule for mps")
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; choose auto, float32, bfloat16 or float16"):
        choose_dtype("cpu", "fp8")
    with pytest.raises(ValueError, match="unknown dtype 'auto'; choose float32, bfloat16 or float16"):
        autocast_context("cpu", "auto")  # resolve auto first


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
