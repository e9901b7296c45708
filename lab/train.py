"""
train.py with what the lab adds to a run, which the lesson leaves out:

    python -m lab.train config/depth_cpu.py          # the depth task: pointer chains made on the fly (lab/tasks.py)
    python -m lab.train config/smoke_sampled.py      # loop counts drawn per step, Huginn's (lab/loops.py)
    python -m lab.train config/smoke_cpu.py          # any train.py run, with kappa_R and the stream probes recorded
    torchrun --standalone --nproc_per_node=8 -m lab.train config/paper_small.py --n_loop=3

It runs the lesson's train.py itself, unchanged, with LAB set to a Lab: the seam train.py defines. Every setting and
behaviour of train.py (resume, signals, DDP, the checkpoint) is the same; the Lab brings the settings below and
supplies what train.py asks it for: the task's batches in place of a dataset's token windows, a loop count per
training step and the module that trains (truncated backprop), and at every evaluation kappa_R and the stream probes
(lab/probes.py: the record's "loop"), on the task also the val accuracy by k at each evaluated loop count. A run the
Lab changed (a setting off its default) records that in its checkpoint, and train.py resumes it only under the lab.
"""

import os
import sys
from contextlib import nullcontext

import torch

from configurator import die
from lab.loops import TrainLoops, TruncatedBackprop
from lab.probes import loop_diagnostics
from lab.tasks import TASKS, best_shortcut, curriculum_hops, describe_accuracy, evaluate, format_by_k, make_task, \
    shortcuts

SETTINGS = dict(
    # the depth task, dataset=chains (lab/tasks.py): pointer chains of block_size cells a sequence
    chain_values=8,            # the values a chain can start with (chance is 1 / chain_values)
    chain_hops=6,              # pointers in the longest chain; accuracy is reported for k = 1 .. chain_hops
    chain_pointers="absolute",  # absolute (token: the cell's index) or relative (cells back: what RoPE sees)
    chain_curriculum=0,        # training chains grow from 1 pointer to chain_hops over this many steps (0: off)
    # loop counts for test-time depth (lab/loops.py); n_loop stays the count of evaluations and of sample.py
    loop_sampling="fixed",     # fixed: every step runs n_loop; uniform: loop_min..loop_max; lognormal_poisson: mean
    loop_min=0,                #   loop_mean
    loop_max=0,
    loop_mean=0.0,
    backprop_loops=0,          # gradients through the last this many loops of a step only; 0: through all of them
)
TRAIN_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py")


class Lab:
    """What train.py calls where LAB is set (its seam); `run` is train.py's namespace, its settings and, as it goes
    on, the objects it makes (the batch sources, the autocast context)."""

    def __init__(self):
        self.settings, self.defaults = dict(SETTINGS), SETTINGS

    def configure(self, run):
        """Check the lab's settings against the run's, once train.py has read both; dies with one line."""
        self.run, s = run, self.settings
        self.task = run["dataset"] in TASKS
        moved = [f"{k}={s[k]!r}" for k in SETTINGS if k.startswith("chain_") and s[k] != SETTINGS[k]]
        if moved and not self.task:
            die(f"chain settings only apply to dataset=chains, not {run['dataset']} ({', '.join(moved)}); leave them at "
                f"their defaults or use --dataset=chains")
        try:
            self.loops = TrainLoops(*(s[k] for k in ("loop_sampling", "loop_min", "loop_max", "loop_mean",
                                                     "backprop_loops")))
        except ValueError as e:
            die(str(e))
        if not run["eval_loops"] and self.loops.loop_sampling != "fixed":  # where test-time depth is trained for
            run["eval_loops"] = f"1,{2 * run['n_loop']}"
        self.backprop_loops = s["backprop_loops"]
        self.loop_bounds = self.loops.bounds(run["n_loop"])  # (fewest, most) loops a training step may run

    def changed(self):
        """The lab's settings off their defaults: what train.py records, so that only the lab resumes such a run."""
        return {k: v for k, v in self.settings.items() if v != SETTINGS[k]} | ({"dataset": self.run["dataset"]}
                                                                              if self.task else {})

    def data(self, splits):
        """The task's (train, train-eval, val) batch sources for train.py's (seed, split) splits and its meta, or None
        on a dataset of tokens. The training source takes a curriculum's chain length from the micro-batch index."""
        if not self.task:
            return None
        config = {**self.run, **self.settings}
        try:
            train, train_eval, val = (make_task(config, split, seed) for seed, split in splits)
        except ValueError as e:
            die(str(e))
        steps, curriculum, hops = (self.run["gradient_accumulation_steps"], self.settings["chain_curriculum"],
                                   self.settings["chain_hops"])

        class Curriculum:
            def batch(self, index, batch_size):
                return train.batch(index, batch_size, curriculum_hops(index // steps, curriculum, hops))

        return (Curriculum(), train_eval, val), dict(tokenizer=val.name, vocab_size=val.vocab_size)

    def step_loops(self, step):
        """The loop count of training step `step`, None for the model's n_loop (lab.loops.TrainLoops.draw)."""
        return self.loops.draw(self.run["seed"], step)

    def wrap(self, model):
        """The module training runs: the model, or its truncated backprop (lab.loops.TruncatedBackprop)."""
        return TruncatedBackprop(model, self.backprop_loops) if self.backprop_loops else model

    def start(self):
        """(fields for the run's start record, lines to print) once the run is described."""
        run, lines, record = self.run, [], {}
        if run["batch_size"] < 2:
            lines.append("note: batch_size=1 leaves the stream probes (lab.probes) no sequence to score on: none are "
                         "recorded")
        if self.loops.loop_sampling != "fixed" or self.backprop_loops:
            lines.append(f"training loop counts: {self.loops.loop_sampling}, mean {self.loops.mean or run['n_loop']:g}"
                         + (f", backprop through the last {self.backprop_loops}" if self.backprop_loops else "")
                         + f"; evaluation at {run['n_loop']}")
        if self.task:  # guesses that do not follow the chains, scored on the evaluation's own val batches
            val = run["val_data"]
            x, y = (torch.cat(t) for t in zip(*(val.batch(i, run["batch_size"]) for i in range(run["eval_iters"]))))
            record = dict(shortcuts=shortcuts(val, x, y))
            lines.append(f"{val.name}: chance {1 / self.settings['chain_values']:.3f}; the best shortcut (not "
                         f"following the chains) by k = 1..{self.settings['chain_hops']}: "
                         f"{format_by_k(best_shortcut(record['shortcuts']))}")
        return record, lines

    def evaluate(self, model, by_loops):
        """(fields for an evaluation's record, what its line says after the losses, lines to print after it): the loop
        diagnostics on the first train-eval batch (the same at every evaluation), eager, since torch.compile need not
        see its visit-by-visit run, and not in float16, whose gradients, taken without loss scaling, would underflow
        in the early visits; on the task the val accuracy by k at each loop count of by_loops. The model is left in
        training mode."""
        run = self.run
        model.eval()  # no dropout: the diagnostics are deterministic and draw no random numbers
        with run["autocast"] if run["dtype"] != "float16" else nullcontext(), \
                torch.compiler.set_stance("force_eager"):
            diagnostics = loop_diagnostics(model, *run["to_device"](run["train_eval_data"].batch(0, run["batch_size"])))
        kappa, lines = diagnostics["kappa"], []
        said = f", kappa_R (R={run['n_loop']}) min {min(kappa):.2f} mean {sum(kappa) / len(kappa):.2f} max " \
               f"{max(kappa):.2f}"
        record = dict(loop=diagnostics)
        if self.task:
            accuracy = {loops: evaluate(model, run["val_data"], run["eval_iters"], run["batch_size"], loops,
                                        run["autocast"]) for loops in by_loops}
            lines.append(describe_accuracy(accuracy, run["n_loop"]))
            record.update(accuracy=accuracy[run["n_loop"]], accuracy_by_loops=accuracy)
        model.train()
        return record, said, lines


if __name__ == "__main__":
    # what a stopped run's resume command starts with (guard.CheckpointFile.stopped); train.py is run here rather than
    # by runpy.run_path, which sets sys.argv[0] to the file it runs until it returns
    sys.argv[0] = "-m lab.train"
    with open(TRAIN_PY) as f:
        code = compile(f.read(), TRAIN_PY, "exec")
    exec(code, dict(__name__="__main__", __file__=TRAIN_PY, LAB=Lab()))
