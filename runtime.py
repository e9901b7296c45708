"""
What the scripts (train.py, sample.py, bench.py, eval_downstream.py) share about running on a device: the
allocator, the precision, a compiled decode step, timing, the MFU yardstick, and the random generators' states.
Nothing here runs on import; each script calls what it needs.

The precision rule (`choose_dtype`, for dtype="auto"):
    CUDA with native bfloat16 (Ampere and newer)         -> bfloat16 autocast
    CUDA without it (V100, T4: bfloat16 only emulated)    -> float16 autocast with loss scaling (GradScaler)
    CPU without bfloat16 instructions                     -> float32 (bfloat16 emulated ran at 0.07x-0.10x its speed)
    CPU with them                                         -> measured: a few training steps of the run's own model on
                                                             its batch shape in each; bfloat16 autocast when its fastest
                                                             step is faster by a margin beyond the steps' spread
    anything else (Apple's MPS)                           -> float32
CPU flags do not predict the answer: a Xeon with avx512_bf16 but no AMX trained bench.py's model at 0.64x the speed in
bfloat16, a Zen 4 EPYC with the same flags at 1.62x. Nor does a part of the step: one block's matrix products timed
alone left out the output layer and attention, and picked float32 for a model that trains 1.99x as fast in bfloat16
on a Xeon with AMX. A close call keeps float32, which reproduces bit for bit. A measurement is noisy, so on a CPU a
resumed run keeps the precision its checkpoint was trained in when that was on a CPU too (a GPU's bfloat16 or float16
is no CPU's pick), and sweep.py decides once for all its runs.
Weights and optimizer state stay float32 in every case (autocast casts per operation), so a checkpoint resumes in any
dtype.
"""

import ctypes
import math
import os
import platform
import random
import statistics
import sys
import time
from contextlib import nullcontext
from copy import deepcopy

import numpy as np
import torch

DTYPES = ("float32", "bfloat16", "float16")
BFLOAT16_MARGIN = 0.05  # on a CPU, bfloat16 must train this much faster than float32 at least (and beyond the spread)
MEASURE_ROUNDS = (3, 7)  # rounds of timed training steps, one of each dtype: at least (for a spread), at most
MEASURE_SECONDS = 3.0  # no round of timed steps starts that would end past this many seconds after the warm-up


def tune_malloc():
    """On glibc Linux, keep freed memory in the process instead of handing it back to the OS -> True if applied.

    glibc serves every allocation above its mmap threshold (at most 32 MB by default) with a fresh mmap and unmaps it
    on free, and trims the heap top back to the OS. A training step's logits and activations are hundreds of MB, so
    each step page-faulted them in again: bench.py's default model in float32 (one thread) spent 0.98 s of its 3.73
    CPU-seconds per step in the kernel; with both thresholds raised, 0 s of 2.84 (1.3x less CPU time per step).
    Other C libraries and systems keep their own policies: untouched.
    Call it before the first large allocation; it is process-wide and lasts until the process exits. Processes that a
    script starts with subprocess are Python scripts of this project and call it themselves."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # from glibc's malloc.h
    limit = 2**31 - 1  # mallopt takes a C int: 2 GiB, larger than any one buffer of the models here on a CPU
    return bool(libc.mallopt(M_MMAP_THRESHOLD, limit)) and bool(libc.mallopt(M_TRIM_THRESHOLD, limit))


def check_device(device):
    """Raise ValueError (one line naming the devices this machine has) unless device is one to run on here: cpu,
    cuda or cuda:N of a GPU that is there, mps where torch has it. Each script checks before it builds anything, so
    that no traceback from deep inside torch (a CPU build's "Torch not compiled with CUDA enabled") ends a run."""
    here = ["cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count())),
            *(["mps"] if torch.backends.mps.is_available() else [])]
    try:
        parsed = torch.device(device)
        name = parsed.type if parsed.type != "cuda" else f"cuda:{parsed.index or 0}"
    except RuntimeError:
        name = None
    if name != "cpu" and name not in here:
        raise ValueError(f"--device={device} is not usable here (the devices here: {', '.join(here)}); use one of them")


def time_training_steps(model, batch_shape, dtypes=("float32", "bfloat16")):
    """({dtype: [seconds of each timed step]}, sequences per step, seconds it all took): training steps of a copy of
    model (forward, backward and AdamW step, as configure_optimizers makes it) on random tokens, in each dtype through
    autocast as training runs it, on the threads the process has, in wall time. First an untimed step of each on one
    sequence of batch_shape's (first-use costs: kernels generated, buffers allocated), then a second, warm one, which
    sizes the timed steps: as many of batch_shape's sequences as fit in MEASURE_SECONDS / 10 at that step's pace (one
    at least; untimed once more if more than one). Then rounds of one step of each, the dtypes taking turns, so that
    a change in load slows them alike: at least MEASURE_ROUNDS[0], at most MEASURE_ROUNDS[1], and no round starts
    that would end past MEASURE_SECONDS. Fewer sequences than the run's weigh the optimizer step and autocast's
    casts of the weights more, which err towards float32. The run's model keeps its weights, and its random
    generators their states."""
    copy = deepcopy(model).train()
    optimizer = copy.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cpu")
    generator = torch.Generator().manual_seed(0)
    x, y = (torch.randint(copy.config.vocab_size, batch_shape, generator=generator) for _ in range(2))

    def step(dtype, sequences):
        t0 = time.perf_counter()
        with autocast_context("cpu", dtype):
            loss = copy(x[:sequences], y[:sequences])[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    times = {dtype: [] for dtype in dtypes}
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        for dtype in dtypes:  # first use: kernels generated, buffers allocated
            step(dtype, 1)
        one = max(step(dtype, 1) for dtype in dtypes)
        sequences = max(1, min(batch_shape[0], int(MEASURE_SECONDS / 10 / one)))
        if sequences > 1:
            for dtype in dtypes:
                step(dtype, sequences)
        timed_from = time.perf_counter()
        while len(times[dtypes[0]]) < MEASURE_ROUNDS[1]:
            round_start = time.perf_counter()
            for dtype in dtypes:
                times[dtype].append(step(dtype, sequences))
            now = time.perf_counter()
            if len(times[dtypes[0]]) >= MEASURE_ROUNDS[0] and now - timed_from + (now - round_start) > MEASURE_SECONDS:
                break
    return times, sequences, time.perf_counter() - start


def cpu_flags():
    """The instruction-set flags of this machine's first CPU (x86 "flags", Arm "Features"); an empty set where
    /proc/cpuinfo cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split(":", 1)[1] for line in f if line.startswith(("flags", "Features"))),
                            "").split())
    except OSError:
        return set()


def choose_bfloat16(times):
    """(whether bfloat16 trains clearly faster, the words that say why) from time_training_steps' timings. Other
    processes only ever add time to a step, so each dtype counts its fastest step, and its spread is how far its
    second-fastest lies above that; bfloat16 only where float32's fastest step is at least 1 + the margin times
    bfloat16's, the margin being BFLOAT16_MARGIN or the larger spread, whichever is larger."""
    fastest = {dtype: sorted(seconds)[:2] for dtype, seconds in times.items()}
    spread = max(second / first - 1 for first, second in fastest.values())
    gain, needed = fastest["float32"][0] / fastest["bfloat16"][0], 1 + max(BFLOAT16_MARGIN, spread)
    return gain >= needed, (f"the fastest of {len(times['float32'])} steps: bfloat16 "
                            f"{fastest['bfloat16'][0] * 1e3:.1f} ms, float32 {fastest['float32'][0] * 1e3:.1f} ms, "
                            f"bfloat16 {gain:.2f}x as fast; it needs {needed:.2f}x (the second-fastest steps up to "
                            f"{spread:.0%} slower, and at least {BFLOAT16_MARGIN:.0%})")


def choose_dtype(device, dtype="auto", model=None, batch_shape=None, trained_on=None):
    """(dtype, why) for a device: dtype as given, or for "auto" the rule in this module's docstring. model and
    batch_shape (sequences, tokens of each): what a CPU measures training steps of (time_training_steps); trained_on,
    (dtype, device) of the checkpoint a run resumes (its config's), keeps that dtype on a CPU if the checkpoint was
    trained on a CPU. Raises ValueError for an unknown dtype, or for "auto" on a CPU without a model to measure."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
        return dtype, "as set"
    device_type = device.split(":")[0]
    if device_type == "cuda":
        name = torch.cuda.get_device_name(device)
        # including_emulation=False: a V100 or T4 "supports" bfloat16 only through slow emulation
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bfloat16", f"{name} computes bfloat16 natively"
        return "float16", f"{name} has no native bfloat16, so float16 with loss scaling"
    if device_type == "cpu":
        if trained_on and trained_on[0] and str(trained_on[1]).split(":")[0] == "cpu":
            return trained_on[0], "the precision its checkpoint was trained in on a CPU (a measurement could differ)"
        if (flags := cpu_flags()) and not flags & {"avx512_bf16", "amx_bf16", "bf16"}:
            choice = ["float32", "this CPU has no bfloat16 instructions (avx512_bf16, amx_bf16): it would emulate them"]
        else:
            if model is None or batch_shape is None:
                raise ValueError("dtype=auto on a CPU measures training steps of the model: give choose_dtype the "
                                 "model and batch_shape, or a dtype")
            times, sequences, seconds = time_training_steps(model, batch_shape)
            faster, why = choose_bfloat16(times)
            choice = ["bfloat16" if faster else "float32",
                      f"training steps of this model on {sequences} of the batch's {batch_shape[0]} sequences of "
                      f"{batch_shape[1]} tokens, measured in {seconds:.1f} s: {why}"]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(choice, src=0)  # DDP: every process takes the master's pick
        return tuple(choice)
    return "float32", f"no half-precision rule for {device_type}"


def allow_tf32(device):
    """On CUDA, let float32 matmuls and convolutions use TF32 tensor cores (as nanoGPT does): a process-wide switch,
    made explicitly by the scripts that want it. Elsewhere nothing changes."""
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def autocast_context(device, dtype):
    """The context a forward pass runs in: float32 as it is, bfloat16 or float16 through autocast."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose float32, bfloat16 or float16")
    device_type = device.split(":")[0]  # autocast wants "cuda", not "cuda:1"
    return nullcontext() if dtype == "float32" else torch.autocast(device_type=device_type, dtype=getattr(torch, dtype))


def precision(device, dtype, model=None, batch_shape=None, trained_on=None, untrained_because=None):
    """(dtype, why, autocast context) for a script that runs on device: choose_dtype's pick, and TF32 matmuls allowed
    on CUDA (allow_tf32). A script that runs no training step gives untrained_because, why auto's rule on a CPU (which
    times training steps) does not fit its work: auto is float32 there. Raises ValueError for an unknown dtype."""
    if dtype == "auto" and untrained_because and device.split(":")[0] == "cpu":
        dtype, why = "float32", f"auto on a CPU: {untrained_because}"
    else:
        dtype, why = choose_dtype(device, dtype, model, batch_shape, trained_on)
    allow_tf32(device)
    return dtype, why, autocast_context(device, dtype)


def compile_decode_step(model, n_loop=None):
    """GPT.generate_stream's next_logits for model with each decode step (one new token per sequence, the rest read
    from the cache) as one compiled graph: inductor autotunes every product for its few rows (max_autotune; on a CPU
    its own GEMM kernels win over oneDNN's) and freezes the weights in as constants laid out for them (freezing), so
    the graph keeps the weights it was compiled with: for generation only. Compiling takes 20-50 s on 2 CPU cores,
    at the first step and once more at the first of several sequences (one sequence is a graph of its own).
    The prompt's pass runs uncompiled, and so does the step that fills the cache, whose keys, the whole buffer,
    have another layout (compiling it would take as long again for one step)."""
    import torch._inductor.config as inductor  # here: importing it costs every start a second

    def pass_(ids, caches):
        return model(ids, None, n_loop, caches, True)[0]

    step = torch.compile(pass_, dynamic=True, options=dict(max_autotune=True))

    def next_logits(ids, caches):
        if not compiled_step_runs(ids, caches, model.config.block_size):
            return pass_(ids, caches)
        with inductor.patch(freezing=True):  # read when compiling; as an option of torch.compile it is ignored
            # a copy: the strides of idx[:, -1:] grow with the text, and one of 1 x 1 would compile it again
            return step(ids.clone(memory_format=torch.contiguous_format), caches)
    return next_logits


def compiled_step_runs(ids, caches, block_size):
    """Whether compile_decode_step's next_logits runs its compiled graph for these ids and caches: for one new token a
    sequence, not for the prompt (nor a sliding window's refill) and not for the step that fills the cache."""
    return bool(caches) and 0 < caches[0].past < block_size - 1 and ids.size(1) == 1


def rng_states(device):
    """This process's random generator states (torch's, device's if CUDA, numpy's, Python's), as tensors, since a
    weights_only checkpoint holds no numpy or Python objects. Mersenne Twister words are below 2^32, so float64 holds
    them exactly."""
    _, words, pos, has_gauss, gauss = np.random.get_state()
    _, python_words, python_gauss = random.getstate()
    return dict(torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state(device) if device.startswith("cuda") else None,
                numpy=torch.tensor([*words, pos, has_gauss, gauss], dtype=torch.float64),
                python=torch.tensor([*python_words, math.nan if python_gauss is None else python_gauss],
                                    dtype=torch.float64))


def set_rng_states(states, device):
    """Restore what rng_states returned (its CUDA state only on a CUDA device)."""
    torch.set_rng_state(states["torch"].cpu())
    if device.startswith("cuda") and states["cuda"] is not None:
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)
    v = states["numpy"].tolist()
    np.random.set_state(("MT19937", np.array(v[:624], dtype=np.uint32), int(v[624]), int(v[625]), v[626]))
    v = states["python"].tolist()
    random.setstate((3, tuple(int(w) for w in v[:-1]), None if math.isnan(v[-1]) else v[-1]))


def cpu_name():
    """The CPU's name with its family and model (one name covers several generations: AMD EPYC is Zen 3 at family
    25, Zen 5 at family 26)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
    except OSError:
        return platform.processor() or "a CPU"
    info = {k.strip(): v.strip() for k, v in info.items()}
    return f"{info.get('model name', 'a CPU')} (family {info.get('cpu family', '?')}, model {info.get('model', '?')})"


def machine():
    """What a run's numbers depend on besides its settings: kernels sum in another order on another CPU, torch
    version or thread count (the same seed in float32 on a Zen 3 and a Zen 4 ended 0.012 apart)."""
    return dict(cpu=cpu_name(), torch=torch.__version__, threads=torch.get_num_threads())


def matrix_params(modules):
    """Weights of the matrix products in these modules, the only parameters that cost FLOPs per token (PaLM's
    accounting, appendix B; biases, norm gains and embedding lookups are left out)."""
    return sum(p.numel() for module in modules if module is not None for p in module.parameters() if p.dim() >= 2)


def flops_per_token(model, n_loop=None, backprop_loops=0):
    """Training FLOPs per token of a step that runs n_loop core loops (None: the model's), with gradients through the
    last backprop_loops of them (0: all; lab.loops.TruncatedBackprop). A matrix product costs 2 FLOPs per weight and
    token forward and 4 backward; attention's scores and weighted sum 4 * n_embd * block_size forward per visit and
    twice that backward. Forward: every visit, the prelude and coda once, the output layer once, concat's adapter at
    each loop after the first. Backward: the visits gradients reach only: the tracked loops, the coda and the output
    layer always, the adapter in the tracked loops after the first, and the prelude where a tracked loop reads its
    output (the first loop, or any loop that the input is fed into)."""
    cfg, t = model.config, model.transformer
    loops = n_loop or cfg.n_loop
    tracked = min(backprop_loops, loops) if backprop_loops else loops
    core, prelude, coda = (matrix_params(blocks) for blocks in (t.h, t.prelude, t.coda))
    adapter = matrix_params([t.inject.adapter]) if t.inject is not None and t.inject.adapter is not None else 0
    head = model.lm_head.weight.numel()
    attention = 4 * cfg.n_embd * cfg.block_size  # per visit, forward
    prelude_learns = tracked == loops or cfg.loop_input != "none"
    adapter_runs_tracked = tracked - (tracked == loops)  # the first loop reads the input without the adapter
    forward = 2 * (core * loops + prelude + coda + head + adapter * (loops - 1)) + attention * cfg.depth(loops)
    backward = 4 * (core * tracked + coda + head + adapter * adapter_runs_tracked + prelude * prelude_learns) + \
        2 * attention * (cfg.n_layer * tracked + cfg.n_coda + cfg.n_prelude * prelude_learns)
    return forward + backward


def synchronize(device):
    """Wait until the given device has finished its queued work (timings must include it): on CUDA, the device named,
    not the current one."""
    device_type = device.split(":")[0]
    if device_type == "cuda":
        torch.cuda.synchronize(device)
    elif device_type == "mps":
        torch.mps.synchronize()


# per CPU core and cycle, half-precision products against float32's: (flag, times float32's FLOPs, why)
HALF_PRECISION_PEAKS = dict(
    bfloat16=[("amx_bf16", 16, "AMX: 1024 bfloat16 FLOPs a cycle against 64 of AVX-512 in float32"),
              ("avx512_bf16", 2, "avx512_bf16's dot products: 2 bfloat16 products per float32 lane")],
    float16=[("amx_fp16", 16, "AMX: 1024 float16 FLOPs a cycle against 64 of AVX-512 in float32"),
             ("avx512_fp16", 2, "avx512_fp16: twice float32's lanes")])


def default_peak_flops(device, dtype):
    """(FLOP/s of one device in dtype, where the number comes from), the yardstick of MFU when none is given. GPUs we
    know: the datasheet's dense bf16/fp16 number. CPUs: threads x clock x 2 FMA units x float32 SIMD lanes x 2 FLOPs
    per FMA, an estimate for server cores, but the same in every run (timing matmuls on shared cores varies 10x); in
    bfloat16 or float16 that times what the CPU's flags say its instructions for them compute per cycle
    (HALF_PRECISION_PEAKS; without them the CPU computes them no faster than float32). Anything else: the fastest of a
    few timed large matmuls."""
    device_type = device.split(":")[0]
    if device_type == "cuda" and dtype != "float32":
        name = torch.cuda.get_device_name(device)
        # the first key found in the name wins: NVL and PCIe cards before the SXM parts they share a name with
        for key, flops in (("H100 NVL", 835e12), ("H200 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
                           ("H200", 989e12), ("A100", 312e12)):
            if key in name:
                return flops, f"{name} datasheet"
    if device_type == "cpu" and os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            mhz = max([float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")], default=0)
        simd = torch.backends.cpu.get_cpu_capability()
        lanes = {"AVX512": 16, "AVX2": 8}.get(simd, 4)
        if mhz:
            flops = torch.get_num_threads() * mhz * 1e6 * 2 * lanes * 2
            source = f"{torch.get_num_threads()} threads x {mhz:.0f} MHz x {simd} in float32"
            flags = cpu_flags()
            times, why = next(((times, why) for flag, times, why in HALF_PRECISION_PEAKS.get(dtype, [])
                               if flag in flags), (1, f"no {dtype} instructions: float32's"))
            return flops * times, source if dtype == "float32" else f"{source}, x {times} in {dtype} ({why})"
    return matmul_rate(device, dtype), "measured matmuls"


def matmul_rate(device, dtype):
    """FLOP/s of the fastest of ten products of two n x n matrices in dtype (n = 8192 on a GPU, 1024 on a CPU)."""
    n = 8192 if device.split(":")[0] == "cuda" else 1024
    a = torch.full((n, n), 0.5, device=device, dtype=getattr(torch, dtype))  # no random numbers: the seeds stay put
    best = math.inf
    for _ in range(11):  # the first one warms up; the fastest of the rest is the least disturbed by other processes
        synchronize(device)
        t0 = time.perf_counter()
        a @ a
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best
