"""
Measure a looped GPT on synthetic tokens: training throughput and MFU, and generation speed with and without the
KV cache for 1 and batch_size sequences, the cached step against its memory floor. No dataset or checkpoint needed.

    python -m lab.bench                                   # 2 blocks x 4 loops, n_embd 256, block_size 256, batch 8
    python -m lab.bench --compare_dtypes=True             # float32, bfloat16, bfloat16 compiled: training, ratios
    python -m lab.bench --compare_depths=True --gen_tokens=0   # and 8 blocks x 1 loop, same FLOPs: the ratio
    python -m lab.bench --tuned_malloc=False              # glibc's default allocator policy (see runtime.tune_malloc)
    python -m lab.bench --compare_caches=True             # kv_cache per_visit against last_loop; adaptive exit's test
    python -m lab.bench --gen_sequences=1,8,32 --gen_uncached=False --gen_compile_step=True --dtype=float32 \
        --warmup_steps=0 --timed_steps=1                  # the cached step against its floor, docs/speed.md's table
    python -m lab.bench --compile=True --n_layer=6 --n_loop=2 --n_head=12 --n_embd=768 --block_size=1024 \\
        --batch_size=12                                   # config/loop_small.py's model

Training: warm-up steps first (they include torch.compile's compilation and the allocator's first requests), then
the median of the timed steps, each a forward, a backward and an AdamW step; the models of one precision compared
(compare_depths) take turns step by step.
A comparison of precisions (compare_dtypes) benches training only, one precision after another, printing each one's
rows as soon as it is measured, within about compare_seconds in all, compiling included: a third for each precision.
Before a precision's first step, a forward and backward on a slice of the batch (uncompiled; from 1/64 of its tokens
up, 4 times as many each try, while the tries fit) predicts a step's time, and a precision whose step would not fit
in what is left of its share is not run: its line gives the predicted time (on a CPU that emulates bfloat16 a
bfloat16 step can take minutes). A precision whose steps so far show that
another round would end past its share skips the rest of its warm-up and is timed on fewer steps (one at least); one
whose first step alone ends past it is reported with that step's time and not timed further. torch.compile's
compilation, in a compiled precision's first step, cannot be predicted (on a CPU it can take a minute): it is the one
thing that can run past the share.
Generation: gen_tokens new tokens after a gen_prompt_len-token prompt, for 1 sequence and for batch_size
sequences (or the counts of gen_sequences), once with the KV cache and once recomputing the context at every step
(gen_uncached); the figures are per step after the prompt's pass. Past block_size the window slides as generation's
does. Compiled models generate compiled.
A cached decode step of few sequences is memory-bound: its floor is the bytes of weights and cache it must read
(lab.flops.decode_step_bytes: the weights at the precision they are stored in, the cache at the one the step computes
in, at the mean cache length of the generation) over the memory's read bandwidth, measured here in the same run; a
last line per model sets the cached step of every count of sequences against it. Its arithmetic sets another bound,
which can be the higher one for many sequences on few cores: its FLOPs (lab.flops.decode_step_flops) at the rate of
the fastest of a few large matrix products in the step's precision (runtime.matmul_rate), measured alike.
compare_caches adds, timed alike through the same blocks and precision: the cached step with each kv_cache layout of
lab.decode, the step at one loop, and the step with adaptive exit's test after every loop. gen_compile_step adds the
cached step compiled as one graph (runtime.compile_decode_step), the time its compilation took apart.
The figures are wall-clock: the first line says how busy the machine was (its load average).
"""

import math
import os
import statistics
import sys
import time

import torch
import torch._dynamo
from torch._dynamo.backends.registry import lookup_backend

from runtime import (DTYPES, autocast_context, choose_dtype, compile_decode_step, default_peak_flops, synchronize,
                     tune_malloc)
from configurator import configure, die
from model import GPT, GPTConfig
from lab.decode import KV_CACHES, exit_logits, generate_stream, new_caches
from lab.flops import (decode_step_bytes, decode_step_flops, flops_per_token, kv_cache_bytes, matmul_rate,
                       read_bandwidth)

# model
n_layer = 2
n_loop = 4
n_head = 4
n_embd = 256
block_size = 256
vocab_size = 50304  # GPT-2's vocabulary padded to a multiple of 64, as train.py uses for gpt2 tokens
residual = "deeploop"
residual_exponent = 0.0  # p of alpha = (2N)^p, beta = (8N)^-p; 0 = the scheme's own
residual_lambda = 1.0  # preln_scaled's lambda
norm = "layernorm"  # the backbone settings of train.py (GPTConfig): layernorm | rmsnorm
position_encoding = "learned"  # learned | rope
norm_branch_input = False
n_prelude = 0  # blocks once before and after the looped core, and the input fed into every loop (train.py's)
n_coda = 0
loop_input = "none"
# run
batch_size = 8
warmup_steps = 2
timed_steps = 5  # training throughput is the median of these
gen_tokens = 200  # new tokens per sequence in the generation benchmark (the first is the prompt's pass); 0 skips it
gen_prompt_len = 16  # past block_size - gen_prompt_len tokens the window slides: each step recomputes it all
gen_sequences = ""  # counts of sequences to generate for, e.g. 1,8,32; empty: 1 and batch_size
gen_uncached = True  # also time generation without the cache (at 32 sequences it takes minutes)
# also time the cached step compiled as a whole (runtime.compile_decode_step: autotuned, the weights frozen in), its
# compilation timed apart: 20-50 s on 2 CPU cores, again for the first count of sequences above 1
gen_compile_step = False
compare_depths = False  # also bench n_layer * n_loop blocks x 1 loop (same unrolled FLOPs) and print the ratio
compare_dtypes = False  # bench float32, bfloat16 and bfloat16 compiled side by side (instead of dtype and compile)
compare_seconds = 60.0  # about how long compare_dtypes takes in all, a third for each precision (see above)
# also decode with each kv_cache layout (lab.decode.new_caches): the bytes the cache allocates and the cached step's
# time; and the cost of adaptive exit's test after every loop (lab.decode.exit_logits, at a threshold that no loop
# passes)
compare_caches = False
tuned_malloc = True  # False keeps glibc's default allocator policy, to measure what runtime.tune_malloc gains
peak_flops = 0.0  # for MFU; 0 picks a default for the device and precision (runtime.default_peak_flops)
seed = 1337
device = "cuda" if torch.cuda.is_available() else "cpu"  # or cpu, cuda:1, mps
dtype = "auto"  # auto: the precision the device trains this model fastest in (runtime.choose_dtype); or float32, ...
compile = None  # torch.compile the model (warm-up steps absorb the compilation); None: on CUDA only
compile_backend = "inductor"  # torch.compile's backend; "eager" checks the graph capture without the compiler's time
configure(globals(), sys.argv[1:])

if (warmup_steps < 0 or timed_steps < 1 or gen_tokens < 0 or gen_tokens == 1 or not 1 <= gen_prompt_len <= block_size
        or not compare_seconds >= 0 or min(batch_size, n_head, n_embd, vocab_size) < 1):
    die("need --warmup_steps >= 0, --timed_steps >= 1, --gen_tokens 0 or >= 2, 1 <= --gen_prompt_len <= block_size, "
        "--compare_seconds >= 0, and --batch_size, --n_head, --n_embd, --vocab_size >= 1")
try:
    sequence_counts = sorted({int(n) for n in str(gen_sequences).split(",")}) if gen_sequences else [1, batch_size]
except ValueError:
    sequence_counts = [0]
if sequence_counts[0] < 1:
    die(f"--gen_sequences takes counts of sequences >= 1 like 1,8,32, got {gen_sequences!r}")
device_type = device.split(":")[0]
if compile is None:
    compile = device_type == "cuda" and not gen_compile_step
if gen_compile_step and (compile or compare_dtypes or not gen_tokens):
    die("--gen_compile_step times the uncompiled model's decode step against the compiled step: drop --compile=True "
        "and --compare_dtypes, keep --gen_tokens above 0")
try:
    torch.empty(0, device=device)
except Exception as e:  # RuntimeError, or AssertionError for CUDA in a CPU build of torch
    die(f"--device={device} is not usable here ({str(e).splitlines()[0]})")
depths = [(n_layer, n_loop)] + ([(n_layer * n_loop, 1)] if compare_depths else [])
try:
    configs = [GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=layers, n_loop=loops, n_head=n_head,
                         n_embd=n_embd, dropout=0.0, residual=residual, residual_exponent=residual_exponent,
                         residual_lambda=residual_lambda, norm=norm, position_encoding=position_encoding,
                         norm_branch_input=norm_branch_input, n_prelude=n_prelude, n_coda=n_coda,
                         loop_input=loop_input) for layers, loops in depths]
    if compile or compare_dtypes:  # a compiled model is benched
        lookup_backend(compile_backend)
    if dtype not in ("auto", *DTYPES):
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
except (ValueError, torch._dynamo.exc.InvalidBackend) as e:
    die(str(e))
malloc_line = "allocator: glibc malloc keeps freed memory (runtime.tune_malloc)" if tuned_malloc and tune_malloc() \
    else "allocator: the C library's defaults"
if not compare_dtypes:  # "auto" is no precision to build a model in: resolved by training steps of the first model
    torch.manual_seed(seed)
    measured = GPT(configs[0]) if dtype == "auto" and device_type == "cpu" else None
    dtype, dtype_reason = choose_dtype(device, dtype, measured, (batch_size, block_size))
precisions = [("float32", False), ("bfloat16", False), ("bfloat16", True)] if compare_dtypes else [(dtype, compile)]
# compile_blocks compiles the blocks one by one, and the blocks of all models share one function, Block.forward, whose
# graphs dynamo counts against one limit: a graph for each situation a block meets (training; the prompt, the cached
# step and the growing uncached context of 1 and batch_size sequences; the window's refill; compare_caches' last_loop
# cache, another class, and the exit test). Measured with the eager backend on tests/lab/test_bench.py's tiny model:
# at most 7 graphs of one function for training and generation, 19 with compare_caches, a sliding window, a prelude,
# a coda and rope (21 with compare_caches and the window through inductor), also with compare_depths' second model
# (the same unrolled depth, so the same alpha: the same graphs). Past the limit torch would silently run uncompiled:
# raise it to over twice what was measured, and fail if it is ever hit.
compiled_models = len(depths) * sum(compiled for _, compiled in precisions)
graphs_per_model = 48 if compare_caches else 16
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, graphs_per_model * compiled_models)
torch._dynamo.config.fail_on_recompile_limit_hit = True


def build(config, dtype, compile):
    """A model of this config with its optimizer, gradient scaler and autocast context, and the line that describes
    it."""
    torch.manual_seed(seed)
    model = GPT(config).to(device)
    line = (f"model: n_layer={config.n_layer} x n_loop={config.n_loop} (unrolled depth {config.unrolled_depth}), "
            f"n_embd {n_embd}, block_size {block_size}, {model.num_params() / 1e6:.2f}M params, {residual}, {device} "
            f"{dtype}{', compiled' if compile else ''}")
    if compile:
        model.compile_blocks(backend=compile_backend)  # in place: every pass runs them
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, betas=(0.9, 0.95),
                                           device_type=device_type)
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))  # float16 needs loss scaling
    return model, optimizer, scaler, autocast_context(device, dtype), line


def train_step(model, optimizer, scaler, ctx, x, y):
    """One forward, backward and AdamW step -> its seconds."""
    synchronize(device)
    t0 = time.perf_counter()
    with ctx:
        _, loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    return time.perf_counter() - t0


def predict_round(runs, x, y, left):
    """(seconds a round of training steps of the runs, one step each, would take, predicted without running one; the
    tokens it was predicted from): a forward and backward of each run, uncompiled, on a slice of the batch of 1/64
    of its tokens (at least 16), scaled up to the batch's tokens; then on 4 times as many tokens, and so on, until
    the prediction fits in `left` seconds, or the next try (at most 4 times the last one's time) would not. A small
    slice's fixed costs and per-operation overhead are scaled up too, so the prediction errs on the long side the
    smaller the slice; the optimizer step is left out."""
    start, tokens = time.perf_counter(), min(x.numel(), max(16, x.numel() // 64))
    while True:
        xs, ys = (t[:1, :tokens] if tokens <= block_size else t[:tokens // block_size] for t in (x, y))
        seconds = 0.0
        for model, _, _, ctx, _ in runs:
            synchronize(device)
            t0 = time.perf_counter()
            with torch.compiler.set_stance("force_eager"), ctx:
                _, loss = model(xs, ys)
            loss.backward()
            synchronize(device)
            seconds += time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
        predicted, elapsed = seconds * x.numel() / xs.numel(), time.perf_counter() - start
        if predicted <= left - elapsed or xs.numel() == x.numel() or 4 * seconds > left - elapsed:
            return predicted, xs.numel()
        tokens *= 4


def train_steps(runs, x, y, share):
    """(seconds of a training step of each run, the steps timed): warmup_steps untimed, then timed_steps timed, the
    runs taking turns step by step, so that a change in load slows them alike; the median of the timed steps. Once
    another round like the last would end past `share` seconds from the start, the rest of the warm-up is skipped,
    and the timing stops as soon as one step is timed. If the first round alone ends past `share`, nothing more
    runs: its seconds, and 0 steps timed."""
    times = [[] for _ in runs]
    start, step = time.perf_counter(), 0
    while step < warmup_steps + timed_steps:
        round_start = time.perf_counter()
        round_times = [train_step(model, optimizer, scaler, ctx, x, y) for model, optimizer, scaler, ctx, _ in runs]
        if step >= warmup_steps:
            for run_times, dt in zip(times, round_times):
                run_times.append(dt)
        step += 1
        now = time.perf_counter()
        if step == 1 and now - start > share and not times[0]:
            return round_times, 0
        if now - start + (now - round_start) > share:
            if step < warmup_steps:
                step = warmup_steps
            elif times[0]:
                break
    return [statistics.median(run_times) for run_times in times], len(times[0])


def speed_against(seconds, reference):
    """The ", 0.01x float32's speed" of a line: seconds of a step (or a round) against float32's, where float32 was
    timed (reference; else nothing)."""
    return f", {reference / seconds:.2g}x float32's speed" if reference else ""


def tokens_stream(model, prompt, tokens, use_cache, kv_cache="per_visit", n_loop=None, exit_test=False,
                  next_logits=None):
    """The new tokens of a generation of each of the prompt's sequences, step by step: the model's own generation
    (through next_logits if set: runtime.compile_decode_step's), the lab's for another cache layout, or with exit_test
    adaptive exit's decoding with the test after every loop and no exit: lab.decode.generate_stream's pass at
    threshold 0, which no KL passes (generate_stream itself reads 0 as off)."""
    if exit_test:
        return model.generate_stream(prompt, tokens, top_k=200, caches=new_caches(model),
                                     next_logits=lambda ids, caches: exit_logits(model, ids, 0.0, caches=caches)[0])
    if kv_cache == "per_visit":
        return model.generate_stream(prompt, tokens, top_k=200, n_loop=n_loop, use_cache=use_cache,
                                     next_logits=next_logits)
    return generate_stream(model, prompt, tokens, top_k=200, n_loop=n_loop, kv_cache=kv_cache)


def generation_step(model, ctx, prompt, use_cache, **kw):
    """Seconds per step of generation (one new token for each of the prompt's sequences) after the prompt's pass,
    the mean of gen_tokens - 1 steps; kw: tokens_stream's."""
    # warm-up: 4 tokens reach the steady state of the cached and the uncached step, including torch.compile's
    # recompiles; where the window will slide, up to its second refill
    slides = gen_prompt_len + gen_tokens > block_size
    with ctx, torch.no_grad():
        for _ in tokens_stream(model, prompt, block_size - gen_prompt_len + 2 if slides else 4, use_cache, **kw):
            pass
        steps = tokens_stream(model, prompt, gen_tokens, use_cache, **kw)
        next(steps)  # the prompt's pass
        synchronize(device)
        t0 = time.perf_counter()
        for _ in steps:
            pass
        synchronize(device)
    return (time.perf_counter() - t0) / (gen_tokens - 1)


def cache_bytes(model, ctx, prompt, kv_cache):
    """Bytes of the buffers that a cache of this layout allocates for the prompt's sequences (room for block_size
    positions each)."""
    caches = new_caches(model, kv_cache=kv_cache)
    with ctx, torch.no_grad():
        model(prompt, caches=caches)
    return sum(k.nbytes + v.nbytes for k, v in {id(c.k): (c.k, c.v) for c in caches}.values())


def compare_caches_lines(model, ctx, prompt):
    """compare_caches' lines for these sequences: each layout's bytes and cached step, then the exit test's cost. All
    steps are timed alike (generation_step), through the same blocks in the same precision."""
    sequences, lines, steps = prompt.size(0), [], {}
    for kv_cache in KV_CACHES:
        steps[kv_cache] = generation_step(model, ctx, prompt, True, kv_cache=kv_cache)
        lines.append(f"cache {kv_cache}: {cache_bytes(model, ctx, prompt, kv_cache) / 1e6:.3g} MB for {sequences} x "
                     f"{block_size} positions, cached {steps[kv_cache] * 1e3:.2f} ms/step "
                     f"({sequences / steps[kv_cache]:.1f} tokens/s)")
    one_loop = generation_step(model, ctx, prompt, True, n_loop=1)
    tested = generation_step(model, ctx, prompt, True, exit_test=True)
    per_loop = (steps["per_visit"] - one_loop) / max(n_loop - 1, 1)
    lines.append(f"exit test: all {n_loop} loops, each followed by the KL test: {tested * 1e3:.2f} ms/step "
                 f"({sequences / tested:.1f} tokens/s); a loop costs {per_loop * 1e3:.3f} ms, a test "
                 f"{(tested - steps['per_visit']) / (n_loop + 1) * 1e3:.3f} ms")
    return lines


def bench_generation(model, optimizer, ctx, dtype):
    """Generation's rows of a trained model."""
    optimizer.state.clear()  # frees the AdamW moments before generation
    model.eval()
    bandwidth, rate = read_bandwidth(device), matmul_rate(device, dtype)
    print(f"memory: reads {bandwidth / 1e9:.1f} GB/s (best of sums and vector-matrix products over 256 MiB); "
          f"computes {rate / 1e9:.3g} GFLOP/s in {dtype} (best of large square matrix products)")
    past, cache_size, weight_size = gen_prompt_len + gen_tokens / 2, getattr(torch, dtype).itemsize, \
        model.lm_head.weight.element_size()
    ratios, compiled_step = [], compile_decode_step(model) if gen_compile_step else None
    for sequences in sequence_counts:
        prompt = torch.randint(vocab_size, (sequences, gen_prompt_len), device=device)
        cached = generation_step(model, ctx, prompt, True)
        step_bytes = decode_step_bytes(model, sequences, past, cache_size, weight_size=weight_size)
        step_flops = decode_step_flops(model, sequences, past)
        floor, arithmetic = step_bytes / bandwidth, step_flops / rate
        uncached = generation_step(model, ctx, prompt, False) if gen_uncached else None
        uncached_figures = f", uncached {uncached * 1e3:.2f} ms/step ({sequences / uncached:.1f} tokens/s), cache " \
                           f"speed-up {uncached / cached:.1f}x" if uncached else ""
        print(f"generate: {gen_tokens} new tokens x {sequences} sequence{'s' if sequences > 1 else ''}: "
              f"cached {cached * 1e3:.2f} ms/step ({sequences / cached:.1f} tokens/s){uncached_figures}; a cached "
              f"step reads {step_bytes / 1e6:.3g} MB: floor {floor * 1e3:.3g} ms, cached step {cached / floor:.2f}x "
              f"the floor; its {step_flops / 1e6:.3g} MFLOP take {arithmetic * 1e3:.3g} ms or more "
              f"({arithmetic / floor:.2f}x the floor)")
        ratios.append(f"{sequences} sequence{'s' if sequences > 1 else ''} {cached * 1e3:.2f} ms, "
                      f"{cached / floor:.2f}x")
        if compiled_step:
            t0 = time.perf_counter()
            with ctx:
                for _ in tokens_stream(model, prompt, 2, True, next_logits=compiled_step):  # the first step compiles
                    pass
            compiling = time.perf_counter() - t0
            compiled = generation_step(model, ctx, prompt, True, next_logits=compiled_step)
            print(f"compiled step (runtime.compile_decode_step): {compiled * 1e3:.2f} ms/step "
                  f"({sequences / compiled:.1f} tokens/s), {compiled / floor:.2f}x the floor, {cached / compiled:.2f}x "
                  f"the speed of the cached step; its first step and the prompt's pass took {compiling:.1f} s "
                  f"(compiling)")
            ratios.append(f"compiled {compiled * 1e3:.2f} ms, {compiled / floor:.2f}x")
        if compare_caches:
            print("\n".join(compare_caches_lines(model, ctx, prompt)))
    weights = decode_step_bytes(model, 0, 0, cache_size, weight_size=weight_size)
    print(f"floor: a cached step reads the weights once, {weights / 1e6:.3g} MB ({weight_size} bytes each, as "
          f"stored), and the keys and values of {past:g} positions per sequence in every visit, "
          f"{kv_cache_bytes(model, 1, past, cache_size) / 1e6:.3g} MB per sequence, at {bandwidth / 1e9:.1f} GB/s; "
          f"the cached step{' (and compiled)' if gen_compile_step else ''} and its ratio to the floor: "
          f"{'; '.join(ratios)}")
    sys.stdout.flush()


print(f"{malloc_line}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs, "
      f"torch threads {torch.get_num_threads()}")
share = compare_seconds / len(precisions) if compare_dtypes else math.inf  # each precision's time to train
if compare_dtypes:
    print(f"compare_dtypes: training only (generation: one precision at a time, by --dtype and --compile), each "
          f"precision in turn within about {share:.3g} s of compare_seconds={compare_seconds:g}, compiling included",
          flush=True)
else:
    print(f"dtype {dtype}: {dtype_reason}")
# one fixed random batch: the speed of a step does not depend on which tokens it sees
x = torch.randint(vocab_size, (batch_size, block_size), device=device)
y = torch.randint(vocab_size, (batch_size, block_size), device=device)
tokens_per_step = batch_size * block_size
throughput = []  # tokens/s of each model, precision by precision, each at every depth; None: not timed
rounds = {}  # compare_dtypes: (seconds of a round of training steps of each dtype, how they were found)
float32_seconds = None  # compare_dtypes: float32's step of each depth, once timed
for precision, compiled in precisions:
    name, start = f"{precision}{' compiled' if compiled else ''}", time.perf_counter()
    # a dtype measured or predicted too slow already is not even built
    runs = [] if rounds.get(precision, (0,))[0] > share else [build(config, precision, compiled) for config in configs]
    if compare_dtypes:
        if precision not in rounds:
            predicted, probed = predict_round(runs, x, y, share - (time.perf_counter() - start))
            rounds[precision] = predicted, f"predicted from a forward and backward on {probed} of its " \
                                           f"{tokens_per_step} tokens"
        estimate, how = rounds[precision]
        if estimate > share - (time.perf_counter() - start):
            print(f"{name}: one training step would take about {estimate:.3g} s"
                  f"{speed_against(estimate, float32_seconds and sum(float32_seconds))} ({how}), more than its share "
                  f"of {share:.3g} s; not timed", flush=True)
            throughput += [None] * len(depths)
            continue
    seconds, timed = train_steps(runs, x, y, share - (time.perf_counter() - start))
    rounds[precision] = sum(seconds), f"as {name} took"
    for (model, optimizer, _, ctx, line), dt, reference in zip(runs, seconds, float32_seconds or [None] * len(runs)):
        print(line)
        if not timed:  # the first step alone overran the share
            print(f"{name}: one step took {dt:.3g} s{speed_against(dt, reference)}"
                  f"{' (compiling included)' if compiled else ''}, past its share of {share:.3g} s; not timed further")
        else:
            peak = peak_flops or default_peak_flops(device, precision)[0]  # the peak of the precision it computes in
            mfu = flops_per_token(model) * tokens_per_step / dt / peak
            print(f"train: {tokens_per_step / dt:.0f} tokens/s, {dt * 1000:.1f} ms/step (median of {timed}), "
                  f"MFU {mfu * 100:.2f}% of {peak / 1e9:.0f} GFLOP/s")
        throughput.append(tokens_per_step / dt if timed else None)
        sys.stdout.flush()
        if gen_tokens and not compare_dtypes:
            bench_generation(model, optimizer, ctx, precision)
    if precision == "float32" and timed:
        float32_seconds = seconds
    runs = model = optimizer = None  # this precision's models and optimizer states, before the next precision's
if compare_dtypes:
    for depth in range(len(depths)):
        row = throughput[depth::len(depths)]
        ratios = [f"{row[i] / row[0]:.2f}x" if row[i] and row[0] else "(not timed)" for i in (1, 2)]
        print(f"compare: n_layer={depths[depth][0]} x n_loop={depths[depth][1]}: bfloat16 trains at {ratios[0]} the "
              f"tokens/s of float32, bfloat16 compiled at {ratios[1]}")
if compare_depths:
    looped, untied = throughput[0], throughput[1]  # the first precision's two depths
    ratio = f"{looped / untied:.3f}x" if looped and untied else "(not timed)"
    print(f"compare: n_layer={n_layer} x n_loop={n_loop} trains at {ratio} the tokens/s "
          f"of n_layer={n_layer * n_loop} x n_loop=1 (same unrolled FLOPs)"
          f"{' (float32)' if compare_dtypes else ''}")
if compile or compare_dtypes:
    most = max(torch._dynamo.convert_frame.FRAME_COMPILE_COUNTER.values(), default=0)  # of one function
    print(f"compile: {torch._dynamo.utils.counters['stats']['unique_graphs']} graphs, at most {most} of one function, "
          f"within the recompile limit of {torch._dynamo.config.recompile_limit}")
