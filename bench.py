"""
Measure a looped GPT on synthetic tokens: training throughput and MFU, and generation speed with and without the
KV cache. No dataset or checkpoint needed.

    python bench.py                                        # 2 blocks x 4 loops, n_embd 256, block_size 256, batch 8
    python bench.py --compare_depths=True --gen_tokens=0   # and 8 blocks x 1 loop, same FLOPs: the ratio
    python bench.py --compile=True --n_layer=6 --n_loop=2 --n_head=12 --n_embd=768 --block_size=1024 --batch_size=12
                                                           # config/loop_small.py's model (on a GPU: bfloat16)

Training: warm-up steps first (they include torch.compile's compilation and the allocator's first requests), then
the median of the timed steps, each a forward, a backward and an AdamW step; with compare_depths the two models take
turns step by step. Generation: batch_size sequences of gen_tokens new tokens after a gen_prompt_len-token prompt,
once with the KV cache and once recomputing the context at every step.
"""

import statistics
import sys
import time

import torch

from configurator import configure, die
from model import GPT, GPTConfig, autocast_context, default_peak_flops

# model
n_layer = 2
n_loop = 4
n_head = 4
n_embd = 256
block_size = 256
vocab_size = 50304  # GPT-2's vocabulary padded to a multiple of 64, as train.py uses for gpt2 tokens
residual = "deeploop"
norm = "layernorm"  # the backbone settings of train.py (GPTConfig): layernorm | rmsnorm
position_encoding = "learned"  # learned | rope
norm_branch_input = False
# run
batch_size = 8
warmup_steps = 2
timed_steps = 5  # training throughput is the median of these
gen_tokens = 200  # new tokens per sequence in the generation benchmark; 0 skips it
gen_prompt_len = 16  # keep gen_prompt_len + gen_tokens <= block_size, or the cache is rebuilt once the window slides
compare_depths = False  # also bench n_layer * n_loop blocks x 1 loop (same unrolled FLOPs) and print the ratio
peak_flops = 0.0  # for MFU; 0 picks a default for the device (default_peak_flops below)
seed = 1337
device = "cuda" if torch.cuda.is_available() else "cpu"  # or cpu, cuda:1, mps
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
compile = False  # torch.compile the model (warm-up steps absorb the compilation)
configure(globals(), sys.argv[1:])

if warmup_steps < 0 or timed_steps < 1 or gen_tokens < 0 or not 1 <= gen_prompt_len <= block_size:
    die("need --warmup_steps >= 0, --timed_steps >= 1, --gen_tokens >= 0 and 1 <= --gen_prompt_len <= block_size")
device_type = device.split(":")[0]  # autocast wants "cuda", not "cuda:1"
ctx = autocast_context(device, dtype)

def sync():
    getattr(torch, device_type).synchronize()  # torch.cuda / torch.mps / torch.cpu: timings must wait for the device


peak = peak_flops or default_peak_flops(device, dtype)[0]


def build(n_layer, n_loop):
    """A model of this depth with its optimizer and gradient scaler, and the line that describes it."""
    torch.manual_seed(seed)
    config = GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_loop=n_loop, n_head=n_head,
                       n_embd=n_embd, dropout=0.0, residual=residual, norm=norm,
                       position_encoding=position_encoding, norm_branch_input=norm_branch_input)
    model = GPT(config).to(device)
    line = (f"model: n_layer={n_layer} x n_loop={n_loop} (unrolled depth {config.unrolled_depth}), n_embd {n_embd}, "
            f"block_size {block_size}, {model.num_params() / 1e6:.2f}M params, {residual}, {device} {dtype}"
            f"{', compiled' if compile else ''}")
    if compile:
        model.compile()  # in place, so that generate's calls to self(...) run the compiled forward too
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, betas=(0.9, 0.95),
                                           device_type=device_type)
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))  # float16 needs loss scaling
    return model, optimizer, scaler, line


def train_step(model, optimizer, scaler, x, y):
    """One forward, backward and AdamW step -> its seconds."""
    sync()
    t0 = time.perf_counter()
    with ctx:
        _, loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - t0


def generation_speed(model, prompt, use_cache):
    """New tokens per second of model.generate, over all batch_size sequences."""
    with ctx:
        # warm-up; 4 tokens reach the steady state of both paths, including torch.compile's recompiles
        model.generate(prompt, 4, top_k=200, use_cache=use_cache)
        sync()
        t0 = time.perf_counter()
        model.generate(prompt, gen_tokens, top_k=200, use_cache=use_cache)
        sync()
    return batch_size * gen_tokens / (time.perf_counter() - t0)


depths = [(n_layer, n_loop)] + ([(n_layer * n_loop, 1)] if compare_depths else [])
runs = [build(*depth) for depth in depths]
# one fixed random batch: the speed of a step does not depend on which tokens it sees
x = torch.randint(vocab_size, (batch_size, block_size), device=device)
y = torch.randint(vocab_size, (batch_size, block_size), device=device)
# The models compared take turns step by step, so that a change in load on a shared machine slows both alike.
step_times = [[] for _ in runs]
for step in range(warmup_steps + timed_steps):
    for (model, optimizer, scaler, _), times in zip(runs, step_times):
        dt = train_step(model, optimizer, scaler, x, y)
        if step >= warmup_steps:
            times.append(dt)

tokens_per_step = batch_size * block_size
throughput = []
for (model, optimizer, _, line), times in zip(runs, step_times):
    dt = statistics.median(times)
    throughput.append(tokens_per_step / dt)
    mfu = model.estimate_mfu(tokens_per_step, dt, peak)
    print(line)
    print(f"train: {tokens_per_step / dt:.0f} tokens/s, {dt * 1000:.1f} ms/step (median of {timed_steps}), "
          f"MFU {mfu * 100:.2f}% of {peak / 1e9:.0f} GFLOP/s")
    if gen_tokens:
        optimizer.state.clear()  # frees the AdamW moments before generation
        model.eval()
        prompt = torch.randint(vocab_size, (batch_size, gen_prompt_len), device=device)
        cached, uncached = (generation_speed(model, prompt, use_cache) for use_cache in (True, False))
        print(f"generate: {gen_tokens} new tokens x {batch_size} sequences: cached {cached:.1f} tokens/s, "
              f"uncached {uncached:.1f} tokens/s, cache speed-up {cached / uncached:.1f}x")
    sys.stdout.flush()
if compare_depths:
    print(f"compare: n_layer={n_layer} x n_loop={n_loop} trains at {throughput[0] / throughput[1]:.3f}x the tokens/s "
          f"of n_layer={n_layer * n_loop} x n_loop=1 (same unrolled FLOPs)")
