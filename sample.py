"""
Sample from a trained model, printing the text as it is generated.

    python sample.py --out_dir=out-smoke --start="Once upon a time" --num_samples=2 --max_new_tokens=200
    python sample.py --out_dir=out-smoke --start=FILE:docs/prompt.txt
    python sample.py --out_dir=out-smoke --n_loop=8          # test-time depth: run 8 loops instead of the trained count
    python sample.py --out_dir=out-smoke --use_cache=False   # recompute the whole context at every step (slower)
    python sample.py --out_dir=out-smoke --compile=True      # compiled blocks: a few graphs, not one per token
    python sample.py --out_dir=out-smoke --compile_step=True  # the decode step as one tuned graph: fastest on a CPU

The samples go to stdout; what was loaded and how fast it ran go to stderr. The seam where the lab plugs in:
`python -m lab.sample` (adaptive exit, a cache that does not grow) runs this file with LAB set to its Lab
(lab/sample.py), which brings settings of its own and generates the tokens.
"""

import os
import signal
import sys
import time

import torch

from runtime import check_device, compile_decode_step, compiled_step_runs, precision, tune_malloc
from configurator import configure, die, read_text
from dataset import get_tokenizer, valid_text
from model import check_loops
from guard import load_checkpoint

LAB = globals().get("LAB")  # the seam (above): lab/sample.py's Lab under python -m lab.sample


def interrupted(signum, frame):
    """Ctrl-C ends sampling with one line, after the text printed so far, and the shell's code for SIGINT."""
    try:
        sys.stdout.flush()
    except RuntimeError:  # the signal came in the middle of a write to stdout, which ends at exit
        pass
    os.write(2, b"\nstopped by SIGINT\n")  # not print: the signal may have come in the middle of one to stderr
    sys.exit(128 + signum)


signal.signal(signal.SIGINT, interrupted)

out_dir = "out"  # the train.py run to sample from: reads out_dir/ckpt.pt
start = "\n"  # the prompt, or "FILE:path" to read it from a file; "" starts at a document boundary
num_samples = 3
max_new_tokens = 500
temperature = 0.8  # 1.0 samples the model's distribution; lower is more conservative
top_k = 200  # sample only among the top_k most likely tokens; 0 keeps them all
n_loop = 0  # loops over the stack of blocks at test time; 0 runs the count the model was trained with
use_cache = True  # False recomputes the full context for every new token (for comparison; same output)
seed = 1337
device = "cuda" if torch.cuda.is_available() else "cpu"  # or cpu, cuda:1, mps
dtype = "auto"  # auto: float32 on a CPU (see below), else the fastest on the device; or float32, bfloat16, float16
compile = False  # torch.compile the blocks, for every kind of decoding (the lab's too); pays off for long samples
# the whole cached decode step as one graph, autotuned for its few rows, the weights frozen in: on a 2-core Zen 4
# half the time per token of one sequence, after 20-50 s of compiling (runtime.compile_decode_step; CUDA never tried)
compile_step = False
configure(globals(), sys.argv[1:], extra=LAB and LAB.settings)
tune_malloc()  # before the first large allocation (runtime.tune_malloc)

for name, value in (("num_samples", num_samples), ("max_new_tokens", max_new_tokens), ("top_k", top_k)):
    if value < 0:
        die(f"--{name} must be >= 0, got {value}")
try:
    check_loops(n_loop, zero_is_trained=True)
except ValueError as e:
    die(f"--{e}")
if temperature <= 0:
    die(f"--temperature must be > 0, got {temperature} (use --top_k=1 for greedy decoding)")
if compile_step and (compile or not use_cache):
    die("--compile_step compiles the cached decode step as a whole: drop --compile and --use_cache=False")
if LAB:
    LAB.configure(globals())

if start.startswith("FILE:"):
    start = read_text(start[len("FILE:"):], "the prompt file", "pass --start=FILE:path/to/an/existing/file")

try:
    check_device(device)
    model, checkpoint = load_checkpoint(f"{out_dir}/ckpt.pt", device)
    if checkpoint["tokenizer"] not in ("gpt2", "bytes"):  # a task of the lab's: no text to print
        die(f"{out_dir} was trained on {checkpoint['tokenizer']}, not on text: show its answers with python -m "
            f"lab.depth_eval --out_dir={out_dir}")
    # on a CPU a generation step multiplies a row per sequence by every weight, which autocast would cast to
    # bfloat16 again at every step: float32 (a Zen 5 that trains faster in bfloat16 sampled 108 tokens/s in it, 580
    # in float32)
    dtype, dtype_reason, ctx = precision(device, dtype, untrained_because="a generation step reads every weight, "
                                         "which bfloat16 would cast each step")
except (FileNotFoundError, ValueError) as e:
    die(str(e))
model.eval()
try:
    enc = get_tokenizer(checkpoint["tokenizer"])
except (ValueError, FileNotFoundError) as e:
    die(str(e))
if compile:
    import torch._dynamo  # here, not at the top: importing it adds a second to every start
    model.compile_blocks()  # in place: every pass runs them, adaptive exit's too
    # the prompt and the decode step are a few graphs per block; past the limit torch would silently run uncompiled,
    # so hitting it is an error
    torch._dynamo.config.fail_on_recompile_limit_hit = True
next_logits, compiled_seconds = None, []
if compile_step:
    step = compile_decode_step(model, n_loop or None)

    def next_logits(ids, caches):
        """The step, the calls that run it compiled timed: the first of them compiles it."""
        compiled = compiled_step_runs(ids, caches, model.config.block_size)
        t = time.time()
        logits = step(ids, caches)
        if compiled:
            compiled_seconds.append(time.time() - t)
        return logits

start = valid_text(start)  # a lone surrogate (--start='"\ud800"') becomes U+FFFD, as in the tokenizers
start_ids = enc.encode_ordinary(start) or [enc.eot_token]  # an empty prompt starts a new document
x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, :]

cfg = model.config
loops = n_loop or cfg.n_loop
print(f"{out_dir}/ckpt.pt: {cfg.n_layer} blocks x {cfg.n_loop} loops trained, sampling with "
      f"{LAB.describe(loops) if LAB else f'{loops} loops'} (unrolled depth {cfg.depth(loops)}), tokenizer "
      f"{checkpoint['tokenizer']}, iter {checkpoint['iter_num']}, dtype {dtype} ({dtype_reason})", file=sys.stderr)
del checkpoint  # the optimizer state in it is not needed for sampling
generate = LAB.stream if LAB else lambda model, x, tokens, temperature, top_k, loops, vocab_size_limit, next_logits: \
    model.generate_stream(x, tokens, temperature, top_k, loops, use_cache, vocab_size_limit, next_logits=next_logits)

torch.manual_seed(seed)  # seeded here, so that the samples depend on the seed alone, not on how the model was built
new_tokens, t0 = 0, time.time()
for k in range(num_samples):
    sys.stdout.write(start)
    ids, printed = [], ""
    with ctx:
        # Ids from enc.n_vocab up are padding (e.g. GPT-2's 50257 rounded up to 50304 for faster matmuls). They never
        # occur as targets, yet a briefly trained model still gives them some probability, and the tokenizer cannot
        # decode them: vocab_size_limit keeps them from being sampled.
        for token in generate(model, x, max_new_tokens, temperature, top_k or None, loops, enc.n_vocab, next_logits):
            ids.append(token.item())
            # Decode everything generated so far and print what is new. A token can end in the middle of a UTF-8
            # character (always possible with the bytes tokenizer, sometimes with GPT-2's byte-level BPE); the
            # decoder then ends in U+FFFD, which the next token may turn into the real character, so trailing U+FFFD
            # waits until a later token settles it. Text before it no longer changes: UTF-8 resynchronises.
            text = enc.decode(ids).rstrip("\ufffd")
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    sys.stdout.write(enc.decode(ids)[len(printed):] + "\n")  # whatever U+FFFD is still held back is final now
    if k < num_samples - 1:
        print("---------------")
    sys.stdout.flush()
    new_tokens += len(ids)
dt = time.time() - t0
compiling = ""
if compiled_seconds:
    compiling = f", of which {compiled_seconds[0]:.1f} s in the first compiled decode step, which compiles it"
elif compile_step:
    compiling = f"; no step ran compiled, so nothing was compiled: the prompt's pass and the steps that fill the " \
                f"cache run uncompiled, and from a prompt of {cfg.block_size - 1} tokens on (block_size " \
                f"{cfg.block_size}) every step is one of them"
print(f"{new_tokens} tokens in {dt:.2f} s ({new_tokens / dt:.1f} tokens/s, use_cache={use_cache}){compiling}",
      file=sys.stderr)
if LAB:
    LAB.report(loops)
