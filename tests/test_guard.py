"""guard.py's pieces on their own, in one process (tests/test_train.py runs them end to end, signals and DDP too)."""

import errno
import json
import math
import os
import shlex
import signal
import subprocess

import pytest
import torch

import guard


class FullDisk:
    """A file whose writes fail with ENOSPC once n bytes are written, after writing what fits (as a full disk does)."""

    def __init__(self, f, n):
        self.f, self.room = f, n

    def write(self, data):
        if len(data) > self.room:
            self.f.write(data[:self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_metrics_log_cuts_a_failed_record_off_and_writes_none_after_it(tmp_path):
    metrics = guard.MetricsLog(str(tmp_path / "metrics.jsonl"))
    metrics.open()
    assert metrics.write(dict(type="train", iter=0))
    metrics.file = FullDisk(metrics.file, 10)
    assert not metrics.write(dict(type="train", iter=1, loss=2.5))
    assert metrics.error.errno == errno.ENOSPC
    metrics.file = metrics.file.f
    assert not metrics.write(dict(type="train", iter=2))  # the run stops at its next step; nothing more meanwhile
    metrics.close()
    assert (tmp_path / "metrics.jsonl").read_text() == json.dumps(dict(type="train", iter=0)) + "\n"


def test_metrics_log_removes_a_record_cut_short_when_it_appends(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"type": "start", "iter": 0}\n{"type": "train", "it')
    metrics = guard.MetricsLog(str(path))
    metrics.open(resumed_at=1)
    metrics.write(dict(type="start", iter=1))
    metrics.close()
    assert path.read_text() == '{"type": "start", "iter": 0}\n{"type": "start", "iter": 1}\n'
    assert capsys.readouterr().out == f"note: {path} ended in a record cut short; removed it\n"
    guard.MetricsLog(str(path)).open()  # a run from scratch starts the file afresh
    assert path.read_text() == ""


def test_a_resumed_run_cuts_the_log_back_to_its_checkpoints_step(tmp_path, capsys, monkeypatch):
    """A run killed (SIGKILL) after its checkpoint of step 4 logged steps 4 and 5 and an evaluation of step 6 whose
    checkpoint write it did not finish: the run resumed from step 4 logs them again, so they go, in a file replaced
    whole; the evaluation of step 4 (its checkpoint's) and the start records stay."""
    path = tmp_path / "metrics.jsonl"
    kept = [dict(type="start", iter=0), dict(type="eval", iter=0), *(dict(type="train", iter=i) for i in range(4)),
            dict(type="start", iter=2), dict(type="eval", iter=4)]
    gone = [dict(type="train", iter=4), dict(type="train", iter=5), dict(type="eval", iter=6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept + gone) + '{"type": "train", "it')
    replaced = []
    monkeypatch.setattr(guard.os, "replace", lambda src, dst: replaced.append(dst) or os.rename(src, dst))
    metrics = guard.MetricsLog(str(path))
    metrics.open(resumed_at=4)
    metrics.write(dict(type="start", iter=4))
    metrics.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == kept + [dict(type="start", iter=4)]
    assert replaced == [str(path)] and os.listdir(tmp_path) == ["metrics.jsonl"]
    assert capsys.readouterr().out == (
        f"note: {path} held 3 record(s) from after step 4's checkpoint (a run killed later than it), which this run "
        f"writes again; removed them\nnote: {path} ended in a record cut short; removed it\n")
    before = path.read_bytes()
    guard.MetricsLog(str(path)).open(resumed_at=4)  # nothing after the checkpoint: the file as it was, not rewritten
    assert path.read_bytes() == before and replaced == [str(path)] and capsys.readouterr().out == ""


def test_a_failed_checkpoint_write_keeps_the_previous_one_and_names_it(tmp_path, capsys, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    ckpt = guard.CheckpointFile(path)
    ckpt.save(guard.Processes(), 3, lambda: dict(step=3))
    assert (ckpt.step, torch.load(path)) == (3, dict(step=3)) and not os.path.exists(path + ".tmp")
    monkeypatch.setattr(guard, "open", lambda file, *a, **k: FullDisk(open(file, *a, **k), 100), raising=False)
    with pytest.raises(SystemExit) as e:
        ckpt.save(guard.Processes(), 5, lambda: dict(step=5, weights=torch.zeros(1000)))
    monkeypatch.undo()
    assert e.value.code == 2 and ckpt.step == 3
    assert capsys.readouterr().err == (f"error: writing {path} failed at step 5: No space left on device; {path} keeps "
                                       f"step 3; make room (or fix the folder) and resume with --init_from=resume\n")
    assert torch.load(path) == dict(step=3) and not os.path.exists(path + ".tmp")


def test_the_line_of_a_stopped_run_names_the_command_that_resumes_it(tmp_path):
    ckpt = guard.CheckpointFile("out/ckpt.pt", step=7)
    assert ckpt.stopped(15, ["train.py", "config/x.py", "--init_from=scratch", "--out_dir=my out"], ddp=False) == \
        "stopped by SIGTERM: out/ckpt.pt holds step 7; resume with: python train.py config/x.py '--out_dir=my out' " \
        "--init_from=resume"
    # a run started over (a sweep's runs are) resumes without it: a resume refuses --start_over=True
    assert ckpt.stopped(15, ["-m lab.train", "--out_dir=o", "--start_over=True"], ddp=False).endswith(
        "resume with: python -m lab.train --out_dir=o --init_from=resume")
    # a shell splits the command into the run's own arguments, quoted ones with two spaces or quotes in them too
    for argv in (["train.py"], ["-m lab.train", "config/x.py", "--out_dir=/tmp/a  b", "--start=it's  \"so\""],
                 ["/abs path/train.py", "--out_dir=  lead", "--init_from=scratch", "--n_loop=2"]):
        line = ckpt.stopped(2, argv, ddp=True)
        command = line.removeprefix("stopped by SIGINT: out/ckpt.pt holds step 7; resume with: ")
        assert command.endswith(" (launched as this run was)")
        program = argv[0].split(" ") if argv[0].startswith("-m ") else argv[:1]
        assert shlex.split(command.removesuffix(" (launched as this run was)")) == \
            ["python", *program, *(a for a in argv[1:] if a != "--init_from=scratch"), "--init_from=resume"]
    assert guard.CheckpointFile("out/ckpt.pt").kept() == "this run wrote no checkpoint yet"


class Bar:
    closed = False

    def close(self):
        self.closed = True


@pytest.fixture
def stop():
    """A guard.Stop in training, its signal handlers the test process's for the test only."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = guard.Stop(master=True, writing=None)
    stop.start_training(Bar())
    yield stop
    for s, handler in handlers.items():
        signal.signal(s, handler)


def test_the_nan_guard_stops_at_the_first_non_finite_loss_naming_the_last_good_checkpoint(stop, capsys):
    pending = guard.PendingLosses(guard.Processes(), 2, guard.CheckpointFile("out/ckpt.pt", step=4), stop)
    pending.add(4, torch.tensor(3.0))
    pending.add(5, torch.tensor(2.0))
    assert pending.read() == {4: 1.5, 5: 1.0} and len(pending) == 0
    pending.add(6, torch.tensor(1.0))
    pending.add(7, torch.tensor(math.nan))
    with pytest.raises(SystemExit) as e:
        pending.read()
    assert e.value.code == 2 and stop.bar.closed
    assert capsys.readouterr().err == ("error: train loss is nan at step 7: training diverged; out/ckpt.pt keeps step 4 "
                                       "(the last good state); lower learning_rate or raise warmup_iters\n")
    pending.check(8, {"train loss": 1.0, "val loss": 2.0})  # finite: nothing happens


def test_the_nan_guard_stops_at_a_non_finite_gradient_norm_whose_loss_was_finite(stop, capsys):
    pending = guard.PendingLosses(guard.Processes(), 1, guard.CheckpointFile("out/ckpt.pt", step=4), stop)
    pending.add(4, torch.tensor(3.0), torch.tensor(0.5))
    pending.add(5, torch.tensor(2.0), None)  # float16: GradScaler skips such a step, no harm
    pending.add(6, torch.tensor(2.0), torch.tensor(math.inf))
    pending.add(7, torch.tensor(math.nan), torch.tensor(math.nan))
    with pytest.raises(SystemExit) as e:
        pending.read()
    assert e.value.code == 2
    assert capsys.readouterr().err == ("error: gradient norm is inf at step 6: training diverged; out/ckpt.pt keeps "
                                       "step 4 (the last good state); lower learning_rate or raise warmup_iters\n")
    pending = guard.PendingLosses(guard.Processes(), 1, guard.CheckpointFile("out/ckpt.pt", step=4), stop)
    pending.add(5, torch.tensor(2.0), None)
    pending.add(6, torch.tensor(1.0), torch.tensor(7.0))
    assert pending.read() == {5: 2.0, 6: 1.0}


def test_one_process_agrees_with_itself_and_a_failure_on_the_master_exits_with_its_code(capsys):
    procs = guard.Processes()
    assert (procs.ddp, procs.rank, procs.world_size, procs.master) == (False, 0, 1, True)
    assert procs.agree(0, 3, 1) == [0, 3, 1] and procs.gather("x") == ["x"]
    assert procs.on_master(lambda: 42) == 42
    with pytest.raises(SystemExit) as e:
        procs.on_master(lambda: 1 / 0)
    assert e.value.code == 1 and "ZeroDivisionError" in capsys.readouterr().err


def test_the_lock_refuses_a_second_holder_and_names_the_first(tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    first = guard.lock_out_dir(out_dir)
    try:
        with pytest.raises(SystemExit) as e:
            guard.lock_out_dir(out_dir)  # another open file description: flock refuses it as it would another process
        assert e.value.code == 2
        assert capsys.readouterr().err.startswith(f"error: {out_dir} is in use by another train.py (pid {os.getpid()} ")
    finally:
        first.close()
    guard.lock_out_dir(out_dir).close()  # released with the file


def one_line_exit(capsys, call, *args):
    """call(*args) stops the script -> its one line on stderr (after "error: "), exit code 2 checked."""
    with pytest.raises(SystemExit) as e:
        call(*args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err[len("error: "):-1]


def test_an_out_dir_that_is_empty_a_file_or_under_a_file_is_one_line_and_nothing_is_made(tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    assert one_line_exit(capsys, guard.lock_out_dir, "") == \
        "--out_dir is empty: name the run's folder, e.g. --out_dir=out-smoke"
    assert one_line_exit(capsys, guard.lock_out_dir, str(tmp_path / "file")) == \
        f"--out_dir={tmp_path / 'file'} is a file, not a folder: choose another --out_dir"
    assert one_line_exit(capsys, guard.lock_out_dir, str(tmp_path / "file" / "run")) == \
        f"cannot write in {tmp_path / 'file' / 'run'} (Not a directory): choose an --out_dir that this process may " \
        f"create and write"
    assert sorted(os.listdir(tmp_path)) == ["file"] and (tmp_path / "file").read_text() == "mine"


def test_an_out_dir_that_takes_no_new_file_is_one_line_before_the_run_starts(tmp_path, capsys, monkeypatch):
    """A read-only mount, as root sees one too (chmod stops no root): creating a file fails with EROFS. Here the
    folder and its lock file exist, so only the checkpoint's temporary file finds it out (mocked: open fails for it)."""
    out_dir = tmp_path / "run"
    guard.lock_out_dir(str(out_dir)).close()
    real_open = open

    def read_only(file, mode="r", *args, **kwargs):
        if str(file).endswith("ckpt.pt.tmp") and mode[0] in "wax":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(file))
        return real_open(file, mode, *args, **kwargs)
    monkeypatch.setattr(guard, "open", read_only, raising=False)
    assert one_line_exit(capsys, guard.lock_out_dir, str(out_dir)) == \
        f"cannot write in {out_dir} (Read-only file system): choose an --out_dir that this process may create and write"


def test_an_immutable_out_dir_is_one_line(tmp_path, capsys):
    """chattr +i: no file may be made in the folder, by root either (where the filesystem and the process allow it)."""
    out_dir = tmp_path / "immutable"
    out_dir.mkdir()
    (out_dir / "train.lock").write_text("")  # a lock file of an earlier run: writable, but nothing new may be made
    if subprocess.run(["chattr", "+i", str(out_dir)], capture_output=True).returncode:
        pytest.skip("chattr +i is not allowed here")
    try:
        assert one_line_exit(capsys, guard.lock_out_dir, str(out_dir)) == \
            f"cannot write in {out_dir} (Operation not permitted): choose an --out_dir that this process may create " \
            f"and write"
        assert one_line_exit(capsys, guard.lock_out_dir, str(out_dir / "run")) == \
            f"cannot write in {out_dir / 'run'} (Operation not permitted): choose an --out_dir that this process may " \
            f"create and write"
    finally:
        subprocess.run(["chattr", "-i", str(out_dir)], check=True)


def test_a_run_from_scratch_never_overwrites_an_earlier_one_and_start_over_moves_it_aside(tmp_path, capsys):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    (out_dir / "metrics.jsonl").write_text('{"type": "start", "iter": 0}\n')
    refused = (f"{out_dir} holds an earlier run (metrics.jsonl), which a run from scratch would overwrite: continue "
               f"it with --init_from=resume, choose another --out_dir, or set --start_over=True to move its files "
               f"aside (into {out_dir}/previous-N) and start afresh")
    assert one_line_exit(capsys, guard.lock_out_dir, str(out_dir)) == refused
    assert os.listdir(out_dir) == ["metrics.jsonl"]  # not even a lock file was made
    (out_dir / "ckpt.pt").write_bytes(b"weights")
    (out_dir / "train.lock").write_text("pid 1 on elsewhere\n")
    assert one_line_exit(capsys, guard.lock_out_dir, str(out_dir)) == refused.replace("(metrics.jsonl)",
                                                                                     "(ckpt.pt, metrics.jsonl)")
    assert (out_dir / "train.lock").read_text() == "pid 1 on elsewhere\n"  # as the earlier run left it
    guard.lock_out_dir(str(out_dir), start_over=True).close()
    assert capsys.readouterr().out == f"start_over: moved {out_dir}'s ckpt.pt and metrics.jsonl into " \
                                      f"{out_dir / 'previous-1'}\n"
    assert (out_dir / "previous-1" / "ckpt.pt").read_bytes() == b"weights"
    assert (out_dir / "previous-1" / "metrics.jsonl").read_text() == '{"type": "start", "iter": 0}\n'
    (out_dir / "metrics.jsonl").write_text("second\n")
    guard.lock_out_dir(str(out_dir), start_over=True).close()  # the next free number: nothing is replaced
    assert (out_dir / "previous-2" / "metrics.jsonl").read_text() == "second\n"
    assert sorted(os.listdir(out_dir)) == ["previous-1", "previous-2", "train.lock"]
    guard.lock_out_dir(str(out_dir)).close()  # nothing of a run left in out_dir itself: a new run starts there


def test_resume_needs_a_checkpoint_and_makes_nothing_without_one(tmp_path, capsys):
    assert one_line_exit(capsys, guard.lock_out_dir, str(tmp_path / "run"), "resume") == \
        f"no checkpoint at {tmp_path / 'run' / 'ckpt.pt'} to resume: leave out --init_from=resume to start a run " \
        f"there, or point --out_dir at the run's folder"
    assert not (tmp_path / "run").exists()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt.pt").write_bytes(b"weights")
    assert one_line_exit(capsys, guard.lock_out_dir, str(tmp_path / "run"), "resume", True) == \
        "start_over applies to init_from=scratch only: drop one of them"
    guard.lock_out_dir(str(tmp_path / "run"), "resume").close()
    assert sorted(os.listdir(tmp_path / "run")) == ["ckpt.pt", "train.lock"]


def test_a_failed_first_checkpoint_write_says_to_start_over_not_to_resume():
    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert guard.CheckpointFile("out/ckpt.pt").write_failed("out/ckpt.pt", error, 0) == (
        "writing out/ckpt.pt failed at step 0: No space left on device; this run wrote no checkpoint yet; make room "
        "(or fix the folder) and run again with --start_over=True (a run from scratch there moves this one's files "
        "aside)")


def test_start_over_moves_the_runs_evaluations_with_it_and_an_evaluation_alone_is_an_earlier_run(tmp_path, capsys):
    """lab.eval_downstream's results stayed in out_dir, where they passed for the new run's and the same evaluation
    of the new run then overwrote them."""
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    (out_dir / "ckpt.pt").write_bytes(b"weights")
    (out_dir / "metrics.jsonl").write_text("first\n")
    for name in ("eval_piqa_0shot_loop2_iter300.json", "eval_mc_1shot_loop4_iter300_limit2.json"):
        (out_dir / name).write_text(name)
    (out_dir / "notes.txt").write_text("mine")  # not a run's file: it stays
    guard.lock_out_dir(str(out_dir), start_over=True).close()
    assert capsys.readouterr().out == (f"start_over: moved {out_dir}'s ckpt.pt, metrics.jsonl, "
                                       f"eval_mc_1shot_loop4_iter300_limit2.json and "
                                       f"eval_piqa_0shot_loop2_iter300.json into {out_dir / 'previous-1'}\n")
    assert sorted(os.listdir(out_dir / "previous-1")) == ["ckpt.pt", "eval_mc_1shot_loop4_iter300_limit2.json",
                                                          "eval_piqa_0shot_loop2_iter300.json", "metrics.jsonl"]
    assert (out_dir / "previous-1" / "eval_piqa_0shot_loop2_iter300.json").read_text() == \
        "eval_piqa_0shot_loop2_iter300.json"
    assert sorted(os.listdir(out_dir)) == ["notes.txt", "previous-1", "train.lock"]
    (out_dir / "eval_piqa_0shot_loop2_iter300.json").write_text("second")
    assert one_line_exit(capsys, guard.lock_out_dir, str(out_dir)).startswith(
        f"{out_dir} holds an earlier run (eval_piqa_0shot_loop2_iter300.json), which a run from scratch would")


def test_a_checkpoint_whose_model_args_do_not_make_its_weights_is_one_line(tmp_path):
    """Tagged as this project's train.py checkpoint, but changed since: no model_args, model_args that make no model
    or another model than its weights (otherwise a KeyError, a TypeError or load_state_dict's RuntimeError)."""
    from model import GPT, GPTConfig
    args = dict(n_layer=1, n_loop=1, n_head=2, n_embd=16, block_size=8, vocab_size=64)
    ckpt = dict(program="deeploop-train", model=GPT(GPTConfig(**args)).state_dict(), model_args=args)
    path = str(tmp_path / "ckpt.pt")
    fix = "it was changed after train.py wrote it; copy it again from its run, or point --out_dir at another train.py run"
    for changed, problem in (
            (dict(model_args=dict(args, loops=2)), "its model_args make no model (GPTConfig.__init__() got an "
                                                   "unexpected keyword argument 'loops')"),
            (dict(model_args=dict(args, n_head=3)), "its model_args make no model (n_embd=16 is not divisible by "
                                                    "n_head=3)"),
            (dict(model_args=dict(args, n_embd=32)), "17 of its weights do not fit the model its model_args make, e.g. "
                                                     "lm_head.weight: (64, 16) in the file, (64, 32) in the model"),
            (dict(model_args=dict(args, n_layer=2)), "12 of its weights do not fit the model its model_args make, e.g. "
                                                     "transformer.h.1.attn.c_attn.bias: none in the file, (48,) in "
                                                     "the model")):
        torch.save({**ckpt, **changed}, path)
        with pytest.raises(ValueError) as e:
            guard.load_checkpoint(path)
        assert str(e.value) == f"{path} is marked as a checkpoint of this project's train.py, but {problem}: {fix}"
    torch.save({k: v for k, v in ckpt.items() if k != "model_args"}, path)
    with pytest.raises(ValueError, match=f"but it has no model_args: {fix}$"):
        guard.load_checkpoint(path)
    torch.save(ckpt, path)
    assert guard.load_checkpoint(path)[0].config.n_embd == 16
