"""
Measure a looped GPT on synthetic tokens: training throughput and MFU, and generation speed with and without the
KV cache for 1 and batch_size sequences, the cached step against its memory floor. No dataset or checkpoint needed.

    python bench.py                                        # 2 blocks x 4 loops, n_embd 256, block_size 256, batch 8
    python bench.py --compare_dtypes=True                  # float32, bfloat16, bfloat16 compiled: training, ratios
    python bench.py --compare_depths=True --gen_tokens=0   # and 8 blocks x 1 loop, same FLOPs: the ratio
    python bench.py --tuned_malloc=False                   # glibc's default allocator policy (see runtime.tune_malloc)
    python bench.py --compare_caches=True                  # kv_cache per_visit against last_loop; adaptive exit's test
    python bench.py --compile=True --n_layer=6 --n_loop=2 --n_head=12 --n_embd=768 --block_size=1024 --batch_size=12
                                                           # config/loop_small.py's model

Training: warm-up steps first (they include torch.compile's compilation and the allocator's first requests), then
the median of the timed steps, each a forward, a backward and an AdamW step; the models of one precision compared
(compare_depths) take turns step by step. A comparison of precisions trains one precision after another and prints
each one's rows as soon as it is measured; it benches training only, within about compare_seconds in all: a
precision whose steps so far show that another round would end past its share (a third) skips the rest of its
warm-up, and is timed on fewer steps (one at least). On a CPU that emulates bfloat16 (about 0.1x float32's speed)
its steps are that much slower; torch.compile's compilation, which on a CPU can take a minute by itself, is not cut.
Generation: gen_tokens new tokens after a gen_prompt_len-token prompt, for 1 sequence and for batch_size
sequences, once with the KV cache and once recomputing the context at every step; compiled models generate compiled.
A cached decode step is memory-bound: its floor is the bytes of weights and cache it must read
(lab.flops.decode_step_bytes, at the mean cache length of the generation) over the memory's read bandwidth, measured
here.
The figures are wall-clock: the first line says how busy the machine was (its load average).
"""

import math
import os
import statistics
import sys
import time

import torch
import torch._dynamo

from runtime import autocast_context, choose_dtype, default_peak_flops, synchronize, tune_malloc
from configurator import configure, die
from model import GPT, GPTConfig
from lab.decode import KV_CACHES, exit_logits, generate_stream, new_caches
from lab.flops import decode_step_bytes, flops_per_token

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
gen_tokens = 200  # new tokens per sequence in the generation benchmark; 0 skips it
gen_prompt_len = 16  # keep gen_prompt_len + gen_tokens <= block_size, or the cache is rebuilt once the window slides
compare_depths = False  # also bench n_layer * n_loop blocks x 1 loop (same unrolled FLOPs) and print the ratio
compare_dtypes = False  # bench float32, bfloat16 and bfloat16 compiled side by side (instead of dtype and compile)
compare_seconds = 60.0  # about how long compare_dtypes takes in all, a third for each precision (see above)
# also decode with each kv_cache layout (lab.decode.new_caches): the bytes the cache allocates and the cached step's
# time; and the cost of adaptive exit's test after every loop (lab.decode.exit_logits, with a threshold that no loop passes)
compare_caches = False
tuned_malloc = True  # False keeps glibc's default allocator policy, to measure what runtime.tune_malloc gains
peak_flops = 0.0  # for MFU; 0 picks a default for the device (default_peak_flops below)
seed = 1337
device = "cuda" if torch.cuda.is_available() else "cpu"  # or cpu, cuda:1, mps
dtype = "auto"  # auto: the fastest precision the device computes natively (runtime.choose_dtype); or float32, ...
compile = None  # torch.compile the model (warm-up steps absorb the compilation); None: on CUDA only
compile_backend = "inductor"  # torch.compile's backend; "eager" checks the graph capture without the compiler's time
configure(globals(), sys.argv[1:])

if (warmup_steps < 0 or timed_steps < 1 or gen_tokens < 0 or not 1 <= gen_prompt_len <= block_size
        or compare_seconds < 0):
    die("need --warmup_steps >= 0, --timed_steps >= 1, --gen_tokens >= 0, 1 <= --gen_prompt_len <= block_size and "
        "--compare_seconds >= 0")
malloc_line = "allocator: glibc malloc keeps freed memory (runtime.tune_malloc)" if tuned_malloc and tune_malloc() \
    else "allocator: the C library's defaults"
device_type = device.split(":")[0]
if compile is None:
    compile = device_type == "cuda"
try:
    dtype, dtype_reason = choose_dtype(device, dtype, n_embd, batch_size * block_size)
except ValueError as e:
    die(str(e))
precisions = [("float32", False), ("bfloat16", False), ("bfloat16", True)] if compare_dtypes else [(dtype, compile)]
depths = [(n_layer, n_loop)] + ([(n_layer * n_loop, 1)] if compare_depths else [])
peak = peak_flops or default_peak_flops(device, dtype)[0]
# A compiled model compiles 7 graphs of its forward (measured: training; for 1 and then batch_size sequences the
# prompt, the decode step and the growing uncached context), and the graphs of all models count against one limit,
# the forward's. Past the limit torch would silently run uncompiled: raise it to what the models need, and fail if
# it is ever hit.
compiled_models = len(depths) * sum(compiled for _, compiled in precisions)
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 10 * compiled_models)
torch._dynamo.config.fail_on_recompile_limit_hit = True


def build(n_layer, n_loop, dtype, compile):
    """A model of this depth with its optimizer, gradient scaler and autocast context, and the line that describes
    it."""
    torch.manual_seed(seed)
    config = GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_loop=n_loop, n_head=n_head,
                       n_embd=n_embd, dropout=0.0, residual=residual, residual_exponent=residual_exponent,
                       residual_lambda=residual_lambda, norm=norm, position_encoding=position_encoding,
                       norm_branch_input=norm_branch_input, n_prelude=n_prelude, n_coda=n_coda, loop_input=loop_input)
    model = GPT(config).to(device)
    line = (f"model: n_layer={n_layer} x n_loop={n_loop} (unrolled depth {config.unrolled_depth}), n_embd {n_embd}, "
            f"block_size {block_size}, {model.num_params() / 1e6:.2f}M params, {residual}, {device} {dtype}"
            f"{', compiled' if compile else ''}")
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


def train_steps(runs, x, y, share):
    """(median seconds of a training step of each run, the steps timed): warmup_steps untimed, then timed_steps
    timed, the runs taking turns step by step, so that a change in load slows them alike. Once another round like
    the last would end past `share` seconds from the start, the rest of the warm-up is skipped, and the timing stops
    as soon as one step is timed."""
    times = [[] for _ in runs]
    start, step = time.perf_counter(), 0
    while step < warmup_steps + timed_steps:
        round_start = time.perf_counter()
        for (model, optimizer, scaler, ctx, _), run_times in zip(runs, times):
            dt = train_step(model, optimizer, scaler, ctx, x, y)
            if step >= warmup_steps:
                run_times.append(dt)
        step += 1
        now = time.perf_counter()
        if now - start + (now - round_start) > share:
            if step < warmup_steps:
                step = warmup_steps
            elif times[0]:
                break
    return [statistics.median(run_times) for run_times in times], len(times[0])



def generate(model, prompt, tokens, use_cache, kv_cache="per_visit", n_loop=None):
    """tokens new tokens for each of the prompt's sequences, through the model's generation or, for another cache
    layout, the lab's."""
    if kv_cache == "per_visit":
        return model.generate(prompt, tokens, top_k=200, n_loop=n_loop, use_cache=use_cache)
    with torch.no_grad():
        return list(generate_stream(model, prompt, tokens, top_k=200, n_loop=n_loop, kv_cache=kv_cache))


def generation_step(model, ctx, prompt, use_cache, **kw):
    """Seconds per step of generation (one new token for each of the prompt's sequences); kw: generate's."""
    with ctx:
        # warm-up; 4 tokens reach the steady state of both paths, including torch.compile's recompiles
        generate(model, prompt, 4, use_cache, **kw)
        synchronize(device)
        t0 = time.perf_counter()
        generate(model, prompt, gen_tokens, use_cache, **kw)
        synchronize(device)
    return (time.perf_counter() - t0) / gen_tokens


def cache_bytes(model, ctx, prompt, kv_cache):
    """Bytes of the buffers that a cache of this layout allocates for the prompt's sequences (room for block_size
    positions each)."""
    caches = new_caches(model, kv_cache=kv_cache)
    with ctx, torch.no_grad():
        model(prompt, caches=caches)
    return sum(k.nbytes + v.nbytes for k, v in {id(c.k): (c.k, c.v) for c in caches}.values())


def compare_caches_lines(model, ctx, prompt):
    """compare_caches' lines for these sequences: each layout's bytes and cached step, then the exit test's cost."""
    sequences, lines, steps = prompt.size(0), [], {}
    for kv_cache in KV_CACHES:
        steps[kv_cache] = generation_step(model, ctx, prompt, True, kv_cache=kv_cache)
        lines.append(f"cache {kv_cache}: {cache_bytes(model, ctx, prompt, kv_cache) / 1e6:.3g} MB for {sequences} x "
                     f"{block_size} positions, cached {steps[kv_cache] * 1e3:.2f} ms/step "
                     f"({sequences / steps[kv_cache]:.1f} tokens/s)")
    one_loop = generation_step(model, ctx, prompt, True, n_loop=1)
    tested = exit_test_step(model, ctx, prompt)
    per_loop = (steps["per_visit"] - one_loop) / max(n_loop - 1, 1)
    lines.append(f"exit test: all {n_loop} loops, each followed by the KL test: {tested * 1e3:.2f} ms/step "
                 f"({sequences / tested:.1f} tokens/s); a loop costs {per_loop * 1e3:.3f} ms, a test "
                 f"{(tested - steps['per_visit']) / (n_loop + 1) * 1e3:.3f} ms")
    return lines


def exit_test_step(model, ctx, prompt):
    """Seconds per cached greedy decode step of lab.decode.exit_logits at threshold 0, which no KL passes: every loop,
    each followed by the test (generation's adaptive exit, without its sampling)."""
    with ctx, torch.no_grad():
        for tokens in (4, gen_tokens):  # a warm-up, then the timed run
            caches = new_caches(model)
            logits = exit_logits(model, prompt, 0.0, caches=caches)[0]
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(tokens):
                logits = exit_logits(model, logits[:, -1:].argmax(-1), 0.0, caches=caches)[0]
            synchronize(device)
    return (time.perf_counter() - t0) / gen_tokens


def read_bandwidth():
    """Bytes per second that this process reads from memory: the fastest of a few sums and vector-matrix products
    over 256 MiB of float32, 8x the largest L3 cache of the CPUs here, so that every repeat reads from memory."""
    data = torch.ones(2**26, device=device)
    vector = torch.ones(256, device=device)
    best = math.inf
    for _ in range(5):
        for read in (data.sum, lambda: vector @ data.view(256, -1)):
            synchronize(device)
            t0 = time.perf_counter()
            read()
            synchronize(device)
            best = min(best, time.perf_counter() - t0)
    return data.numel() * data.element_size() / best


print(f"{malloc_line}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs, "
      f"torch threads {torch.get_num_threads()}")
share = compare_seconds / len(precisions) if compare_dtypes else math.inf  # each precision's time to train
if compare_dtypes:
    print(f"compare_dtypes: training only (generation: one precision at a time, by --dtype and --compile), each "
          f"precision in turn in about {share:.0f} s of compare_seconds={compare_seconds:g} (compiling is not cut)",
          flush=True)
else:
    print(f"dtype {dtype}: {dtype_reason}")
# one fixed random batch: the speed of a step does not depend on which tokens it sees
x = torch.randint(vocab_size, (batch_size, block_size), device=device)
y = torch.randint(vocab_size, (batch_size, block_size), device=device)
tokens_per_step = batch_size * block_size
throughput = []  # tokens/s of each model, precision by precision, each at every depth
for precision in precisions:
    runs = [build(*depth, *precision) for depth in depths]
    seconds, timed = train_steps(runs, x, y, share)
    for (model, optimizer, _, ctx, line), dt in zip(runs, seconds):
        throughput.append(tokens_per_step / dt)
        mfu = flops_per_token(model) * tokens_per_step / dt / peak
        print(line)
        print(f"train: {tokens_per_step / dt:.0f} tokens/s, {dt * 1000:.1f} ms/step (median of {timed}), "
              f"MFU {mfu * 100:.2f}% of {peak / 1e9:.0f} GFLOP/s")
        if gen_tokens and not compare_dtypes:
            optimizer.state.clear()  # frees the AdamW moments before generation
            model.eval()
            bandwidth = read_bandwidth()
            print(f"memory: reads {bandwidth / 1e9:.1f} GB/s (best of sums and vector-matrix products over 256 MiB)")
            for sequences in sorted({1, batch_size}):
                prompt = torch.randint(vocab_size, (sequences, gen_prompt_len), device=device)
                cached, uncached = (generation_step(model, ctx, prompt, use_cache) for use_cache in (True, False))
                step_bytes = decode_step_bytes(model, sequences, gen_prompt_len + gen_tokens / 2,
                                               getattr(torch, dtype).itemsize)
                floor = step_bytes / bandwidth
                print(f"generate: {gen_tokens} new tokens x {sequences} sequence{'s' if sequences > 1 else ''}: "
                      f"cached {cached * 1e3:.2f} ms/step ({sequences / cached:.1f} tokens/s), uncached "
                      f"{uncached * 1e3:.2f} ms/step ({sequences / uncached:.1f} tokens/s), cache speed-up "
                      f"{uncached / cached:.1f}x; a cached step reads {step_bytes / 1e6:.3g} MB: floor "
                      f"{floor * 1e3:.3g} ms, cached step {cached / floor:.2f}x the floor")
                if compare_caches:
                    print("\n".join(compare_caches_lines(model, ctx, prompt)))
        sys.stdout.flush()
    del runs, model, optimizer  # this precision's models and optimizer states, before the next precision's
if compare_dtypes:
    for depth in range(len(depths)):
        row = throughput[depth::len(depths)]
        print(f"compare: n_layer={depths[depth][0]} x n_loop={depths[depth][1]}: bfloat16 trains at "
              f"{row[1] / row[0]:.2f}x the tokens/s of float32, bfloat16 compiled at {row[2] / row[0]:.2f}x")
if compare_depths:
    looped, untied = throughput[0], throughput[1]  # the first precision's two depths
    print(f"compare: n_layer={n_layer} x n_loop={n_loop} trains at {looped / untied:.3f}x the tokens/s "
          f"of n_layer={n_layer * n_loop} x n_loop=1 (same unrolled FLOPs)"
          f"{' (float32)' if compare_dtypes else ''}")
if compile or compare_dtypes:
    print(f"compile: {torch._dynamo.utils.counters['stats']['unique_graphs']} graphs, within the recompile limit "
          f"of {torch._dynamo.config.recompile_limit}")
