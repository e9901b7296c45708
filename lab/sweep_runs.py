"""
The runs of lab.sweep: each one a plain `python train.py --key=value ...` in a subprocess, in its own folder
out_dir/runs/<name>, where result.json marks it done (a run whose folder holds one is not trained again). Runs holds
the settings that every run of one sweep gets; lab/sweep.py makes it once its settings are checked.

A result is reused only for the run it stands for: result.json records every setting that changes a run's result
(settings: what train.py was given, the depth task's config file's settings beneath them), and a run whose result or
whose checkpoint (a run stopped part-way, resumed) was made with other settings than this sweep would give it stops
the sweep with one line naming them; so does an imported one (--results_from). Not compared: out_dir,
checkpoint_minutes and how the run started (a resumed run equals an uninterrupted one), and min_lr, lr_decay_iters,
eval_interval and log_interval, which follow from the rate and the steps. A setting that a result does not record
(result.json files and runs.jsonl lines from before the sweeps recorded them, like docs/runs/budget_study_runs.jsonl)
is taken to have had the value that its mode gives a run by default: the defaults of sweep.py, of its mode's BUDGETS
and of the depth task's config file, a variant's settings as VARIANTS has them, float32 (those of the budget study:
n_layer=2 n_head=4 n_embd=64 block_size=64 batch_size=8 warmup_iters=100 eval_iters=50 on stdlib_bytes).

result.json is written whole or not at all (a temporary file renamed over it); one that is no run's result, like a
runs.jsonl line that is none, is one line naming the file and the line. A run that fails stops the sweep with one
line, and the runs under way stop with their checkpoints, to resume at the next start. On SIGTERM or SIGINT the sweep
starts no more runs, passes the signal on to the runs under way, which stop with a checkpoint (train.py's exit code
75), and then ends with "stopped; resume with: <the same command>" and exit code 75; started again, those runs
resume. A second signal a second or more later ends the runs and the sweep at once (their checkpoints stay the
previous ones).
"""

import json
import os
import runpy
import shlex
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

from configurator import die
from guard import STOPPED
from lab.plot import read_metrics
from runtime import choose_dtype

UNCOMPARED = ("out_dir", "init_from", "start_over", "checkpoint_minutes", "min_lr", "lr_decay_iters",
              "eval_interval", "log_interval")
RECORD = dict(name=str, scheme=str, n_loop=int, exponent=(int, float), lr=(int, float), seed=int,
              seconds=(int, float))  # the fields every result has, and their types
STUDY_FILE = "name the file a budget study wrote, e.g. docs/runs/budget_study_runs.jsonl"
PHI_STUDY_FILE = "name the file a phi study wrote, e.g. docs/runs/phi_study_runs.jsonl"


# Model variants a scheme can run in, as `--schemes=deeploop+concat`, and together, as `deeploop+add+curriculum`: the
# designs of the recurrent-depth models (model.LoopInput; Huginn's prelude / core / coda), the DeepLoop paper's
# backbone, and the training levers tried on looped Post-LN blocks (the last two on the depth task's 1,500 steps)
VARIANTS = {
    "add": dict(loop_input="add"),
    "concat": dict(loop_input="concat"),
    "121": dict(n_prelude=1, n_coda=1),  # 1 prelude block, the core of n_layer looped, 1 coda block
    "huginn": dict(n_prelude=1, n_coda=1, loop_input="concat"),
    "paper": dict(norm="rmsnorm", position_encoding="rope", norm_branch_input=True),  # RMSNorm(a x + f(RMSNorm(x)))
    "relative": dict(chain_pointers="relative"),  # pointers RoPE can see (tasks.py)
    "curriculum": dict(chain_curriculum=750),  # chains grow from 1 pointer to chain_hops over half the run
    "warmup": dict(warmup_iters=500),  # five times the depth task's warmup
}


def split_scheme(scheme):
    """'deeploop+add+curriculum' -> ('deeploop', ['add', 'curriculum']): a residual scheme, and its variants."""
    residual, *variants = scheme.split("+")
    return residual, variants


def variant_settings(scheme):
    """The train.py settings of a scheme's variants, the later ones winning."""
    return {k: v for variant in split_scheme(scheme)[1] for k, v in VARIANTS[variant].items()}


def run_name(scheme, n_loop, exponent, lr, seed, steps=None):
    return f"{scheme}_R{n_loop}_p{exponent:g}_lr{lr:g}_seed{seed}" + (f"_it{steps}" if steps else "")


def mean_over_k(accuracy):
    return sum(accuracy.values()) / len(accuracy)


def bad_record(run, steps=False):
    """What makes run no result of a run, in words (None where it is one); steps: whether it must have its steps."""
    if not isinstance(run, dict):
        return f"a JSON {type(run).__name__}, not a run's record"
    fields = {**RECORD, **(dict(steps=int) if steps else {})}
    if missing := [k for k in fields if k not in run]:
        return f"a record without {', '.join(missing)}"
    wrong = [k for k, kind in fields.items() if not isinstance(run[k], kind) or isinstance(run[k], bool)]
    if not isinstance(run.get("val_loss"), (int, float, type(None))) or isinstance(run.get("val_loss"), bool):
        wrong.append("val_loss")
    if not isinstance(run.get("settings", {}), dict):
        wrong.append("settings")
    if wrong:
        return f"a record whose {', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} of the wrong type"
    return None


def write_json(path, value):
    """value as path's JSON, whole or not at all: written aside and renamed over path."""
    tmp_path = f"{path}.tmp"
    try:
        with open(tmp_path, "w") as f:
            json.dump(value, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)


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
    are those of sweep.py of the same names; variant_settings(scheme): the train.py settings of its variants.
    defaults: the Runs of the mode's default settings, whose settings stand in for those a result does not record."""

    def __init__(self, out_dir, mode, on_chains, dataset, mode_budget, depth_config, variant_settings, loop_list,
                 checkpoint_minutes, n_layer, n_head, n_embd, block_size, batch_size, max_iters, warmup_iters,
                 eval_iters, defaults=None, stop_with=None):
        self.out_dir, self.mode, self.on_chains, self.dataset = out_dir, mode, on_chains, dataset
        self.mode_budget, self.depth_config, self.variant_settings = mode_budget, depth_config, variant_settings
        self.loop_list, self.checkpoint_minutes = loop_list, checkpoint_minutes
        self.n_layer, self.n_head, self.n_embd, self.block_size = n_layer, n_head, n_embd, block_size
        self.batch_size, self.max_iters, self.warmup_iters, self.eval_iters = batch_size, max_iters, warmup_iters, \
            eval_iters
        self.defaults, self.dtype = defaults, None
        self.commit = git_commit() if defaults else None  # the defaults' Runs trains nothing
        # the depth task's config file, as its runs get it beneath their own settings
        self.depth_settings = {k: v for k, v in runpy.run_path(depth_config).items() if not k.startswith("_")
                               and isinstance(v, (int, float, str))} if on_chains else {}
        # how the sweep stops: signum, a signal it got (at signal_time); failed, a run that stopped it; procs, the
        # train.py processes under way, to pass a signal on to; handlers, those that catch_signals replaced. stop_with:
        # another Runs whose stop this one shares (the cells of one study, each with its own model, stop together)
        self.stop = stop_with.stop if stop_with else SimpleNamespace(
            signum=0, signal_time=0.0, failed=False, procs=set(), lock=threading.Lock(), handlers={})

    def args(self, scheme, n_loop, exponent, lr, seed, steps=None):
        """The train.py command line of a run (of steps steps, default max_iters) -> (command, its --key=value
        settings as a dict)."""
        run_dir = os.path.join(self.out_dir, "runs", run_name(scheme, n_loop, exponent, lr, seed, steps))
        steps = steps or self.max_iters
        residual = split_scheme(scheme)[0]
        if self.on_chains:
            # the untied control: the same unrolled depth as R loops over n_layer blocks, every block its own
            untied = residual == "untied"
            args = dict(self.mode_budget, out_dir=run_dir, residual="preln" if untied else residual,
                        residual_exponent=exponent, n_layer=self.n_layer * n_loop if untied else self.n_layer,
                        n_loop=1 if untied else n_loop, learning_rate=lr, min_lr=lr / 10, seed=seed, device="cpu",
                        dtype=self.dtype, compile=False, start_over=True, **self.variant_settings(scheme))
            args.update(lr_decay_iters=args["max_iters"], eval_interval=args["max_iters"])
            return [sys.executable, "-m", "lab.train", self.depth_config], args
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
        return [sys.executable, "-m", "lab.train"], args

    def settings(self, *job):
        """The settings that a run's result records: every train.py setting it gets but out_dir and how it starts."""
        args = self.args(*job)[1]
        return {**self.depth_settings, **{k: v for k, v in args.items() if k not in ("out_dir", "init_from",
                                                                                        "start_over")}}

    def changed(self, recorded, job, dtype="float32"):
        """The settings in which a run made with recorded (a result's settings, or those of train.py's start
        record) differs from the run job of this sweep, as "key=recorded" and "key=this sweep's" lists; dtype: the
        run's precision where recorded lacks it."""
        wanted = self.settings(*job)
        recorded = {**self.defaults.settings(*job), "dtype": dtype, **recorded}
        keys = [k for k, v in wanted.items() if k not in UNCOMPARED and recorded.get(k) != v]
        return ", ".join(f"{k}={recorded.get(k)!r}" for k in keys), ", ".join(f"{k}={wanted[k]!r}" for k in keys)

    def read(self, path):
        """The result in path, a result.json; one line and exit 2 where it is none (cut short, say)."""
        try:
            with open(path) as f:
                result = json.load(f)
        except ValueError as e:  # also a file that is no UTF-8 text
            self.fail(f"{path}, line {getattr(e, 'lineno', 1)}: not JSON ({getattr(e, 'msg', e)}; a result.json cut "
                      f"short?): delete it, and the sweep trains that run again")
        if why := bad_record(result):
            self.fail(f"{path}, line 1: {why}: delete it, and the sweep trains that run again")
        return result

    def done(self, scheme, n_loop, exponent, lr, seed, steps=None):
        """The result of a run that this sweep has already, or None; one line and exit 2 where it was made with
        other settings than this sweep would give it."""
        job = (scheme, n_loop, exponent, lr, seed, steps)
        path = os.path.join(self.out_dir, "runs", run_name(*job), "result.json")
        if not os.path.isfile(path):
            return None
        result = self.read(path)
        was, now = self.changed(result.get("settings", {}), job, result.get("dtype", "float32"))
        if was:
            self.fail(f"{path} was trained with {was}, where this sweep's runs get {now}: give the sweep the settings "
                      f"of the runs in {self.out_dir}, or choose another --out_dir")
        return result

    def import_results(self, path):
        """The runs of a runs.jsonl that a budget study wrote, as done here (a run of this out_dir's own is kept) ->
        (how many were taken, how many there were); see results_in."""
        imported = self.results_in(path)
        return self.take(imported), len(imported)

    def results_in(self, path, cell=None, needs=()):
        """The runs of a runs.jsonl that a study wrote, for this sweep. Every line is checked, and nothing is written:
        each must be a run's record, named as its run is, made with this sweep's settings, with the fields in needs;
        one line and exit 2 where one is not. cell: only the lines whose "cell" is this (lab.sweep_phi's runs.jsonl
        holds the runs of several shapes, lab.sweep's lines name none); a file of the other kind is one line too."""
        study_file = PHI_STUDY_FILE if cell else STUDY_FILE
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except (OSError, ValueError) as e:
            die(f"--results_from={path} is not a readable runs.jsonl ({type(e).__name__}): {study_file}")
        imported, cells = [], set()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                run = json.loads(line)
            except ValueError as e:
                die(f"--results_from={path}, line {number}: not JSON ({e.msg} at column {e.colno}): {study_file}")
            if why := bad_record(run, steps=True):
                die(f"--results_from={path}, line {number}: {why}: {study_file}")
            cells.add(run.get("cell"))
            if run.get("cell") != cell:
                continue
            # a diverged run (no val loss) has nothing to compute the needed figures from
            if run["val_loss"] is not None and (missing := [k for k in needs if not isinstance(run.get(k), (int, float))
                                                            or isinstance(run[k], bool)]):
                die(f"--results_from={path}, line {number}: run {run['name']} has no {', '.join(missing)}: "
                    f"{study_file}")
            job = (run["scheme"], run["n_loop"], run["exponent"], run["lr"], run["seed"], run["steps"])
            # the name is the run's folder, in out_dir/runs and nowhere else
            if run["name"] != run_name(*job) or os.path.basename(run["name"]) != run["name"]:
                die(f"--results_from={path}, line {number}: run name {run['name']!r} is not the folder name of its "
                    f"run ({run_name(*job)!r}): {study_file}")
            was, now = self.changed(run.get("settings", {}), job, run.get("dtype", "float32"))
            if was:
                die(f"--results_from={path}, line {number}: run {run['name']} was trained with {was}, where this "
                    f"sweep's runs get {now}: give the sweep the study's settings, or leave out --results_from")
            imported.append(run)
        if cells and (None in cells) != (cell is None):
            die(f"--results_from={path} is {'a phi study' if cell is None else 'a budget study'}'s runs.jsonl "
                f"(its lines {'name' if cell is None else 'do not name'} a cell): {study_file}")
        return imported

    def take(self, imported):
        """Runs that results_in returned, as done here: each one's result.json, where its folder has none (a run of
        this out_dir's own is kept) -> how many were taken."""
        taken = 0
        for run in imported:
            result_path = os.path.join(self.out_dir, "runs", run["name"], "result.json")
            if not os.path.isfile(result_path):
                os.makedirs(os.path.dirname(result_path), exist_ok=True)
                write_json(result_path, run)
                taken += 1
        return taken

    def train(self, scheme, n_loop, exponent, lr, seed, steps=None):
        """One train.py run (of steps steps, default max_iters) -> its result dict (also saved as result.json in the
        run's folder), or None once the sweep stops: a run under way then stops with its checkpoint, and one not
        started does not start."""
        job = (scheme, n_loop, exponent, lr, seed, steps)
        if self.stopping:
            return None
        if (result := self.done(*job)) is not None:
            return result
        name = run_name(*job)
        run_dir = os.path.join(self.out_dir, "runs", name)
        command, args = self.args(*job)
        steps = args["max_iters"]
        if args.get("init_from") == "resume":  # train.py compares only the model's settings with its checkpoint
            started = self.last_start(run_dir)
            was, now = self.changed(started, job) if started else ("", "")
            if was:
                self.fail(f"{run_dir} holds a run stopped part-way with {was}, where this sweep's runs get {now}: give "
                          f"the sweep the settings of the runs in {self.out_dir}, or choose another --out_dir")
        cmd = command + [f"--{k}={v}" for k, v in args.items()]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        t0 = time.time()
        returncode, stderr = self.run(cmd, env)
        if returncode and "diverged" not in stderr:
            # stopped on request, with its checkpoint; or, once the sweep stops, by the signal it passed on, which
            # may have come before train.py could take it (then the run stops at once, with nothing to save)
            if returncode == STOPPED or self.stopping:
                if not self.stopping:  # the run alone got a signal: the sweep stops too, all of it to resume
                    self.on_signal(signal.SIGTERM, None)
                return None
            self.fail(f"run {name} failed (exit {returncode}): {stderr.strip().splitlines()[-1:]}; command: "
                      f"{' '.join(cmd)}")
        records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        evals = [r for r in records if r["type"] == "eval"]
        final = evals[-1] if returncode == 0 else None  # a diverged run (non-finite loss) has no final eval
        kappa = final["loop"]["kappa"] if final else None
        start = [r for r in records if r["type"] == "start"]
        result = dict(name=name, scheme=scheme, n_loop=n_loop, exponent=exponent, lr=lr, seed=seed, dtype=self.dtype,
                      steps=steps, seconds=time.time() - t0, val_loss=final["val_loss"] if final else None,
                      # every machine a run trained on (a resumed run may have moved), and the code it ran
                      machines=list({json.dumps(r.get("machine")): r.get("machine") for r in start}.values()),
                      commit=self.commit, settings=self.settings(*job),
                      val_curve=[(r["iter"], r["val_loss"]) for r in evals],
                      kappa=sum(kappa) / len(kappa) if kappa else None,  # mean over the physical blocks
                      curve=[(r["iter"], r["loss"]) for r in records if r["type"] == "train"])
        if self.on_chains:
            result.update(self.depth_result(run_dir, records, final))
        write_json(os.path.join(run_dir, "result.json"), result)
        status = "diverged" if final is None else f"val {result['val_loss']:.4f} kappa {result['kappa']:.2f}"
        if self.on_chains and final:
            status = f"accuracy {mean_over_k(result['accuracy']):.3f} kappa {result['kappa']:.2f}"
        print(f"{name:40s} {status:>24s}  ({result['seconds']:.0f} s)", flush=True)
        return result

    # -------------------------------------------------------------------------------------------------------------
    # stopping

    @property
    def stopping(self):
        return bool(self.stop.signum or self.stop.failed)

    def run(self, cmd, env):
        """cmd in a subprocess -> (its exit code, its stderr), the signals that stop the sweep passed on to it."""
        with self.stop.lock:
            if self.stopping:
                return -self.stop.signum or -signal.SIGTERM, ""
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            self.stop.procs.add(proc)
        if self.stopping:  # a signal that came while it started, which on_signal may not have passed on
            proc.send_signal(self.stop.signum or signal.SIGTERM)
        try:
            _, stderr = proc.communicate()
        finally:
            with self.stop.lock:
                self.stop.procs.discard(proc)
        return proc.returncode, stderr

    def pass_on(self, signum):
        for proc in list(self.stop.procs):
            proc.send_signal(signum)  # nothing, once the process has ended

    def catch_signals(self):
        """From here to end_if_stopped SIGTERM and SIGINT stop the sweep as the module's docstring says (in the main
        thread)."""
        self.stop.handlers = {signum: signal.signal(signum, self.on_signal)
                              for signum in (signal.SIGTERM, signal.SIGINT)}

    def on_signal(self, signum, frame):
        if self.stop.signum and time.monotonic() - self.stop.signal_time >= 1:  # a second: everything ends at once
            self.pass_on(signum)
            os.write(2, f"\nstopped by {signal.Signals(signum).name} without waiting for the runs (a second "
                        f"signal)\n".encode())
            os._exit(128 + signum)
        if not self.stop.signum:  # a repeat within a second (Ctrl-C reaches every process of a terminal) is the same
            self.stop.signum, self.stop.signal_time = signum, time.monotonic()
            self.pass_on(signum)

    def fail(self, message):
        """Stop the sweep with message, one line however many runs fail at once; the runs under way stop with their
        checkpoints (SIGTERM), so that the next start resumes them."""
        with self.stop.lock:
            first, self.stop.failed = not self.stop.failed, True
        self.pass_on(signal.SIGTERM)
        if first:
            die(message)
        sys.exit(2)

    def end_if_stopped(self, program="lab.sweep"):
        """Once the runs under way have stopped: the line that says how to resume (python -m program, with this
        command's arguments), and exit code 75. Else the signals stop the sweep at once again: what is left (the
        tables) has nothing to save."""
        for signum, handler in self.stop.handlers.items():
            signal.signal(signum, handler)
        if self.stop.signum:
            print(f"stopped; resume with: python -m {program} {shlex.join(sys.argv[1:])}", flush=True)
            sys.exit(STOPPED)

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

    def last_start(self, run_dir):
        """The config of the last start record in a run's metrics.jsonl (train.py's settings as it ran them, its dtype
        resolved), or None where it has none."""
        path = os.path.join(run_dir, "metrics.jsonl")
        starts = [r for r in read_metrics(path) if r["type"] == "start"] if os.path.isfile(path) else []
        return starts[-1]["config"] if starts else None

    def runs_dtypes(self):
        """The precisions of the runs in out_dir/runs that this sweep keeps: the finished ones (result.json; float32
        before sweeps recorded it) and those stopped part-way, which resume from their checkpoint (ckpt.pt; the
        precision of their last start record)."""
        runs_dir, dtypes = os.path.join(self.out_dir, "runs"), set()
        for name in os.listdir(runs_dir) if os.path.isdir(runs_dir) else []:
            run_dir = os.path.join(runs_dir, name)
            if os.path.isfile(os.path.join(run_dir, "result.json")):
                dtypes.add(self.read(os.path.join(run_dir, "result.json")).get("dtype", "float32"))
            elif os.path.isfile(os.path.join(run_dir, "ckpt.pt")) and (config := self.last_start(run_dir)):
                dtypes.add(config.get("dtype", "float32"))
        return dtypes

    def sweep_dtype(self, dtype, job=None):
        """(the precision of every run, why), kept as self.dtype. Runs that each measured could pick differently on a
        noisy machine, so the sweep decides once: the precision of the runs it has, finished or stopped part-way
        (float32 before sweeps recorded it), else dtype as set, else measured here by training steps of job's model
        (runtime.choose_dtype) on one thread, as the runs train."""
        if len(done := self.runs_dtypes()) > 1 or done and dtype not in ("auto", *done):
            die(f"{self.out_dir} holds runs in {', '.join(sorted(done))}; a sweep keeps one precision: leave --dtype "
                f"at auto or choose another --out_dir")
        if done:
            self.dtype = done.pop()
            return self.dtype, f"the precision of the runs in {self.out_dir}"
        try:
            model, batch_shape = self.model(job) if dtype == "auto" else (None, None)
            self.dtype, reason = choose_dtype("cpu", dtype, model, batch_shape)
        except ValueError as e:
            die(str(e))
        return self.dtype, reason

    def model(self, job):
        """(a model.GPT as job's run builds it, its batch shape): for the measurement of its precision, on one thread
        from here on (the runs' own setting: OMP_NUM_THREADS=1)."""
        import torch
        from dataset import EVAL_SEED, load_meta
        from lab.tasks import make_task
        from model import GPT, GPTConfig
        torch.set_num_threads(1)
        settings = self.settings(*job)
        vocab_size = make_task(settings, "val", EVAL_SEED).vocab_size if self.on_chains else \
            load_meta(os.path.join("data", self.dataset))["vocab_size"]
        config = GPTConfig(**{k: v for k, v in settings.items() if k in GPTConfig.__dataclass_fields__},
                           vocab_size=-(-vocab_size // 64) * 64)  # padded to a multiple of 64, as train.py pads it
        return GPT(config), (settings["batch_size"], settings["block_size"])
