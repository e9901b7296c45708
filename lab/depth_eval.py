"""
A model trained on a task of tasks.py (config/depth_cpu.py): its val accuracy by k at the loop count it was trained
with and at others (test-time depth), beside the best shortcut, and a few of its solved and failed answers.

    python -m lab.depth_eval --out_dir=out-depth
    python -m lab.depth_eval --out_dir=out-depth --loops=1,2,4,8,16 --examples=2
    python -m lab.depth_eval --out_dir=out-depth-sampled --loops=1,2,4,8 --exit_thresholds=1e-3,1e-2   # adaptive exit

The val batches are the ones train.py evaluates on, in the precision it evaluates in (the run's dtype, under
autocast: tasks.run_precision), so the trained loop count reproduces the run's last accuracy.
"""

import sys

import torch

from configurator import configure, die
from dataset import EVAL_SEED
from model import MAX_LOOPS
from guard import load_checkpoint
from runtime import check_device
from lab.tasks import TASKS, best_shortcut, evaluate, evaluate_exit, format_by_k, make_task, run_precision, shortcuts

out_dir = "out-depth"  # the train.py run: reads out_dir/ckpt.pt
loops = ""             # loop counts to evaluate at, comma-separated; "" = the trained count only
examples = 2           # solved and failed answers shown at each k that has both (0: none)
# adaptive exit (lab.decode.exit_logits) at each of these KL thresholds, comma-separated, at most the largest of loops:
# accuracy by k, and the loops the answers at each k took (mean and standard deviation)
exit_thresholds = ""
device = "cpu"
configure(globals(), sys.argv[1:])
if examples < 0:
    die(f"--examples must be >= 0 (answers shown at each k; 0: none), got {examples}")

try:
    check_device(device)
    model, checkpoint = load_checkpoint(f"{out_dir}/ckpt.pt", device)
except (FileNotFoundError, ValueError) as e:
    die(str(e))
config = checkpoint["config"]
if config.get("dataset") not in TASKS:
    die(f"{out_dir} was trained on data/{config.get('dataset')}, not on a task of tasks.py ({', '.join(TASKS)}); "
        f"use sample.py for text")
try:
    loop_counts = [int(v) for v in str(loops).split(",")] if loops else [model.config.n_loop]
except ValueError:
    die(f"loops must be comma-separated ints like 1,2,4,8, got {loops!r}")
if not all(1 <= c <= MAX_LOOPS for c in loop_counts):
    die(f"loop counts must be from 1 to {MAX_LOOPS} (model.MAX_LOOPS), got {loops!r}")
dtype, autocast = run_precision(checkpoint, device)
try:
    thresholds = [float(v) for v in str(exit_thresholds).split(",")] if exit_thresholds != "" else []
except ValueError:
    die(f"exit_thresholds must be comma-separated numbers like 1e-3,1e-2, got {exit_thresholds!r}")
if not all(t >= 0 for t in thresholds):
    die(f"exit thresholds must be >= 0 (0 = off), got {exit_thresholds!r}")
task = make_task(config, "val", EVAL_SEED)
n_batches, batch_size = config["eval_iters"], config["batch_size"]

x, y = zip(*(task.batch(index, batch_size) for index in range(n_batches)))
x, y = torch.cat(x), torch.cat(y)
print(f"{out_dir}: {model.config.n_layer} blocks x {model.config.n_loop} loops ({model.config.residual}), trained "
      f"{checkpoint['iter_num']} steps on {task.name}; val accuracy by k = 1..{task.max_hops} over {len(x)} "
      f"sequences, in {dtype} as the run evaluated")
print(f"{'best shortcut':>16}: {format_by_k(best_shortcut(shortcuts(task, x, y)))}")
for n_loop in loop_counts:
    accuracy = evaluate(model, task, n_batches, batch_size, n_loop, autocast)
    trained = " (trained)" if n_loop == model.config.n_loop else ""
    print(f"{f'{n_loop} loops{trained}':>16}: {format_by_k(accuracy)}")
for threshold in thresholds:
    accuracy, loops_by_k = evaluate_exit(model, task, n_batches, batch_size, threshold, max(loop_counts),
                                             autocast)
    used = torch.cat(list(loops_by_k.values()))
    print(f"{f'exit at KL {threshold:g}':>16}: {format_by_k(accuracy)}; loops by k "
          f"{' '.join(f'{v.mean():.2f}' for v in loops_by_k.values())}, sd "
          f"{' '.join(f'{v.std(correction=0):.2f}' for v in loops_by_k.values())}; mean {used.mean():.2f} of at "
          f"most {max(loop_counts)}")

if examples:
    # the first sequences' answers at each k, solved and failed, at the trained loop count
    with torch.no_grad(), autocast:
        prediction = model(x[:64].to(device))[0].argmax(-1).cpu()
    k = task.hops(x[:64])
    print(f"\nexamples at {model.config.n_loop} loops: the chain of pointers back to its value, and the model's answer")
    for j in range(1, task.max_hops + 1):
        for solved in (True, False):
            rows, cells = torch.nonzero((k == j) & ((prediction == y[:64]) == solved), as_tuple=True)
            for row, cell in list(zip(rows.tolist(), cells.tolist()))[:examples]:
                print(f"k={j} {'solved' if solved else 'FAILED'}: {task.describe(x[row], cell)}; "
                      f"model: {prediction[row, cell].item()}")
