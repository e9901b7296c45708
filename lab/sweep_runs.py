"""
The runs of lab.sweep: each one a plain `python train.py --key=value ...` in a subprocess, in its own folder
out_dir/runs/<name>, where result.json marks it done (a run whose folder holds one is not trained again). Runs holds
the settings that every run of one sweep gets; lab/sweep.py makes it once its settings are checked.
"""

import json
import os
import subprocess
import sys
import time

from configurator import die
from lab.plot import read_metrics
from runtime import choose_dtype


def split_scheme(scheme):
    """'deeploop+add+curriculum' -> ('deeploop', ['add', 'curriculum']): a residual scheme, and its variants."""
    residual, *variants = scheme.split("+")
    return residual, variants


def run_name(scheme, n_loop, exponent, lr, seed, steps=None):
    return f"{scheme}_R{n_loop}_p{exponent:g}_lr{lr:g}_seed{seed}" + (f"_it{steps}" if steps else "")


def mean_over_k(accuracy):
    return sum(accuracy.values()) / len(accuracy)


def git_commit():
    """The commit of the code the runs train with, '+dirty' when tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


class Runs:
    """The runs of one sweep into out_dir/runs. mode_budget: the model and budget settings given to the sweep or
    its mode's own (sweep.py's BUDGETS), which the depth task's runs pass on over depth_config; the other settings
    are those of sweep.py of the same names; variant_settings(scheme): the train.py settings of its variants."""

    def __init__(self, out_dir, mode, on_chains, dataset, mode_budget, depth_config, variant_settings, loop_list,
                 checkpoint_minutes, n_layer, n_head, n_embd, block_size, batch_size, max_iters, warmup_iters,
                 eval_iters):
        self.out_dir, self.mode, self.on_chains, self.dataset = out_dir, mode, on_chains, dataset
        self.mode_budget, self.depth_config, self.variant_settings = mode_budget, depth_config, variant_settings
        self.loop_list, self.checkpoint_minutes = loop_list, checkpoint_minutes
        self.n_layer, self.n_head, self.n_embd, self.block_size = n_layer, n_head, n_embd, block_size
        self.batch_size, self.max_iters, self.warmup_iters, self.eval_iters = batch_size, max_iters, warmup_iters, \
            eval_iters
        self.dtype, self.commit = None, git_commit()

    def train(self, scheme, n_loop, exponent, lr, seed, steps=None):
        """One train.py run (of steps steps, default max_iters) -> its result dict (also saved as result.json in the
        run's folder)."""
        name = run_name(scheme, n_loop, exponent, lr, seed, steps)
        steps = steps or self.max_iters
        run_dir = os.path.join(self.out_dir, "runs", name)
        residual = split_scheme(scheme)[0]
        result_path = os.path.join(run_dir, "result.json")
        if os.path.isfile(result_path):
            with open(result_path) as f:
                return json.load(f)
        if self.on_chains:
            # the untied control: the same unrolled depth as R loops over n_layer blocks, every block its own
            untied = residual == "untied"
            args = dict(self.mode_budget, out_dir=run_dir, residual="preln" if untied else residual,
                        residual_exponent=exponent, n_layer=self.n_layer * n_loop if untied else self.n_layer,
                        n_loop=1 if untied else n_loop, learning_rate=lr, min_lr=lr / 10, seed=seed, device="cpu",
                        dtype=self.dtype, compile=False, start_over=True, **self.variant_settings(scheme))
            args.update(lr_decay_iters=args["max_iters"], eval_interval=args["max_iters"])
            cmd = [sys.executable, "-m", "lab.train", self.depth_config] + [f"--{k}={v}" for k, v in args.items()]
        else:
            args = dict(out_dir=run_dir, dataset=self.dataset, residual=residual, residual_exponent=exponent,
                        n_layer=self.n_layer, n_loop=n_loop, n_head=self.n_head, n_embd=self.n_embd,
                        block_size=self.block_size, batch_size=self.batch_size, gradient_accumulation_steps=1,
                        dropout=0.0, learning_rate=lr, min_lr=lr / 10, warmup_iters=self.warmup_iters, max_iters=steps,
                        lr_decay_iters=steps,
                        eval_interval=steps if steps < 10_000 else steps // 10,  # a long run's val curve too
                        eval_iters=self.eval_iters, log_interval=max(1, steps // 25), seed=seed, device="cpu",
                        dtype=self.dtype, compile=False, checkpoint_minutes=self.checkpoint_minutes)
            args.update(self.variant_settings(scheme))  # a variant may set what every run sets (warmup_iters)
            # a run stopped part-way (a session's end, SIGTERM) resumes from its checkpoint, bit for bit
            resumed = os.path.isfile(os.path.join(run_dir, "ckpt.pt"))
            args.update(dict(init_from="resume") if resumed else dict(start_over=True))
            cmd = [sys.executable, "-m", "lab.train"] + [f"--{k}={v}" for k, v in args.items()]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0 and "diverged" not in proc.stderr:
            die(f"run {name} failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}; command: "
                f"{' '.join(cmd)}")
        records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        evals = [r for r in records if r["type"] == "eval"]
        final = evals[-1] if proc.returncode == 0 else None  # a diverged run (non-finite loss) has no final eval
        kappa = final["loop"]["kappa"] if final else None
        start = [r for r in records if r["type"] == "start"]
        result = dict(name=name, scheme=scheme, n_loop=n_loop, exponent=exponent, lr=lr, seed=seed, dtype=self.dtype,
                      steps=steps, seconds=time.time() - t0, val_loss=final["val_loss"] if final else None,
                      # every machine a run trained on (a resumed run may have moved), and the code it ran
                      machines=list({json.dumps(r.get("machine")): r.get("machine") for r in start}.values()),
                      commit=self.commit,
                      val_curve=[(r["iter"], r["val_loss"]) for r in evals],
                      kappa=sum(kappa) / len(kappa) if kappa else None,  # mean over the physical blocks
                      curve=[(r["iter"], r["loss"]) for r in records if r["type"] == "train"])
        if self.on_chains:
            result.update(self.depth_result(run_dir, records, final))
        with open(result_path, "w") as f:
            json.dump(result, f)
        status = "diverged" if final is None else f"val {result['val_loss']:.4f} kappa {result['kappa']:.2f}"
        if self.on_chains and final:
            status = f"accuracy {mean_over_k(result['accuracy']):.3f} kappa {result['kappa']:.2f}"
        print(f"{name:40s} {status:>24s}  ({result['seconds']:.0f} s)", flush=True)
        return result

    def depth_result(self, run_dir, records, final):
        """A depth-task run's figures: val accuracy by k at the end, the best shortcut by k, and (depth mode) the
        accuracy by k at other loop counts (test-time depth: each of the sweep's loop counts, and twice the largest),
        in the run's precision as train.py evaluates (tasks.run_precision): at its own loop count, the run's
        accuracy."""
        import torch
        from guard import load_checkpoint
        from dataset import EVAL_SEED
        from lab.tasks import best_shortcut, evaluate, make_task, run_precision
        start = [r for r in records if r["type"] == "start"][-1]
        result = dict(accuracy=final["accuracy"] if final else None, shortcut=best_shortcut(start["shortcuts"]),
                      test_time={})
        if final and self.mode == "depth" and start["config"]["n_layer"] == self.n_layer:  # not the untied control
            torch.set_num_threads(1)
            model, checkpoint = load_checkpoint(os.path.join(run_dir, "ckpt.pt"))
            task = make_task(checkpoint["config"], "val", EVAL_SEED)
            _, autocast = run_precision(checkpoint, "cpu")
            for loops in sorted(set(self.loop_list) | {2 * max(self.loop_list)}):
                result["test_time"][str(loops)] = evaluate(model, task, checkpoint["config"]["eval_iters"],
                                                           checkpoint["config"]["batch_size"], loops, autocast)
        return result

    def sweep_dtype(self, dtype):
        """(the precision of every run, why), kept as self.dtype. Runs that each measured could pick differently on a
        noisy machine, so the sweep decides once: the precision of the runs it already has (float32 before sweeps
        recorded it), else dtype as set, else measured here at the runs' shapes."""
        runs_dir, done = os.path.join(self.out_dir, "runs"), set()
        for name in os.listdir(runs_dir) if os.path.isdir(runs_dir) else []:
            if os.path.isfile(os.path.join(runs_dir, name, "result.json")):
                with open(os.path.join(runs_dir, name, "result.json")) as f:
                    done.add(json.load(f).get("dtype", "float32"))
        if len(done) > 1 or done and dtype not in ("auto", *done):
            die(f"{self.out_dir} holds runs in {', '.join(sorted(done))}; a sweep keeps one precision: leave --dtype at "
                f"auto or choose another --out_dir")
        if done:
            self.dtype = done.pop()
            return self.dtype, f"the precision of the runs in {self.out_dir}"
        try:
            self.dtype, reason = choose_dtype("cpu", dtype, self.n_embd, self.batch_size * self.block_size)
        except ValueError as e:
            die(str(e))
        return self.dtype, reason
