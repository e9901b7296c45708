"""
Train a looped GPT (model.py) on a dataset made by prepare_data.py.

One process (GPU when there is one, else CPU):
    python train.py config/smoke_cpu.py
    python train.py config/smoke_cpu.py --init_from=resume --max_iters=200
Several processes with DDP, on GPUs (nccl) or on CPUs (gloo):
    torchrun --standalone --nproc_per_node=8 train.py config/loop_small.py
Baselines are overrides:  --residual=deepnorm  (DeepNorm's exponents)  --n_loop=1  (no looping)

The settings are the module-level variables below; config files and --key=value overrides change them
(configurator.py). A run writes two files to out_dir: ckpt.pt (at every evaluation) and metrics.jsonl.
"""

import json
import math
import os
import random
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from configurator import configure, die
from model import GPT, GPTConfig, autocast_context, default_peak_flops
from prepare_data import TokenWindows, load_meta, prepare_builtin_if_missing

# ---------------------------------------------------------------------------------------------------------------------
# config; the defaults are a GPT-2-small-wide looped model on OpenWebText (like config/loop_small.py)
# I/O
out_dir = "out"
eval_interval = 1000     # evaluate, record loop diagnostics and write ckpt.pt every this many steps, and at the end
eval_iters = 200         # batches per split in an evaluation
log_interval = 10        # a train record in metrics.jsonl every this many steps
init_from = "scratch"    # "scratch", or "resume" from out_dir/ckpt.pt
wandb_log = False        # also log to Weights & Biases (needs `pip install wandb`)
wandb_project = "deeploop"
wandb_run_name = "run"
# data
dataset = "openwebtext"  # folder data/<dataset> from prepare_data.py; builtin and builtin_bytes prepare themselves
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
residual = "deeploop"    # deeploop | deepnorm | postln | preln
residual_exponent = 0.0  # p of alpha = (2N)^p, beta = (8N)^-p for deeploop/deepnorm; 0 = the scheme's own
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
lr_decay_iters = 600000  # the schedule depends on max_iters only through this, so a run can be extended by resuming
min_lr = 6e-5
# system
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else (
    "float16" if torch.cuda.is_available() else "float32")  # half precision only on cuda, through autocast
compile = torch.cuda.is_available()  # torch.compile: faster steps on GPUs, but minutes of compiling on a CPU
seed = 1337
peak_flops = 0.0         # FLOP/s of one device for MFU; 0: a default for the device (see default_peak_flops)
config = configure(globals(), sys.argv[1:])
# ---------------------------------------------------------------------------------------------------------------------

if init_from not in ("scratch", "resume"):
    die(f"init_from must be 'scratch' or 'resume', got {init_from!r}")
if dtype not in ("float32", "bfloat16", "float16"):
    die(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
if min(eval_interval, eval_iters, log_interval, gradient_accumulation_steps, batch_size) < 1:
    die("eval_interval, eval_iters, log_interval, gradient_accumulation_steps and batch_size must all be >= 1")

# DDP: torchrun starts one process per device and tells each its RANK and WORLD_SIZE
ddp = "RANK" in os.environ
rank, world_size = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
master = rank == 0  # the one process that prints, logs and writes files
if ddp:
    if device.startswith("cuda"):
        device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
if gradient_accumulation_steps % world_size:
    die(f"gradient_accumulation_steps={gradient_accumulation_steps} (the total over all processes) is not divisible "
        f"by the {world_size} processes; use a multiple of {world_size}")
accum_steps = gradient_accumulation_steps // world_size  # micro-batches this process runs per step
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size
device_type = device.split(":")[0]
autocast = autocast_context(device, dtype)
if device_type == "cpu":
    # Deep Post-LN stacks produce tiny (denormal) gradients in their early visits; CPUs compute on denormals many
    # times slower (measured: 2 blocks x 32 loops, 5.1 s a step without this, 0.44 s with it, same loss)
    torch.set_flush_denormal(True)

# data: builtin and builtin_bytes are made here when missing (by the master; the others wait for it)
data_dir = prepare_builtin_if_missing(dataset) if master else os.path.join("data", dataset)
if ddp:
    dist.barrier()
meta = load_meta(data_dir)  # dies with the command that prepares the dataset when it is missing
vocab_size = -(-meta["vocab_size"] // 64) * 64  # the tokenizer's n_vocab padded to a multiple of 64: faster matmuls
# The reader is a pure function of (seed, split, index): the data position is the step number, which makes resuming
# exact and lets DDP ranks split a step's micro-batches between them. Evaluation windows are fixed and the same in
# every run on a dataset, whatever its seed, so that runs with other seeds or schemes are compared on the same text;
# the train-split ones are drawn with a seed that training does not use.
EVAL_SEED = 2**32 - 1
train_data = TokenWindows(data_dir, "train", block_size, seed)
train_eval_data = TokenWindows(data_dir, "train", block_size, EVAL_SEED)
val_data = TokenWindows(data_dir, "val", block_size, EVAL_SEED)


def to_device(batch):
    if device_type == "cuda":  # pinned memory lets the copy run while the GPU still works on the previous batch
        return [t.pin_memory().to(device, non_blocking=True) for t in batch]
    return [t.to(device) for t in batch]


# model and optimizer
model_args = dict(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_loop=n_loop, n_head=n_head,
                  n_embd=n_embd, dropout=dropout, bias=bias, residual=residual,
                  residual_exponent=residual_exponent)
try:
    gpt_config = GPTConfig(**model_args)
except ValueError as e:
    die(str(e))
torch.manual_seed(seed)  # the same initial weights on every rank (DDP would broadcast rank 0's anyway)
ckpt_path = os.path.join(out_dir, "ckpt.pt")
if init_from == "scratch":
    raw_model = GPT(gpt_config).to(device)
    iter_num, best_val_loss = 0, math.inf
else:
    raw_model, checkpoint = GPT.from_checkpoint(ckpt_path, device)
    if checkpoint["tokenizer"] != meta["tokenizer"]:
        die(f"{ckpt_path} was trained on {checkpoint['tokenizer']} tokens but data/{dataset} holds "
            f"{meta['tokenizer']} tokens; resume with the dataset it was trained on")
    changed = [f"{k}={model_args[k]!r} (checkpoint: {v!r})" for k, v in checkpoint["model_args"].items()
               if model_args[k] != v]
    if changed:
        die(f"resuming {ckpt_path} with another model: {', '.join(changed)}; use the run's config unchanged")
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
optimizer = raw_model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")  # float16 needs loss scaling; bfloat16 not


def rng_states():
    """This process's random generator states, as tensors, since a weights_only checkpoint holds no numpy or Python
    objects. Mersenne Twister words are below 2^32, so float64 holds them exactly."""
    _, words, pos, has_gauss, gauss = np.random.get_state()
    _, python_words, python_gauss = random.getstate()
    return dict(torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state(device) if device_type == "cuda" else None,
                numpy=torch.tensor([*words, pos, has_gauss, gauss], dtype=torch.float64),
                python=torch.tensor([*python_words, math.nan if python_gauss is None else python_gauss],
                                    dtype=torch.float64))


def set_rng_states(states):
    torch.set_rng_state(states["torch"].cpu())
    if device_type == "cuda" and states["cuda"] is not None:
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)
    v = states["numpy"].tolist()
    np.random.set_state(("MT19937", np.array(v[:624], dtype=np.uint32), int(v[624]), int(v[625]), v[626]))
    v = states["python"].tolist()
    random.setstate((3, tuple(int(w) for w in v[:-1]), None if math.isnan(v[-1]) else v[-1]))


# every process draws its own dropout masks; a checkpoint keeps the generator states of all of them
torch.manual_seed(seed + rank)
np.random.seed(seed + rank)
random.seed(seed + rank)
if init_from == "resume":
    optimizer.load_state_dict(checkpoint["optimizer"])
    if scaler.is_enabled() and checkpoint["scaler"]:
        scaler.load_state_dict(checkpoint["scaler"])
    if len(checkpoint["rng"]) == world_size:
        set_rng_states(checkpoint["rng"][rank])
    elif master and dropout > 0:
        print(f"note: {ckpt_path} was written by {len(checkpoint['rng'])} processes, this run has {world_size}; "
              f"dropout masks will differ from an uninterrupted run")
    del checkpoint  # frees its copy of the weights and optimizer state
model = torch.compile(raw_model) if compile else raw_model  # evaluation runs this one: no DDP collectives
ddp_model = DDP(model, device_ids=[torch.cuda.current_device()] if device_type == "cuda" else None) if ddp else model


def gather(obj):
    """obj of every process, in rank order (a collective: all processes call it)."""
    if not ddp:
        return [obj]
    objs = [None] * world_size
    dist.all_gather_object(objs, obj)
    return objs


def save_checkpoint():
    """Write ckpt.pt atomically: to a temporary file, synced to disk, then renamed over the old one. A process killed
    at any moment leaves either the previous checkpoint or the new one, never half a file."""
    rng = gather(rng_states())
    if not master:
        return
    checkpoint = dict(program="deeploop-train", model=raw_model.state_dict(), model_args=model_args,
                      tokenizer=meta["tokenizer"], optimizer=optimizer.state_dict(),
                      scaler=scaler.state_dict() if scaler.is_enabled() else None, iter_num=iter_num,
                      best_val_loss=best_val_loss, config={k: globals()[k] for k in config}, rng=rng)
    tmp_path = ckpt_path + ".tmp"
    with open(tmp_path, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_path, ckpt_path)


@torch.no_grad()
def estimate_loss():
    """Mean loss over eval_iters fixed batches per split; DDP processes share the batches out and sum."""
    model.eval()
    losses = {}
    for split, data in (("train", train_eval_data), ("val", val_data)):
        total = torch.zeros((), device=device)
        for index in range(rank, eval_iters, world_size):
            x, y = to_device(data.batch(index, batch_size))
            with autocast:
                total += model(x, y)[1].float()
        if ddp:
            dist.all_reduce(total)
        losses[split] = total.item() / eval_iters
    model.train()
    return losses


def loop_diagnostics():
    """model.loop_diagnostics on the first train-eval batch (the same batch at every evaluation), on the raw model:
    it runs the blocks one visit at a time, which neither torch.compile nor DDP need to see."""
    x, y = to_device(train_eval_data.batch(0, batch_size))
    raw_model.eval()  # no dropout: the diagnostics are deterministic and draw no random numbers
    with autocast:
        diagnostics = raw_model.loop_diagnostics(x, y)
    raw_model.train()
    return diagnostics


def get_lr(it):
    if not decay_lr:
        return learning_rate
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    progress = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (learning_rate - min_lr)


def stop_diverged(what, value):
    """A non-finite loss ends the run before anything is saved, so ckpt.pt keeps the last good state."""
    pbar.close()
    if master:
        kept = f"{ckpt_path} keeps the last good state (step {saved_iter})" if saved_iter is not None else \
            "this run wrote no checkpoint"
        die(f"{what} is {value} at step {iter_num}: training diverged; {kept}; lower learning_rate or raise "
            f"warmup_iters")
    sys.exit(2)


# logging
if master:
    os.makedirs(out_dir, exist_ok=True)
    metrics_file = open(os.path.join(out_dir, "metrics.jsonl"), "a" if init_from == "resume" else "w")
    peak_flops, peak_source = (peak_flops, "peak_flops") if peak_flops > 0 else default_peak_flops(device, dtype)
    if wandb_log:
        try:
            import wandb
        except ImportError:
            die("wandb_log=True needs the wandb package: pip install wandb (or leave wandb_log off)")
        wandb.init(project=wandb_project, name=wandb_run_name, config=config)


def log(record):
    """Append one JSON line to metrics.jsonl (and send the numbers to wandb)."""
    metrics_file.write(json.dumps(record) + "\n")
    metrics_file.flush()
    if wandb_log and record["type"] != "start":
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "iter"}
        numbers.update({f"kappa_{b}": k for b, k in enumerate(record.get("loop", {}).get("kappa", []))})
        wandb.log({f"{record['type']}/{k}": v for k, v in numbers.items()}, step=record["iter"])


if master:
    n_params = raw_model.num_params()
    print(f"{n_params / 1e6:.2f}M parameters, {n_layer} blocks x {n_loop} loops ({residual}), vocab {vocab_size} "
          f"({meta['tokenizer']}), {tokens_per_iter:,} tokens per step on {world_size} x {device} in {dtype}, "
          f"MFU against {peak_flops:.3g} FLOP/s per device ({peak_source})")
    log(dict(type="start", iter=iter_num, resumed=init_from == "resume", params=n_params, world_size=world_size,
             config={k: globals()[k] for k in config}))

# ---------------------------------------------------------------------------------------------------------------------
# training loop. Step iter_num trains on micro-batches iter_num * gradient_accumulation_steps + 0, 1, ...; process
# `rank` takes its accum_steps consecutive ones, so 2 processes x 2 micro-batches see what 1 process x 4 sees.
first_iter, saved_iter = iter_num, iter_num if init_from == "resume" else None
if master and init_from == "resume" and iter_num >= max_iters:
    print(f"{ckpt_path} is at step {iter_num} already; raise --max_iters to train on")
pbar = tqdm(total=max_iters, initial=iter_num, disable=not master, dynamic_ncols=True, desc="train")
window_start, window_steps = time.perf_counter(), 0
tokens_per_sec = mfu = None
while True:
    # Evaluate (and checkpoint) every eval_interval steps and at the end; a resumed run skips its first step's,
    # which the run that wrote the checkpoint has already done and logged.
    resumed_here = init_from == "resume" and iter_num == first_iter
    if (iter_num % eval_interval == 0 or iter_num >= max_iters) and not resumed_here:
        losses = estimate_loss()
        for split in ("train", "val"):
            if not math.isfinite(losses[split]):
                stop_diverged(f"{split} loss", losses[split])
        best_val_loss = min(best_val_loss, losses["val"])
        diagnostics = loop_diagnostics() if master else None
        # At every evaluation, not only when val loss improves: resuming must continue from the latest state.
        # best_val_loss travels in the checkpoint for information.
        save_checkpoint()
        saved_iter = iter_num
        if master:
            kappa = diagnostics["kappa"]
            tqdm.write(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}, kappa_R "
                       f"(R={n_loop}) min {min(kappa):.2f} mean {sum(kappa) / len(kappa):.2f} max {max(kappa):.2f}")
            log(dict(type="eval", iter=iter_num, tokens=iter_num * tokens_per_iter, train_loss=losses["train"],
                     val_loss=losses["val"], loop=diagnostics))
        window_start, window_steps = time.perf_counter(), 0  # evaluation time does not count against tokens/s
    if iter_num >= max_iters:
        break

    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), device=device)
    for micro in range(accum_steps):
        x, y = to_device(train_data.batch(iter_num * gradient_accumulation_steps + rank * accum_steps + micro,
                                          batch_size))
        # DDP averages gradients over processes in backward; only the last micro-batch's backward needs to
        with ddp_model.no_sync() if ddp and micro < accum_steps - 1 else nullcontext():
            with autocast:
                loss = ddp_model(x, y)[1]  # not holding on to the (B, T, vocab) logits: backward needs less memory
            scaler.scale(loss / accum_steps).backward()
        loss_sum += loss.detach().float()
    if ddp:
        dist.all_reduce(loss_sum)
    loss_value = loss_sum.item() / gradient_accumulation_steps  # mean over the step's micro-batches, all processes
    if not math.isfinite(loss_value):
        stop_diverged("train loss", loss_value)
    scaler.unscale_(optimizer)  # clip the true gradient, not the scaled one
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

    window_steps += 1
    if master:
        if iter_num % log_interval == 0:
            dt = (time.perf_counter() - window_start) / window_steps  # seconds per step since the last record
            tokens_per_sec = tokens_per_iter / dt
            mfu = raw_model.estimate_mfu(tokens_per_iter, dt, peak_flops * world_size)
            log(dict(type="train", iter=iter_num, tokens=(iter_num + 1) * tokens_per_iter, loss=loss_value, lr=lr,
                     grad_norm=grad_norm.item() if grad_norm.isfinite() else None,  # inf: a skipped float16 step
                     tokens_per_sec=tokens_per_sec, mfu=mfu))
            window_start, window_steps = time.perf_counter(), 0
        pbar.set_postfix_str(f"loss {loss_value:.4f} lr {lr:.2e}"
                             + (f" tok/s {tokens_per_sec:,.0f} mfu {mfu:.1%}" if mfu is not None else ""),
                             refresh=False)
        pbar.update()
    iter_num += 1

pbar.close()
if master:
    metrics_file.close()
    if wandb_log:
        wandb.finish()
if ddp:
    dist.destroy_process_group()
