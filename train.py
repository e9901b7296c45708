"""
Train a looped GPT (model.py) on a dataset made by prepare_data.py.

One process (GPU when there is one, else CPU), or several with DDP on GPUs (nccl) or CPUs (gloo):
    python train.py config/smoke_cpu.py
    python train.py config/smoke_cpu.py --init_from=resume --max_iters=1800
    torchrun --standalone --nproc_per_node=8 train.py config/loop_small.py
Baselines are overrides:  --residual=deepnorm  (DeepNorm's exponents)  --n_loop=1  (no looping)
The settings are the module-level variables below, changed by config files and --key=value (configurator.py). A run
writes ckpt.pt and metrics.jsonl to out_dir; guard.py keeps it safe (SIGTERM: ckpt.pt written, exit code 75).

The seam where the lab plugs in: `python -m lab.train` runs this file with LAB set to its Lab (lab/train.py), which
brings settings of its own and, where LAB appears below, gives batch sources (a task's), a step's loop count, the module
that trains and more numbers for the logs. Under `python train.py` LAB is None: the run is the method alone.
"""

import math
import os
import random
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import guard
from configurator import configure, die
from dataset import EVAL_SEED, TokenWindows, load_meta
from model import GPT, MAX_LOOPS, GPTConfig
from prepare_data import prepare_builtin_if_missing
from runtime import (check_device, default_peak_flops, flops_per_token, machine, precision, rng_states, set_rng_states,
                     tune_malloc)

LAB = globals().get("LAB")  # the seam (above): lab/train.py's Lab under python -m lab.train

# ---------------------------------------------------------------------------------------------------------------------
# config; the defaults are a GPT-2-small-wide looped model on OpenWebText (like config/loop_small.py)
# I/O
out_dir = "out"
eval_interval = 1000     # evaluate, record loop diagnostics and write ckpt.pt every this many steps, and at the end
eval_iters = 200         # batches per split in an evaluation
checkpoint_minutes = 0.0  # also write ckpt.pt when this many minutes passed since the last one; 0: only at evaluations
log_interval = 10        # a train record in metrics.jsonl every this many steps
init_from = "scratch"    # "scratch", or "resume" from out_dir/ckpt.pt
start_over = False       # scratch over a run in out_dir: True moves its files into out_dir/previous-N, False stops
wandb_log = False        # also log to Weights & Biases (needs `pip install wandb`)
wandb_project = "deeploop"
wandb_run_name = "run"
# data
dataset = "openwebtext"  # folder data/<dataset> from prepare_data.py (builtin, stdlib, *_bytes prepare themselves)
# Micro-batches per optimizer step over ALL processes together (as in nanoGPT): each of the W DDP processes runs
# gradient_accumulation_steps / W of them, so a step sees the same tokens whatever the number of processes.
gradient_accumulation_steps = 40
batch_size = 12          # sequences per micro-batch
block_size = 1024
# model (vocab_size is not a setting: it comes from the dataset's tokenizer)
n_layer = 6              # physical blocks
n_loop = 2               # rounds over them: unrolled depth n_layer * n_loop
n_head = 12
n_embd = 768
dropout = 0.0
bias = True
residual = "deeploop"    # deeploop | deepnorm | postln | preln | preln_scaled
residual_exponent = 0.0  # p of alpha = (2N)^p, beta = (8N)^-p for deeploop/deepnorm; 0 = the scheme's own
residual_lambda = 1.0    # preln_scaled's branches times residual_lambda / (n_loop * sqrt(blocks)); model.branch_scale
norm = "layernorm"       # layernorm | rmsnorm
position_encoding = "learned"  # learned | rope
norm_branch_input = False  # Post-LN blocks as x = Norm(alpha * x + f(Norm(x))), the DeepLoop paper's form
n_prelude = 0            # blocks run once before the looped core, n_coda once after it (Huginn's prelude and coda):
n_coda = 0               # unrolled depth n_prelude + n_layer * n_loop + n_coda; loop counts below count core loops
loop_input = "none"      # none | add | concat (Huginn's adapter): the embedded input fed into every loop (LoopInput)
coefficient_loops = 0    # alpha, beta (preln_scaled: epsilon) as at this many loops (GPTConfig.depth); 0: n_loop
eval_loops = ""          # val loss at these loop counts too (test-time depth), e.g. "1,2,4"; each costs evaluation time
# AdamW; weight decay applies to matrices only (model.configure_optimizers)
learning_rate = 6e-4
max_iters = 600000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0          # clip the global gradient norm to this; 0 disables clipping
# learning rate: linear warmup, then cosine decay to min_lr at lr_decay_iters, constant after
decay_lr = True
warmup_iters = 2000
lr_decay_iters = 600000  # the schedule ends here, not at max_iters: a run resumed with more max_iters goes on with it
min_lr = 6e-5
# system
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "auto"           # auto: what the device trains fastest in (runtime.choose_dtype); or float32, bfloat16, float16
compile = None           # torch.compile; None: on CUDA (faster steps), not elsewhere (minutes of compiling on a CPU)
seed = 1337
peak_flops = 0.0         # FLOP/s of one device for MFU; 0: a default for the device (see default_peak_flops)
config = configure(globals(), sys.argv[1:], extra=LAB and LAB.settings)  # the lab's settings with the lesson's
if LAB:
    LAB.configure(globals())
# ---------------------------------------------------------------------------------------------------------------------
tune_malloc()  # before the first large allocation: freed activations stay in the process (runtime.tune_malloc)

if init_from not in ("scratch", "resume"):
    die(f"init_from must be 'scratch' or 'resume', got {init_from!r}")
if dtype not in ("auto", "float32", "bfloat16", "float16"):
    die(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
guard.check_settings(config)  # counts, sizes and rates that torch refuses only once out_dir and its lock exist
if not 0 <= seed < 2 ** 31:  # numpy takes no negative seeds, and seed + rank seeds its 32-bit generator
    die(f"seed must be from 0 to 2**31 - 1, got {seed}")
try:
    check_device(device)
except ValueError as e:
    die(str(e))
eval_loop_counts = [int(c) if c.strip().isdigit() else 0 for c in eval_loops.split(",") if eval_loops]
if not all(1 <= c <= MAX_LOOPS for c in eval_loop_counts):
    die(f"eval_loops must be loop counts from 1 to {MAX_LOOPS} separated by commas, like \"1,2,4\", got {eval_loops!r}")
eval_loop_counts = sorted({n_loop, *eval_loop_counts})  # val loss at each (n_loop's is val_loss)

# DDP: torchrun starts one process per device and tells each its RANK and WORLD_SIZE (guard.Processes)
procs = guard.Processes()
ddp, rank, world_size, master = procs.ddp, procs.rank, procs.world_size, procs.master
# SIGTERM and SIGINT stop the run after the step under way, with a checkpoint; a second one at once (guard.py)
stop = guard.Stop(master, writing=os.path.join(out_dir, "ckpt.pt.tmp"))
device = procs.start(device)

if gradient_accumulation_steps % world_size:
    die(f"gradient_accumulation_steps={gradient_accumulation_steps} (the total over all processes) is not divisible "
        f"by the {world_size} processes; use a multiple of {world_size}")
accum_steps = gradient_accumulation_steps // world_size  # micro-batches this process runs per step
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size
device_type = device.split(":")[0]
compile = device_type == "cuda" if compile is None else compile
if device_type == "cpu":
    # deep Post-LN stacks make denormal gradients early on, 11x slower on CPUs (2 x 32 loops: 5.1 s a step, 0.44 s)
    torch.set_flush_denormal(True)


# The reader is a pure function of (seed, split, index): the data position is the step number, which makes resuming
# exact and lets DDP ranks split a step's micro-batches between them. Evaluation windows are fixed and the same in
# every run on a dataset, whatever its seed, so that runs with other seeds or schemes are compared on the same text;
# the train-split ones are drawn with a seed that training does not use (EVAL_SEED).
splits = ((seed, "train"), (EVAL_SEED, "train"), (EVAL_SEED, "val"))  # training, and the evaluations' two
try:
    if task := LAB and LAB.data(splits):  # a task's batch sources and meta, made on the fly
        (train_data, train_eval_data, val_data), meta = task
    else:
        # builtin and builtin_bytes are made here when missing (by the master; the others wait for it)
        procs.on_master(lambda: prepare_builtin_if_missing(dataset))
        data_dir = os.path.join("data", dataset)
        meta = load_meta(data_dir)  # a missing dataset: the error names the command that prepares it
        train_data, train_eval_data, val_data = (TokenWindows(data_dir, split, block_size, s) for s, split in splits)
except (ValueError, FileNotFoundError) as e:
    die(str(e))
vocab_size = -(-meta["vocab_size"] // 64) * 64  # the tokenizer's n_vocab padded to a multiple of 64: faster matmuls
model_args = {k: globals()[k] for k in GPTConfig.__dataclass_fields__}  # vocab_size: from the data
try:
    gpt_config = GPTConfig(**model_args)
except ValueError as e:
    die(str(e))
lock_file = procs.on_master(lambda: guard.lock_out_dir(out_dir, init_from, start_over))  # one run per out_dir


def to_device(batch):  # on CUDA from pinned memory: the copy runs while the GPU still works on the previous batch
    return [t.pin_memory().to(device, non_blocking=True) if device_type == "cuda" else t.to(device) for t in batch]


# model and optimizer
torch.manual_seed(seed)  # the same initial weights on every rank (DDP would broadcast rank 0's anyway)
ckpt_path = os.path.join(out_dir, "ckpt.pt")
if init_from == "scratch":
    raw_model = GPT(gpt_config).to(device)
    iter_num, best_val_loss, resumed_evaluated = 0, math.inf, False
else:
    try:
        raw_model, checkpoint = guard.load_checkpoint(ckpt_path, device)
    except (FileNotFoundError, ValueError) as e:
        die(str(e))
    if mismatch := guard.resume_mismatch(ckpt_path, checkpoint, raw_model, model_args, meta, dataset, task, LAB):
        die(mismatch)
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
    resumed_evaluated = checkpoint.get("evaluated", True)  # False: written on a signal or timer, before its evaluation
# for the device this process runs on; on a CPU measured by training steps of this model, or a resumed CPU run's own
trained_on = (checkpoint["config"].get("dtype"), checkpoint["config"].get("device")) if init_from == "resume" else None
dtype, dtype_reason, autocast = precision(device, dtype, raw_model, (batch_size, block_size), trained_on)
optimizer = raw_model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")  # float16 needs loss scaling; bfloat16 not


# every process draws its own dropout masks; a checkpoint keeps the generator states of all of them
torch.manual_seed(seed + rank)
np.random.seed(seed + rank)
random.seed(seed + rank)
if init_from == "resume":
    optimizer.load_state_dict(checkpoint["optimizer"])
    if scaler.is_enabled() and checkpoint["scaler"]:
        scaler.load_state_dict(checkpoint["scaler"])
    if len(checkpoint["rng"]) == world_size:
        set_rng_states(checkpoint["rng"][rank], device)
    elif master and dropout > 0:
        print(f"note: {ckpt_path} was written by {len(checkpoint['rng'])} processes, this run has {world_size}; "
              f"dropout masks will differ from an uninterrupted run")
    if master and (note := guard.batches_changed(checkpoint, config)):
        print(note)
    del checkpoint  # frees its copy of the weights and optimizer state
if compile:
    raw_model.compile_blocks()  # in place, every block and the loss: one graph serves every loop count
# training runs model, evaluation raw_model (no DDP collectives). DDP must know when a step may leave parameters
# without a gradient: LoopInput's at a step of one loop (it feeds loops 2 on), the earlier loops' in truncated backprop
fewest_loops, most_loops = LAB.loop_bounds if LAB else (n_loop, n_loop)  # what a training step may run
unused = loop_input != "none" and fewest_loops == 1 or bool(LAB and LAB.backprop_loops)
trained = LAB.wrap(raw_model) if LAB else raw_model
model = DDP(trained, device_ids=[torch.cuda.current_device()] if device_type == "cuda" else None,
            find_unused_parameters=unused) if ddp else trained


def save_checkpoint(evaluated):
    pending.read()  # the NaN guard: weights that a non-finite loss or gradient has spoiled are never saved
    rng = procs.gather(rng_states(device))  # every process's generators, so that each one's dropout resumes exactly
    ckpt.save(procs, iter_num, lambda: dict(
        program="deeploop-train", model=raw_model.state_dict(), model_args=model_args, tokenizer=meta["tokenizer"],
        optimizer=optimizer.state_dict(), scaler=scaler.state_dict() if scaler.is_enabled() else None,
        iter_num=iter_num, best_val_loss=best_val_loss, evaluated=evaluated and not metrics.error,
        config={k: globals()[k] for k in config}, rng=rng, lab=LAB.changed() if LAB else {}))


@torch.no_grad()
def estimate_loss():
    """Mean loss over eval_iters fixed batches per split, train at n_loop and val at each of eval_loop_counts, shared out
    among DDP processes -> dict(train=, val= (at n_loop), val_by_loops={loops: loss}). None: a signal came, and every
    process left at the same batch (an evaluation can take minutes; a scheduler's grace is one step and a write)."""
    raw_model.eval()
    losses = {}
    for split, data, loop_counts in (("train", train_eval_data, [n_loop]), ("val", val_data, eval_loop_counts)):
        totals = torch.zeros(len(loop_counts), device=device)
        for first in range(0, eval_iters, world_size):  # as many rounds on every process, a batch each
            if procs.agree(stop.signum)[0]:
                raw_model.train()
                return None
            if (index := first + rank) >= eval_iters:
                continue
            inputs = to_device(data.batch(index, batch_size))
            for i, loops in enumerate(loop_counts):
                with autocast:
                    totals[i] += raw_model(*inputs, n_loop=loops)[1].float()
        losses[split + "_by_loops"] = dict(zip(loop_counts, (procs.all_reduce(totals) / eval_iters).tolist()))
        losses[split] = losses[split + "_by_loops"][n_loop]
    raw_model.train()
    return losses


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    progress = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (learning_rate - min_lr)


metrics = guard.MetricsLog(os.path.join(out_dir, "metrics.jsonl"))  # the run's records, one JSON line each


def log(record):
    if metrics.write(record) and wandb_log and record["type"] != "start":
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "iter"}
        numbers.update({f"kappa_{b}": k for b, k in enumerate(record.get("loop", {}).get("kappa", []))})
        wandb.log({f"{record['type']}/{k}": v for k, v in numbers.items()}, step=record["iter"])


def log_eval(losses):
    """An evaluation's line and record, with the lab's numbers where it runs (kappa_R, a task's accuracy)."""
    by_loops = losses["val_by_loops"]
    record, said, lines = LAB.evaluate(raw_model, by_loops) if LAB else ({}, "", [])
    depth = f"; val loss at {'/'.join(map(str, by_loops))} loops " \
            f"{'/'.join(f'{loss:.3f}' for loss in by_loops.values())}" if len(by_loops) > 1 else ""
    tqdm.write("\n".join([f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}{said}{depth}",
                          *lines]))
    log(dict(type="eval", iter=iter_num, tokens=iter_num * tokens_per_iter, train_loss=losses["train"],
             val_loss=losses["val"], val_loss_by_loops=by_loops, **record))


def start_logs():
    """On the master: the logs opened, the run described, and its start record written."""
    global peak_flops, peak_source, wandb
    if wandb_log:
        try:
            import wandb
        except ImportError:  # before metrics.jsonl is made, which would leave out_dir holding a run of no step
            die("wandb_log=True needs the wandb package: pip install wandb (or leave wandb_log off)")
        wandb.init(project=wandb_project, name=wandb_run_name, config=config)
    metrics.open(iter_num if init_from == "resume" else None)
    peak_flops, peak_source = (peak_flops, "peak_flops") if peak_flops > 0 else default_peak_flops(device, dtype)
    n_params = raw_model.num_params()
    print(f"{n_params / 1e6:.2f}M parameters, {n_layer} blocks x {n_loop} loops ({residual}), vocab {vocab_size} "
          f"({meta['tokenizer']}), {tokens_per_iter:,} tokens per step on {world_size} x {device} in {dtype}, "
          f"MFU against {peak_flops:.3g} FLOP/s per device ({peak_source})")
    print(f"dtype {dtype}: {dtype_reason}")
    if loop_input != "none" and most_loops == 1:  # useless, not wrong: the run trains without it
        print(f"warning: loop_input={loop_input} never trains: every step runs one loop, and the input is fed into "
              f"loops 2 on (model.LoopInput); use --loop_input=none or more loops", file=sys.stderr)
    lab_record, lines = LAB.start() if LAB else ({}, [])
    print("\n".join(lines), end="\n" if lines else "")
    log(dict(type="start", iter=iter_num, resumed=init_from == "resume", params=n_params, world_size=world_size,
             config={k: globals()[k] for k in config}, machine=machine(), **lab_record))


procs.on_master(start_logs)

# ---------------------------------------------------------------------------------------------------------------------
# training loop. Step iter_num trains on micro-batches iter_num * gradient_accumulation_steps + 0, 1, ...; process
# `rank` takes its accum_steps consecutive ones, so 2 processes x 2 micro-batches see what 1 process x 4 sees.
ckpt = guard.CheckpointFile(ckpt_path, iter_num if init_from == "resume" else None)  # the step ckpt.pt holds
pending = guard.PendingLosses(procs, gradient_accumulation_steps, ckpt, stop)  # train losses, and the NaN guard
if master and init_from == "resume" and iter_num >= max_iters:
    print(f"{ckpt_path} is at step {iter_num} already; raise --max_iters to train on")
bar = master and sys.stderr.isatty()  # a terminal gets a progress bar; a file or a CI log one line per log_interval
pbar = tqdm(total=max_iters, initial=iter_num, disable=not bar, dynamic_ncols=True, desc="train")
window_start, window_steps, window_flops = time.perf_counter(), 0, 0
stop.start_training(pbar)
while True:
    # every process decides alike at each step (guard.py): stop on a signal or a failed metrics write, or checkpoint
    signum, checkpoint_due, log_failed = procs.agree(stop.signum, ckpt.due(checkpoint_minutes), bool(metrics.error))
    if log_failed:
        stop.end(2, master and ckpt.write_failed(metrics.path, metrics.error, iter_num))
    eval_due = iter_num % eval_interval == 0 or iter_num >= max_iters
    if (signum or checkpoint_due and not eval_due) and ckpt.step != iter_num:
        save_checkpoint(evaluated=False)
        if master and not signum:
            tqdm.write(f"step {iter_num}: wrote {ckpt_path} ({checkpoint_minutes:g} minutes since the last one)")
    if signum:
        stop.end(guard.STOPPED, ckpt.stopped(signum, sys.argv, ddp))
    # Evaluate and write ckpt.pt every eval_interval steps and at the end (at every evaluation, not only when val loss
    # improves: resuming must continue from the latest state), unless ckpt.pt holds this step evaluated already: a
    # resumed run's first step, when the run that wrote the checkpoint has done and logged its evaluation.
    if eval_due and not (ckpt.step == iter_num and resumed_evaluated):
        pending.read()  # a non-finite train loss is named first, before the evaluation it spoils
        losses = estimate_loss()
        if losses is None:  # stopped by a signal: the next pass writes this step, unevaluated, and stops
            continue
        pending.check(iter_num, {f"{split} loss": losses[split] for split in ("train", "val")})
        best_val_loss = min(best_val_loss, losses["val"])  # travels in the checkpoint for information
        if master:
            log_eval(losses)
        # after the record, so that an "evaluated" checkpoint has one (a kill between resumes from the one before)
        save_checkpoint(evaluated=True)
        window_start, window_steps, window_flops = time.perf_counter(), 0, 0  # evaluation time is not in tokens/s, MFU
        # a signal during the diagnostics or the write stops here: ckpt.pt holds this step, and another step would
        # mean another write within the scheduler's grace period
        signum, = procs.agree(stop.signum)
        if signum and iter_num < max_iters:
            stop.end(guard.STOPPED, ckpt.stopped(signum, sys.argv, ddp))
    if iter_num >= max_iters:
        break

    lr = get_lr(iter_num) if decay_lr else learning_rate
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), device=device)
    step_loops = LAB and LAB.step_loops(iter_num) or n_loop  # the same on every process and micro-batch
    for micro in range(accum_steps):
        index = iter_num * gradient_accumulation_steps + rank * accum_steps + micro
        x, y = to_device(train_data.batch(index, batch_size))
        # DDP averages gradients over processes in backward; only the last micro-batch's backward needs to
        with model.no_sync() if ddp and micro < accum_steps - 1 else nullcontext():
            with autocast:
                # not holding on to the (B, T, vocab) logits: backward needs less memory
                loss = model(x, y, n_loop=step_loops)[1]
            scaler.scale(loss / accum_steps).backward()
        loss_sum += loss.detach().float()
    scaler.unscale_(optimizer)  # clip the true gradient, not the scaled one
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    pending.add(iter_num, loss_sum, None if scaler.is_enabled() else grad_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

    # MFU counts the loops each step ran, the backward pass over its tracked loops only (runtime.flops_per_token)
    window_steps += 1
    window_flops += flops_per_token(raw_model, step_loops, LAB.backprop_loops if LAB else 0) * tokens_per_iter
    if iter_num % log_interval == 0 or len(pending) >= 100:  # 100: the NaN guard looks at least that often
        loss_value = pending.read()[iter_num]
        if master and iter_num % log_interval == 0:
            dt = (time.perf_counter() - window_start) / window_steps  # seconds per step since the last record
            tokens_per_sec = tokens_per_iter / dt
            mfu = window_flops / window_steps / dt / (peak_flops * world_size)
            log(dict(type="train", iter=iter_num, tokens=(iter_num + 1) * tokens_per_iter, loss=loss_value, lr=lr,
                     loops=step_loops, grad_norm=grad_norm.item() if grad_norm.isfinite() else None,
                     tokens_per_sec=tokens_per_sec, mfu=mfu))  # grad_norm inf: a float16 step that GradScaler skipped
            window_start, window_steps, window_flops = time.perf_counter(), 0, 0
            progress = f"loss {loss_value:.4f} lr {lr:.2e} tok/s {tokens_per_sec:,.0f} mfu {mfu:.1%}"
            if bar:
                pbar.set_postfix_str(progress, refresh=False)
            else:
                print(f"step {iter_num}/{max_iters}: {progress}", flush=True)
    pbar.update()
    iter_num += 1

pbar.close()
if master:
    if metrics.error:
        die(ckpt.write_failed(metrics.path, metrics.error, iter_num))
    metrics.close()
    if wandb_log:
        wandb.finish()
