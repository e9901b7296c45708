"""
Check a GPU machine end to end before spending GPU-days on it: one command and one table, sized to take under 10
minutes on one GPU (it has not yet run on a GPU: none was available to this project; the dry run below is tested).

    python -m lab.gpu_check                          # config/paper_small.py at R=3, bfloat16, torch.compile
    python -m lab.gpu_check --dataset=fineweb_edu    # on your prepared data instead of the builtin corpus

Each check runs the project's own scripts as a separate process, exactly as a user would:
    train     lab.train (train.py) config/paper_small.py --n_loop=3 for train_iters steps: training tokens/s and MFU (the median
              over the second half of the steps, after compilation), then train.py's evaluation pass (val loss over
              eval_iters batches, and the loop diagnostics) and the checkpoint it writes
    resume    lab.train --init_from=resume on that checkpoint for resume_iters more steps, compiled again
    generate  bench.py on the trained model's settings: new tokens/s with and without the KV cache (uncompiled, as
              sample.py runs by default)
    torchrun  with nproc >= 2 (default: every visible GPU), the train check under torchrun on nproc processes, each
              running as many micro-batches as the single process did: tokens/s, MFU, and the scaling over one process
It prints the table and exits 1 if any check failed (the failing command and its last lines go to stderr), else 0.
The builtin corpus (GPT-2 tokens of Python's documentation) is made offline on first use in data/builtin.

The same checks on a tiny model on CPU, which tests/test_gpu_check.py runs:
    python -m lab.gpu_check --dry=True --device=cpu --dtype=float32 --compile=False --nproc=2
"""

import os
import re
import statistics
import subprocess
import sys
import time

import torch

from configurator import configure, die
from lab.plot import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

out_dir = "out-gpu-check"  # the runs go to out_dir/train and out_dir/torchrun; it must not exist yet
config_file = "config/paper_small.py"
dataset = "builtin"
n_loop = 3  # R of the model checked (unrolled depth 36 for paper_small)
device = "cuda"
dtype = "bfloat16"
compile = True
batch_size = 8  # sequences per micro-batch; lower it if the GPU runs out of memory at unrolled depth 12 * n_loop
gradient_accumulation_steps = 4  # micro-batches per step of the single-process checks
train_iters = 40
resume_iters = 10
eval_iters = 20
gen_tokens = 200  # new tokens per sequence in the generation check (8 sequences after a 16-token prompt)
nproc = torch.cuda.device_count()  # processes of the torchrun check; below 2 skips it
timeout = 480  # seconds one check may take before it counts as failed
dry = False  # a tiny model (2 blocks, width 64, context 64) and a few steps: every check of the script on a CPU
configure(globals(), sys.argv[1:])

if os.path.exists(out_dir):
    die(f"{out_dir} exists; remove it or pass another --out_dir (the check does not write over earlier runs)")
if device.startswith("cuda") and not torch.cuda.is_available():
    die("no CUDA device here; this checks a GPU machine (a CPU dry run: python -m lab.gpu_check --dry=True --device=cpu "
        "--dtype=float32 --compile=False)")
if min(batch_size, gradient_accumulation_steps, train_iters, resume_iters, eval_iters, timeout) < 1 or gen_tokens < 0:
    die("batch_size, gradient_accumulation_steps, train_iters, resume_iters, eval_iters and timeout must be >= 1, "
        "gen_tokens >= 0")
config_path = config_file if os.path.isfile(config_file) else os.path.join(ROOT, config_file)
if not os.path.isfile(config_path):
    die(f"config file not found: {config_file}")
if dry:
    train_iters, resume_iters, eval_iters, gen_tokens = min(train_iters, 6), min(resume_iters, 2), 2, min(gen_tokens, 8)
tiny = ["--n_layer=2", "--n_embd=64", "--n_head=2", "--block_size=64"] if dry else []


def train_args(run_dir, processes):
    return [config_path, f"--dataset={dataset}", f"--out_dir={run_dir}", f"--n_loop={n_loop}", f"--device={device}",
            f"--dtype={dtype}", f"--compile={compile}", f"--batch_size={batch_size}",
            f"--gradient_accumulation_steps={gradient_accumulation_steps * processes}", f"--max_iters={train_iters}",
            f"--eval_interval={train_iters}", f"--eval_iters={eval_iters}", "--log_interval=1", *tiny]


def run(name, command):
    """Run one check's command -> its seconds; raises CheckFailed with the command's last lines when it fails."""
    t0 = time.perf_counter()
    try:
        # lab.bench runs as a module of the repository, from whatever folder the check runs in
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))))
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise CheckFailed(name, command, f"no result after {timeout} s (--timeout)")
    if result.returncode != 0:
        raise CheckFailed(name, command, f"exit code {result.returncode}", result.stderr or result.stdout)
    return time.perf_counter() - t0, result.stdout


class CheckFailed(Exception):
    def __init__(self, name, command, reason, output=""):
        super().__init__(reason)
        self.name, self.command, self.output = name, command, output


def metrics(run_dir):
    return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def speed(run_dir, name):
    """Median tokens/s and MFU over the second half of the steps: the first ones include compilation."""
    steps = [r for r in metrics(run_dir) if r["type"] == "train" and r["iter"] >= train_iters // 2]
    if not steps:
        raise CheckFailed(name, [], f"no train records in {run_dir}/metrics.jsonl")
    return statistics.median(r["tokens_per_sec"] for r in steps), statistics.median(r["mfu"] for r in steps)


def checkpoint_step(run_dir):
    return torch.load(os.path.join(run_dir, "ckpt.pt"), map_location="cpu", weights_only=True)["iter_num"]


python = sys.executable
train_py, bench = ["-m", "lab.train"], ["-m", "lab.bench"]  # train.py, with kappa_R recorded (lab/train.py)
train_dir, torchrun_dir = os.path.join(out_dir, "train"), os.path.join(out_dir, "torchrun")
machine = torch.cuda.get_device_name(device) if device.startswith("cuda") else f"{device} ({os.cpu_count()} cores)"
print(f"gpu_check: {config_file} R={n_loop}{' (dry: tiny model)' if dry else ''}, {dtype}"
      f"{', compiled' if compile else ''}, on {machine}, torch {torch.__version__}\n{'check':<9} {'':<5} result",
      flush=True)
failures = []


def row(name, status, result):
    print(f"{name:<9} {status:<5} {result}", flush=True)


def check(name, body, needs=None):
    """Run body() -> its figures, printed as one row of the table; a check whose prerequisite failed fails too."""
    if needs and needs in failures:
        failures.append(name)
        return row(name, "FAIL", f"not run: the {needs} check failed")
    try:
        row(name, "ok", body())
    except CheckFailed as e:
        failures.append(name)
        if e.command:
            print(f"{name} failed: {' '.join(e.command)}\n{e.output.strip()[-3000:]}", file=sys.stderr, flush=True)
        row(name, "FAIL", str(e))


single = {}


def train_check():
    seconds, _ = run("train", [python, *train_py, *train_args(train_dir, 1)])
    single["tokens_per_sec"], mfu = speed(train_dir, "train")
    return f"{single['tokens_per_sec']:,.0f} tokens/s, MFU {mfu:.1%} (median of steps {train_iters // 2}-" \
           f"{train_iters - 1}), {seconds:.0f} s with compilation and evaluation"


def eval_check():
    evals = [r for r in metrics(train_dir) if r["type"] == "eval"]
    last = evals[-1]
    if last["iter"] != train_iters or checkpoint_step(train_dir) != train_iters:
        raise CheckFailed("eval", [], f"the last evaluation or checkpoint is not at step {train_iters}")
    kappa = last["loop"]["kappa"]
    return f"val loss {evals[0]['val_loss']:.3f} -> {last['val_loss']:.3f} over {eval_iters} batches, " \
           f"kappa_R mean {sum(kappa) / len(kappa):.2f}, ckpt.pt at step {train_iters}"


def resume_check():
    end = train_iters + resume_iters
    seconds, _ = run("resume", [python, *train_py, *train_args(train_dir, 1), "--init_from=resume",
                                f"--max_iters={end}"])
    if checkpoint_step(train_dir) != end:
        raise CheckFailed("resume", [], f"ckpt.pt is not at step {end} after resuming")
    losses = [r["loss"] for r in metrics(train_dir) if r["type"] == "train" and r["iter"] >= train_iters]
    return f"step {train_iters} -> {end}, train loss {losses[0]:.3f} -> {losses[-1]:.3f}, {seconds:.0f} s"


def generate_check():
    model_args = torch.load(os.path.join(train_dir, "ckpt.pt"), map_location="cpu", weights_only=True)["model_args"]
    # the checkpoint's model, less what does not change a decode step's speed
    model = [f"--{k}={v}" for k, v in model_args.items() if k not in ("dropout", "bias", "coefficient_loops")]
    seconds, stdout = run("generate", [python, *bench, *model, f"--device={device}", f"--dtype={dtype}",
                                       "--compile=False", "--batch_size=8", "--warmup_steps=0", "--timed_steps=1",
                                       f"--gen_tokens={gen_tokens}", "--gen_prompt_len=16"])
    m = re.search(r"x 8 sequences: cached [0-9.]+ ms/step \(([0-9.]+) tokens/s\), uncached [0-9.]+ ms/step "
                  r"\(([0-9.]+) tokens/s\), cache speed-up ([0-9.]+)x", stdout)
    if not m:
        raise CheckFailed("generate", [], f"bench.py printed no generation line: {stdout.strip()[-200:]!r}")
    return f"{gen_tokens} new tokens x 8 sequences: cached {float(m.group(1)):,.0f} tokens/s, uncached " \
           f"{float(m.group(2)):,.0f} tokens/s ({m.group(3)}x), {seconds:.0f} s"


def torchrun_check():
    seconds, _ = run("torchrun", [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                                  *train_py, *train_args(torchrun_dir, nproc)])
    tokens_per_sec, mfu = speed(torchrun_dir, "torchrun")
    return f"{nproc} processes: {tokens_per_sec:,.0f} tokens/s, MFU {mfu:.1%} of {nproc} devices, " \
           f"{tokens_per_sec / single['tokens_per_sec'] / nproc:.0%} of {nproc} x one process, {seconds:.0f} s"


check("train", train_check)
check("eval", eval_check, needs="train")
check("resume", resume_check, needs="train")
check("generate", generate_check, needs="train")
if nproc >= 2:
    check("torchrun", torchrun_check, needs="train")
else:
    row("torchrun", "skip", f"nproc={nproc}: needs 2 or more devices")
sys.exit(1 if failures else 0)
