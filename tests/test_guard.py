"""guard.py's pieces on their own, in one process (tests/test_train.py runs them end to end, signals and DDP too)."""

import errno
import json
import math
import os
import signal

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
    metrics.open(append=False)
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
    metrics.open(append=True)
    metrics.write(dict(type="start", iter=1))
    metrics.close()
    assert path.read_text() == '{"type": "start", "iter": 0}\n{"type": "start", "iter": 1}\n'
    assert capsys.readouterr().out == f"note: {path} ended in a record cut short; removed it\n"
    guard.MetricsLog(str(path)).open(append=False)  # a run from scratch starts the file afresh
    assert path.read_text() == ""


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
