"""
What keeps a long training run safe: train.py's machinery for stopping, saving and failing well, apart from the
training itself. Its guarantees (docs/preemption.md says how to use them on a cluster):

- Stop on request. SIGTERM (what a cluster's scheduler sends before it kills a job) and SIGINT (Ctrl-C) let the step
  under way finish; then ckpt.pt holds that step, the master prints the command that resumes the run, and every
  process exits with STOPPED (75). A second signal, a second or more later, ends the process at once with the shell's
  code for it (128 + its number), and ckpt.pt stays the previous one, whole. Before training starts, a signal stops
  at once.
- One run per out_dir: a run holds out_dir/train.lock (an flock) while it lives, and a second one stops at once. The
  OS drops the lock however its holder dies, so a dead run blocks nothing. A run from scratch never overwrites an
  earlier run's files, its evaluations included (start_over moves them aside), and a start that cannot work makes no
  out_dir and no lock.
- ckpt.pt is only ever replaced whole: written under another name, synced to disk, then renamed over the old one. A
  process killed at any moment leaves the previous checkpoint or the new one; a failed write (a full disk) removes the
  temporary file and keeps the previous checkpoint.
- metrics.jsonl never holds half a record: a failed write is cut off again (and the run stops at its next step), and
  a record cut short by a killed run is removed when the run resumes; so are the records that a run killed after its
  last checkpoint wrote of the steps that the resumed run trains again, which holds each step's records once.
- The NaN guard: a non-finite train loss or gradient norm stops the run before it is saved, so ckpt.pt keeps the last
  good state.
- A resume continues the run it names or stops (resume_mismatch): other tokens, another model, other lab settings.
- DDP: every decision to stop or to save is taken by all processes at the same step (Processes.agree), and a failure
  on the master stops every process instead of leaving the others waiting in a collective until its timeout.
A run that its input or its machine keeps from going on ends with one line on stderr and exit code 2
(configurator.die).
"""

import atexit
import fcntl
import glob
import json
import math
import os
import shlex
import signal
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

from configurator import die

STOPPED = 75  # exit code of a run stopped by a signal after writing its checkpoint (sysexits' EX_TEMPFAIL: try later)


class Processes:
    """This process among the DDP processes that torchrun started, from the RANK and WORLD_SIZE it gives each of them;
    without those, the one process of the run (rank 0 of 1, no collectives)."""

    def __init__(self):
        self.ddp = "RANK" in os.environ
        self.rank, self.world_size = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if self.ddp else (0, 1)
        self.master = self.rank == 0  # the one process that prints, logs and writes files
        self.cpu_group = None  # the process group of agree(); on CPU the default one

    def start(self, device):
        """Join the process group -> the device this process runs on (under DDP on CUDA: its own GPU)."""
        if not self.ddp:
            return device
        if device.startswith("cuda"):
            # launchers other than torchrun may set RANK only; ranks are numbered node by node, a GPU each
            device = f"cuda:{os.environ.get('LOCAL_RANK', self.rank % torch.cuda.device_count())}"
            torch.cuda.set_device(device)
            dist.init_process_group(backend="nccl", device_id=torch.device(device))
            self.cpu_group = dist.new_group(backend="gloo")
        else:
            dist.init_process_group(backend="gloo")
        # Every way out after this (an agreed stop, die(), an error, the end) tears the process group down while Python
        # is still whole (atexit runs first at exit). Left to the interpreter's teardown, gloo's worker threads can drop
        # the last collective's tensors after Python is gone, and the process aborts (SIGABRT) instead of exiting with
        # its code; destroy_process_group joins those threads first.
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
        return device

    def agree(self, *flags):
        """The largest value of each flag over all processes: a collective, which every process calls at the same
        point, so that all of them take the same decision. On CUDA it runs over CPU tensors (a gloo group), so agreeing
        never waits for the GPU's queued work."""
        flags = torch.tensor(flags, dtype=torch.int64)
        if self.ddp:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return flags.tolist()

    def all_reduce(self, tensor):
        """tensor summed over all processes, in place (a collective) -> tensor."""
        if self.ddp:
            dist.all_reduce(tensor)
        return tensor

    def gather(self, obj):
        """obj of every process, in rank order (a collective: all processes call it)."""
        if not self.ddp:
            return [obj]
        objs = [None] * self.world_size
        dist.all_gather_object(objs, obj)
        return objs

    def on_master(self, step):
        """step() on the master only -> what it returned there (None elsewhere). If it fails every process stops with
        it: the others would otherwise wait in their next collective until its timeout (10 minutes or more). die() in
        step has printed its line already."""
        code, result = 0, None
        if self.master:
            try:
                result = step()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except Exception:
                traceback.print_exc()
                code = 1
        code, = self.agree(code)
        if code:
            sys.exit(code)
        return result


class Stop:
    """How this process stops. On request: the signal handler only takes note (signum); the training loop stops at the
    start of its next step, when every DDP process has learnt of it (Processes.agree). Before training starts there is
    nothing to save, and a signal stops at once; so does a second signal. master: whether this process is the one that
    writes ckpt.pt (its temporary file `writing`, which a second signal removes) and says why the run ended."""

    def __init__(self, master, writing):
        self.master, self.writing, self.bar = master, writing, None
        self.signum, self.time, self.training = 0, 0.0, False
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)

    def start_training(self, bar):
        """From here on a signal lets the step under way finish; bar: the progress bar, closed before the last line."""
        self.training, self.bar = True, bar

    def end(self, code, message):
        """Every process ends here, with code; the master says why: code 2 as an error (configurator.die), else on
        stdout, after the progress bar has closed so that the line is one of its own."""
        if self.bar is not None:
            self.bar.close()
        if self.master:
            if code == 2:
                die(message)
            print(message, flush=True)
        sys.exit(code)

    def on_signal(self, signum, frame):
        # torchrun passes each signal it gets on to its processes, which may have had it already (Ctrl-C reaches every
        # process of the terminal): a repeat within a second is the same request
        if self.training and (not self.signum or time.monotonic() - self.time < 1):
            self.signum, self.time = self.signum or signum, self.time or time.monotonic()
            return
        if self.training and self.master and os.path.exists(self.writing):
            os.remove(self.writing)  # a checkpoint being written: ckpt.pt is still the previous one, whole
        when = "before training started" if not self.training else "without saving (a second signal)"
        os.write(2, f"\nstopped by {signal.Signals(signum).name} {when}\n".encode())
        os._exit(128 + signum)  # the shell's code for a process ended by this signal


# what a run keeps in its out_dir, beside the lock file: also lab.eval_downstream's results of its checkpoint, which
# would pass for the next run's if they stayed
RUN_FILES = ("ckpt.pt", "metrics.jsonl", "eval_*.json")


def run_files(out_dir):
    """The names of the files of RUN_FILES in out_dir."""
    return [os.path.basename(path) for pattern in RUN_FILES
            for path in sorted(glob.glob(os.path.join(glob.escape(out_dir), pattern)))]


def check_settings(config):
    """Stop with one line, before anything is written, on train.py settings that torch would refuse only later, once
    out_dir and its lock exist, or that would make a run of no meaning: counts and sizes below 1, negative step
    numbers, a negative rate, betas or dropout outside [0, 1)."""
    if small := [f"{k}={config[k]}" for k in ("eval_interval", "eval_iters", "log_interval", "gradient_accumulation_steps",
                                              "batch_size", "block_size", "n_layer", "n_head", "n_embd") if config[k] < 1]:
        die(f"{', '.join(small)}: counts and sizes must be >= 1")
    if negative := [f"{k}={config[k]}" for k in ("max_iters", "warmup_iters", "lr_decay_iters") if config[k] < 0]:
        die(f"{', '.join(negative)}: step numbers must be >= 0 (max_iters=0 evaluates the initial model only)")
    limits = dict(learning_rate=config["learning_rate"] >= 0, min_lr=config["min_lr"] >= 0,
                  weight_decay=config["weight_decay"] >= 0, beta1=0 <= config["beta1"] < 1,
                  beta2=0 <= config["beta2"] < 1, dropout=0 <= config["dropout"] < 1)
    if bad := [f"{k}={config[k]}" for k, ok in limits.items() if not ok]:
        die(f"{', '.join(bad)}: learning_rate, min_lr and weight_decay must be >= 0, beta1, beta2 and dropout from 0 to "
            f"below 1")


def lock_out_dir(out_dir, init_from="scratch", start_over=False):
    """Make out_dir and take out_dir/train.lock -> the open lock file, which holds the lock for as long as it stays
    open: a second train.py on the same out_dir stops here. The OS releases an flock when its holder dies, even by
    SIGKILL, so a dead run blocks nothing. What else makes a start fail stops here too, with one line, before anything
    is created or changed: an empty out_dir, one that is a file or cannot be written, init_from=resume without a
    checkpoint, and init_from=scratch into an out_dir that holds a run's files (RUN_FILES), which a rerun would
    overwrite, unless start_over: that moves them into out_dir/previous-N (the first N free), deleting nothing."""
    ckpt_path, lock_path = os.path.join(out_dir, "ckpt.pt"), os.path.join(out_dir, "train.lock")
    if not out_dir:
        die("--out_dir is empty: name the run's folder, e.g. --out_dir=out-smoke")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        die(f"--out_dir={out_dir} is a file, not a folder: choose another --out_dir")
    if init_from == "resume" and (start_over or not os.path.isfile(ckpt_path)):
        die("start_over applies to init_from=scratch only: drop one of them" if start_over else
            f"no checkpoint at {ckpt_path} to resume: leave out --init_from=resume to start a run there, or point "
            f"--out_dir at the run's folder")
    earlier = run_files(out_dir) if init_from == "scratch" else []
    overwrite = (f"{out_dir} holds an earlier run ({', '.join(earlier)}), which a run from scratch would overwrite: "
                 f"continue it with --init_from=resume, choose another --out_dir, or set --start_over=True to move its "
                 f"files aside (into {out_dir}/previous-N) and start afresh") if earlier and not start_over else None
    if overwrite and not os.path.exists(lock_path):  # no lock file: no run holds out_dir, and none is made here
        die(overwrite)
    try:
        os.makedirs(out_dir, exist_ok=True)
        lock_file = open(lock_path, "a+")
    except OSError as e:
        die(f"cannot write in {out_dir} ({e.strerror}): choose an --out_dir that this process may create and write")
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.seek(0)
        holder = lock_file.read().strip() or "a process that has not written its pid yet"
        lock_file.close()
        die(f"{out_dir} is in use by another train.py ({holder}); wait for it to end, stop it with kill -TERM, or "
            f"choose another --out_dir")
    except OSError as e:  # e.g. Lustre mounted without -o flock
        print(f"note: cannot lock {lock_path} ({e.strerror}): nothing keeps a second run out of {out_dir}")
    if overwrite:
        lock_file.close()
        die(overwrite)
    tmp_path = ckpt_path + ".tmp"
    try:
        open(tmp_path, "wb").close()  # where every checkpoint is written first: the folder must take new files
        os.remove(tmp_path)  # also a checkpoint cut short by a killed run
        if earlier:
            n = 1
            while os.path.exists(os.path.join(out_dir, f"previous-{n}")):
                n += 1
            aside = os.path.join(out_dir, f"previous-{n}")
            os.mkdir(aside)
            for name in earlier:
                os.rename(os.path.join(out_dir, name), os.path.join(aside, name))
            print(f"start_over: moved {out_dir}'s {', '.join(earlier[:-1])}{' and ' * (len(earlier) > 1)}"
                  f"{earlier[-1]} into {aside}")
    except OSError as e:
        die(f"cannot write in {out_dir} ({e.strerror}): choose an --out_dir that this process may create and write")
    lock_file.truncate(0)
    lock_file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    lock_file.flush()
    return lock_file


def resume_mismatch(ckpt_path, checkpoint, model, model_args, meta, dataset, task, lab):
    """What stops train.py from resuming the checkpoint with these settings (a line), or None: other tokens, a run the
    lab changed resumed without the lab, another model or other settings of the lab's."""
    if checkpoint["tokenizer"] != meta["tokenizer"]:
        return (f"{ckpt_path} was trained on {checkpoint['tokenizer']} but these settings make {meta['tokenizer']}; "
                f"resume with the run's chain settings" if task else f"{ckpt_path} was trained on "
                f"{checkpoint['tokenizer']} tokens but data/{dataset} holds {meta['tokenizer']} tokens; resume with the "
                f"dataset it was trained on")
    # a run the lab changed resumes under the lab only (a checkpoint from before the seam: train.py's loop settings)
    lab_changes = checkpoint.get("lab", {k: v for k, v in checkpoint["config"].items()
                                         if k in ("loop_sampling", "backprop_loops") and v not in ("fixed", 0)})
    if lab_changes and not lab:
        return (f"{ckpt_path} was trained with the lab's {', '.join(f'{k}={v!r}' for k, v in lab_changes.items())}; "
                f"resume it with python -m lab.train and the run's settings")
    # the model's settings against the loaded model's config, the lab's against the run's config (a checkpoint older
    # than a setting means its default)
    saved = {**(lab.defaults if lab else {}), **checkpoint["config"], **vars(model.config)}
    changed = [f"{k}={v!r} (checkpoint: {saved[k]!r})" for k, v in {**model_args, **(lab.settings if lab else {})}.items()
               if saved[k] != v]
    if changed:
        return f"resuming {ckpt_path} with another model: {', '.join(changed)}; use the run's config unchanged"
    return None


def batches_changed(checkpoint, settings):
    """A note where a resume reads other batches than the run it resumes would have (a line), or None: the batches are
    a function of these settings and the step, so another value reads other text from here on, by choice or not."""
    changed = [f"{k}={settings[k]!r} (the run's: {checkpoint['config'][k]!r})"
               for k in ("dataset", "seed", "batch_size", "gradient_accumulation_steps")
               if checkpoint["config"].get(k, settings[k]) != settings[k]]
    return f"note: resuming with {', '.join(changed)}: the batches from here on are not an uninterrupted run's" \
        if changed else None


def load_checkpoint(path, device="cpu"):
    """A checkpoint of train.py -> (model.GPT on device, the checkpoint dict), read onto the CPU (its optimizer state
    takes no device memory), weights_only (never running code from the file). Raises saying what to do."""
    from model import GPT, GPTConfig
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}; train one with `python train.py config/smoke_cpu.py` "
                                f"or set --out_dir")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"  # torch.save's format: a zip archive
        if zipped:
            raise ValueError(f"{path} is damaged: a checkpoint that does not load whole ({type(e).__name__}), "
                             f"cut short or corrupted after it was written, e.g. by an interrupted copy; copy it "
                             f"again from where it came from") from e
        raise ValueError(f"{path} is not a readable checkpoint ({type(e).__name__}); point --out_dir at a "
                         f"train.py run") from e
    if not isinstance(ckpt, dict) or ckpt.get("program") != "deeploop-train":
        raise ValueError(f"{path} was not written by this project's train.py; point --out_dir at a train.py run")
    try:
        model = GPT(GPTConfig(**ckpt["model_args"]))
    except (KeyError, TypeError, ValueError) as e:
        problem = "it has no model_args" if isinstance(e, KeyError) else f"its model_args make no model ({e})"
    else:
        weights = ckpt.get("model")
        made, saved = ({k: tuple(v.shape) for k, v in state.items()} if isinstance(state, dict) else {}
                       for state in (model.state_dict(), weights))
        differ = sorted(k for k in made.keys() | saved.keys() if made.get(k) != saved.get(k))
        problem = differ and (f"{len(differ)} of its weights do not fit the model its model_args make, e.g. "
                              f"{differ[0]}: {saved.get(differ[0], 'none')} in the file, "
                              f"{made.get(differ[0], 'none')} in the model")
    if problem:
        raise ValueError(f"{path} is marked as a checkpoint of this project's train.py, but {problem}: it was changed "
                         f"after train.py wrote it; copy it again from its run, or point --out_dir at another "
                         f"train.py run")
    model.load_state_dict(weights)
    return model.to(device), ckpt


class CheckpointFile:
    """ckpt.pt, only ever replaced whole, and the step it holds (step None: this run has written none yet); time:
    when it was last written."""

    def __init__(self, path, step=None):
        self.path, self.step, self.time = path, step, time.monotonic()

    def save(self, processes, step, checkpoint):
        """checkpoint() written by the master (a collective: all processes call it). Atomically: to a temporary file,
        synced to disk, then renamed over the old one. A failed write (a full disk) removes the temporary file, keeps
        the previous checkpoint, and stops every process with one line."""
        processes.on_master(lambda: self._write(checkpoint(), step))
        self.step, self.time = step, time.monotonic()

    def _write(self, checkpoint, step):
        tmp_path = self.path + ".tmp"
        try:
            with open(tmp_path, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_path, self.path)
        except (OSError, RuntimeError) as e:
            # torch.save reports a failed write as a RuntimeError, with the OSError as its __context__
            error = e if isinstance(e, OSError) else e.__context__
            if not isinstance(error, OSError):
                raise
            if os.path.exists(tmp_path):
                os.remove(tmp_path)
            die(self.write_failed(self.path, error, step))

    def due(self, minutes):
        """Whether more than minutes have passed since the last write (never when minutes is 0)."""
        return minutes > 0 and time.monotonic() - self.time > minutes * 60

    def kept(self):
        return f"{self.path} keeps step {self.step}" if self.step is not None else "this run wrote no checkpoint yet"

    def write_failed(self, path, error, step):
        """The line for a failed write of path (this checkpoint or another file of the run) at step: what to do
        depends on whether there is a checkpoint of this run to resume."""
        again = "resume with --init_from=resume" if self.step is not None else \
            "run again with --start_over=True (a run from scratch there moves this one's files aside)"
        return f"writing {path} failed at step {step}: {error.strerror or error}; {self.kept()}; make room (or fix " \
               f"the folder) and {again}"

    def stopped(self, signum, argv, ddp):
        """The line for a run stopped by signum once this file holds its step: the command line argv again, resuming,
        quoted for a shell (argv[0] "-m lab.train": the module's command, as lab/train.py sets it). How the run
        started (--init_from, --start_over, which a resume refuses) gives way to --init_from=resume."""
        program = argv[0].split(" ", 1) if argv[0].startswith("-m ") else [argv[0]]
        command = shlex.join(["python", *program, *(a for a in argv[1:] if not a.startswith(("--init_from=",
                                                                                              "--start_over="))),
                              "--init_from=resume"])
        launcher = " (launched as this run was)" if ddp else ""
        return f"stopped by {signal.Signals(signum).name}: {self.path} holds step {self.step}; resume with: " \
               f"{command}{launcher}"


class MetricsLog:
    """metrics.jsonl: one JSON record a line, never half a one. Written by the master only, which opens it; error:
    the write that failed (elsewhere None)."""

    def __init__(self, path):
        self.path, self.file, self.error = path, None, None

    def open(self, resumed_at=None):
        """A run resumed from the checkpoint of step resumed_at appends, once the records that it writes again are
        gone: those of a run killed after that checkpoint (train records from that step on, any record of a later
        step) and a record cut short by a kill in the middle of its write. A new run starts the file afresh."""
        if resumed_at is not None and os.path.isfile(self.path):
            self._cut_back(resumed_at)
        # unbuffered: each record is one write, and a failed one is cut off again (write)
        self.file = open(self.path, "wb" if resumed_at is None else "ab", buffering=0)

    def _cut_back(self, step):
        """The file without the records after the checkpoint of step, replaced whole (as ckpt.pt is) where any go."""
        with open(self.path, "rb") as f:
            data = f.read()
        lines = data[:data.rfind(b"\n") + 1].splitlines(keepends=True)
        kept = [line for line in lines if not self._redone(line, step)]
        if sum(map(len, kept)) == len(data):
            return
        if len(kept) < len(lines):
            print(f"note: {self.path} held {len(lines) - len(kept)} record(s) from after step {step}'s checkpoint "
                  f"(a run killed later than it), which this run writes again; removed them")
        if not data.endswith(b"\n"):
            print(f"note: {self.path} ended in a record cut short; removed it")
        tmp_path = self.path + ".tmp"
        try:
            with open(tmp_path, "wb") as f:
                f.write(b"".join(kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_path, self.path)
        except OSError as e:
            if os.path.exists(tmp_path):
                os.remove(tmp_path)
            die(f"writing {self.path} failed: {e.strerror or e}; it is unchanged; make room (or fix the folder) and "
                f"resume again")

    @staticmethod
    def _redone(line, step):
        """Whether line is a record that a run resumed from the checkpoint of step writes again: a train record
        follows its step's training, an evaluation and a start record the step's checkpoint. Lines of any other form
        stay."""
        try:
            record = json.loads(line)
            return record["iter"] > step or record["iter"] == step and record["type"] == "train"
        except (ValueError, KeyError, TypeError):
            return False

    def write(self, record):
        """Append record as one JSON line -> whether it was written. A failed write (a full disk) is cut off again,
        so that the file never holds half a record; error keeps it, and no record is written after it (train.py stops
        every process at its next step)."""
        if self.error:
            return False
        line, end = (json.dumps(record) + "\n").encode(), self.file.tell()
        try:
            written = 0
            while written < len(line):
                written += self.file.write(line[written:])
        except OSError as e:
            self.file.truncate(end)
            self.file.seek(end)
            self.error = e
            return False
        return True

    def close(self):
        self.file.close()


class PendingLosses:
    """The train losses not read yet, and the NaN guard over them, the gradient norms they came with and the
    evaluations' losses: a non-finite one ends the run before anything is saved, so that ckpt (a CheckpointFile) keeps
    the last good state. A finite loss can come with a non-finite gradient, whose step spoils the weights before any
    loss shows it. The loss of each step stays on the device until a log line, the NaN guard or a checkpoint needs it:
    reading it every step would make the host wait for the device every step. micro_batches: a step's micro-batches
    over all processes."""

    def __init__(self, processes, micro_batches, ckpt, stop):
        self.processes, self.micro_batches, self.ckpt, self.stop = processes, micro_batches, ckpt, stop
        self.steps = []  # (step, sum of the step's micro-batch losses on this process, gradient norm or None)

    def __len__(self):
        return len(self.steps)

    def add(self, step, loss_sum, grad_norm=None):
        """grad_norm: the step's gradient norm before clipping; None where a non-finite one is no harm (float16's
        GradScaler skips such a step)."""
        self.steps.append((step, loss_sum, grad_norm))

    def read(self):
        """{step: mean loss} of the steps since the last read, over all processes, with one host-device sync for all of
        them. The NaN guard: stops the run at the first non-finite loss or gradient norm (a collective: all processes
        call it)."""
        if not self.steps:
            return {}
        zero = torch.zeros_like(self.steps[0][1])
        sums = self.processes.all_reduce(torch.stack([torch.stack((loss_sum, zero if norm is None else norm.float()))
                                                      for _, loss_sum, norm in self.steps]))
        losses = {}
        for (step, _, _), (loss_sum, norm) in zip(self.steps, sums.tolist()):
            losses[step] = loss_sum / self.micro_batches
            self.check(step, {"train loss": losses[step], "gradient norm": norm})
        self.steps.clear()
        return losses

    def check(self, step, losses):
        """Stop every process at the first non-finite one of losses ({what: value} at step; all processes call it with
        the same values)."""
        for what, value in losses.items():
            if not math.isfinite(value):
                self.stop.end(2, f"{what} is {value} at step {step}: training diverged; {self.ckpt.kept()} (the last "
                                 f"good state); lower learning_rate or raise warmup_iters")
