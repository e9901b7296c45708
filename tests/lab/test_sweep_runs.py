"""lab/sweep_runs.py: a sweep reuses a run only where it was made with the sweep's settings, reads and writes result
files whole or says which line is wrong, takes imported runs into its own out_dir only, and stops on a signal with
its runs' checkpoints, to resume with the same command."""

import fcntl
import json
import os
import shlex
import signal
import time

import pytest
import torch

from lab.plot import read_metrics
from lab.sweep_runs import Runs, write_json
from scripts import ROOT, Started, run_forked, run_script


def sweep(*args):
    return run_script("lab/sweep.py", *args)


def one_line(r):
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    return r.stderr[len("error: "):-1]


def write_result(out, name, settings=None, **fields):
    """A made-up result.json of run name, made with settings (None: a result from before they were recorded)."""
    os.makedirs(out / "runs" / name)
    result = dict(name=name, seconds=1.0, val_loss=2.5, kappa=1.0, curve=[(0, 5.6)], val_curve=[(0, 2.5)],
                  accuracy={"1": 0.5, "2": 0.25}, shortcut={"1": 0.4, "2": 0.25}, test_time={}, **fields)
    if settings is not None:
        result["settings"] = settings
    (out / "runs" / name / "result.json").write_text(json.dumps(result))
    return out / "runs" / name / "result.json"


RUN = dict(scheme="preln", n_loop=1, exponent=0.0, lr=1e-3, seed=0)
BUDGET = ["--mode=budget", "--dataset=builtin_bytes", "--schemes=preln", "--loops=1", "--learning_rates=1e-3",
          "--seeds=0", "--budgets=2", "--long_schemes=preln", "--long_seeds=0", "--report_only=True"]


@pytest.mark.parametrize("mode,args,name,settings", [
    # the case: a budget study at width 32, 4 sequences a step, then the same command at 64 and 16
    ("budget", [*BUDGET, "--n_embd=64", "--batch_size=16"], "preln_R1_p0_lr0.001_seed0_it2",
     dict(dataset="builtin_bytes", n_embd=32, batch_size=4)),
    ("loops", ["--mode=loops", "--schemes=preln", "--loops=1", "--seeds=0", "--eval_iters=20"],
     "preln_R1_p0_lr0.001_seed0", dict(eval_iters=50)),
    ("depth", ["--mode=depth", "--schemes=preln+relative", "--loops=1", "--seeds=0", "--learning_rates=1e-3"],
     "preln+relative_R1_p0_lr0.001_seed0", dict(warmup_iters=50, chain_pointers="absolute")),
])
def test_a_result_of_other_settings_is_never_reused_and_the_line_names_them(tmp_path, mode, args, name, settings):
    out = tmp_path / mode
    path = write_result(out, name, settings, **dict(RUN, scheme=name.split("_")[0]), steps=2, dtype="float32")
    before = path.read_bytes()
    r = sweep(*args, f"--out_dir={out}")
    was = ", ".join(f"{k}={v!r}" for k, v in settings.items() if k != "dataset")
    now = {"budget": "n_embd=64, batch_size=16", "loops": "eval_iters=20",
           "depth": "warmup_iters=100, chain_pointers='relative'"}[mode]
    assert one_line(r) == (f"{path} was trained with {was}, where this sweep's runs get {now}: give the sweep the "
                           f"settings of the runs in {out}, or choose another --out_dir")
    assert " s)\n" not in r.stdout and os.listdir(out) == ["runs"] and os.listdir(out / "runs") == [name]
    assert path.read_bytes() == before


def test_a_result_that_records_no_settings_was_made_with_its_modes_defaults(tmp_path):
    """Results from before the sweeps recorded their settings: taken as made with the mode's defaults, so reused by a
    sweep of those settings and refused by one of others."""
    out = tmp_path / "legacy"
    write_result(out, "preln_R1_p0_lr0.001_seed0", **RUN, dtype="float32")
    args = ["--mode=loops", "--schemes=preln", "--loops=1", "--seeds=0", f"--out_dir={out}"]
    r = sweep(*args)
    assert r.returncode == 0 and " s)\n" not in r.stdout, r.stderr  # reused: nothing trained
    path = out / "runs" / "preln_R1_p0_lr0.001_seed0" / "result.json"
    assert one_line(sweep(*args, "--n_layer=3", "--max_iters=500")).startswith(
        f"{path} was trained with n_layer=2, max_iters=400, where this sweep's runs get n_layer=3, max_iters=500: ")


def study_runs(dataset="stdlib_bytes", **budget):
    """Runs as the budget study's command makes them: the mode's defaults, but for budget."""
    sweep_defaults = dict(n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=8, max_iters=400,
                          warmup_iters=100, eval_iters=50)

    def runs(defaults=None, **given):
        return Runs(os.path.join(ROOT, "out-unused"), "budget", False, dataset, {"eval_iters": 50},
                    "config/depth_cpu.py", lambda scheme: {"norm": "rmsnorm"} if "+paper" in scheme else {}, [1, 3],
                    3.0, **{**sweep_defaults, **given}, defaults=defaults)
    return runs(defaults=runs(), **budget)


def test_the_budget_studys_runs_from_before_the_settings_were_recorded_count_as_its_defaults():
    """docs/runs/budget_study_runs.jsonl: made with the budget mode's defaults on stdlib_bytes, in float32."""
    with open(os.path.join(ROOT, "docs", "runs", "budget_study_runs.jsonl")) as f:
        records = [json.loads(line) for line in f]
    jobs = [((r["scheme"], r["n_loop"], r["exponent"], r["lr"], r["seed"], r["steps"]), r) for r in records]
    study = study_runs()
    study.dtype = "float32"
    assert len(jobs) >= 359 and all(study.changed(r.get("settings", {}), job, r["dtype"]) == ("", "")
                                    for job, r in jobs)
    wider = study_runs(n_embd=128)
    wider.dtype = "float32"
    assert wider.changed({}, jobs[0][0], "float32") == ("n_embd=64", "n_embd=128")


def test_an_imported_study_of_other_settings_is_one_line_and_nothing_is_taken(tmp_path):
    """--results_from=docs/runs/budget_study_runs.jsonl on builtin_bytes: its runs trained on stdlib_bytes."""
    out = tmp_path / "study"
    study = os.path.join(ROOT, "docs", "runs", "budget_study_runs.jsonl")
    r = sweep(*BUDGET, f"--out_dir={out}", f"--results_from={study}")
    with open(study) as f:
        first = json.loads(f.readline())["name"]
    assert one_line(r) == (f"--results_from={study}, line 1: run {first} was trained with dataset='stdlib_bytes', "
                           f"where this sweep's runs get dataset='builtin_bytes': give the sweep the study's settings, "
                           f"or leave out --results_from")
    assert not (out / "runs").exists()


def test_a_phi_study_file_given_to_the_budget_study_says_it_is_one(tmp_path):
    """Its lines, which name their cells, were all skipped: "0 of its 0 runs taken as done"."""
    out = tmp_path / "study"
    study = os.path.join(ROOT, "docs", "runs", "phi_study_runs.jsonl")
    r = sweep(*BUDGET, f"--out_dir={out}", f"--results_from={study}")
    assert one_line(r) == (f"--results_from={study} is a phi study's runs.jsonl (its lines name a cell): name the file "
                           f"a budget study wrote, e.g. docs/runs/budget_study_runs.jsonl")
    assert not (out / "runs").exists()


def test_a_result_file_cut_short_is_one_line_naming_it(tmp_path):
    """A result.json written in place and cut short: every later start died in a JSONDecodeError's traceback."""
    out = tmp_path / "cut"
    path = write_result(out, "preln_R1_p0_lr0.001_seed0", **RUN, dtype="float32")
    text = path.read_text()
    path.write_text(text[:len(text) // 2])
    try:
        json.loads(path.read_text())
    except ValueError as e:
        error = e
    r = sweep("--mode=loops", "--schemes=preln", "--loops=1", "--seeds=0", f"--out_dir={out}")
    assert one_line(r) == (f"{path}, line 1: not JSON ({error.msg}; a result.json cut short?): delete it, and the "
                           f"sweep trains that run again")
    path.write_text("[1, 2]")
    r = sweep("--mode=loops", "--schemes=preln", "--loops=1", "--seeds=0", f"--out_dir={out}")
    assert one_line(r) == f"{path}, line 1: a JSON list, not a run's record: delete it, and the sweep trains that " \
                          f"run again"


def test_result_files_are_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "result.json"
    write_json(path, {"val_loss": 2.5})
    with pytest.raises(TypeError):
        write_json(path, {"val_loss": 2.0, "curve": object()})  # fails part-way through the JSON
    assert json.loads(path.read_text()) == {"val_loss": 2.5} and os.listdir(tmp_path) == ["result.json"]


@pytest.mark.parametrize("line,why", [
    ("{}", "a record without name, scheme, n_loop, exponent, lr, seed, seconds, steps"),
    ("[1, 2]", "a JSON list, not a run's record"),
    ('{"name": "x", "scheme": "preln", "n_loop": "1"', "not JSON (Expecting ',' delimiter at column 47)"),
    (json.dumps(dict(RUN, name="preln_R1_p0_lr0.001_seed0_it2", seconds=1.0, val_loss=2.5, steps=2.5)),
     "a record whose steps is of the wrong type"),
    (json.dumps(dict(RUN, name="../../escaped_dir", seconds=1.0, val_loss=2.5, steps=2)),
     "run name '../../escaped_dir' is not the folder name of its run ('preln_R1_p0_lr0.001_seed0_it2')"),
    (json.dumps(dict(RUN, scheme="../../escaped", name="../../escaped_R1_p0_lr0.001_seed0_it2", seconds=1.0,
                     val_loss=2.5, steps=2)),
     "run name '../../escaped_R1_p0_lr0.001_seed0_it2' is not the folder name of its run "
     "('../../escaped_R1_p0_lr0.001_seed0_it2')"),
])
def test_a_bad_line_of_an_imported_runs_file_is_one_line_naming_it_and_nothing_is_taken(tmp_path, line, why):
    """{}: a KeyError 'name'; [1, 2]: a TypeError; a run named ../../escaped_dir was written outside out_dir."""
    good = json.dumps(dict(RUN, name="preln_R1_p0_lr0.001_seed0_it2", seconds=1.0, val_loss=2.5, steps=2, kappa=1.0,
                           val_curve=[(2, 2.5)], dtype="float32", settings={"dataset": "builtin_bytes"}))
    runs_file = tmp_path / "runs.jsonl"
    runs_file.write_text(f"{good}\n\n{line}\n")
    out = tmp_path / "a" / "b" / "sweep"
    r = sweep(*BUDGET, f"--out_dir={out}", f"--results_from={runs_file}")
    assert one_line(r) == (f"--results_from={runs_file}, line 3: {why}: name the file a budget study wrote, e.g. "
                           f"docs/runs/budget_study_runs.jsonl")
    assert os.listdir(tmp_path) == ["runs.jsonl"]
    runs_file.write_text(f"{good}\n")
    r = sweep(*BUDGET, f"--out_dir={out}", f"--results_from={runs_file}")
    assert r.returncode == 0 and f"{runs_file}: 1 of its 1 runs taken as done" in r.stdout, r.stderr


def test_a_run_stopped_part_way_with_other_settings_is_not_resumed(tmp_path):
    """train.py compares a checkpoint with the model's settings only: a batch size of its own would have resumed."""
    run_dir = tmp_path / "sweep" / "runs" / "preln_R1_p0_lr0.001_seed0"
    run_dir.mkdir(parents=True)
    (run_dir / "ckpt.pt").write_bytes(b"weights")
    (run_dir / "metrics.jsonl").write_text(json.dumps(dict(type="start", iter=0, config=dict(batch_size=4,
                                                                                             dtype="float32"))) + "\n")
    r = sweep("--mode=loops", "--schemes=preln", "--loops=1", "--seeds=0", f"--out_dir={tmp_path / 'sweep'}",
              "--dtype=float32")
    assert one_line(r) == (f"{run_dir} holds a run stopped part-way with batch_size=4, where this sweep's runs get "
                           f"batch_size=8: give the sweep the settings of the runs in {tmp_path / 'sweep'}, or choose "
                           f"another --out_dir")
    assert sorted(os.listdir(run_dir)) == ["ckpt.pt", "metrics.jsonl"]


def depth_runs(out_dir):
    """Runs of a depth-task sweep into out_dir: width 32, 4 sequences a step."""
    return Runs(str(out_dir), "depth", True, "chains", dict(n_embd=32, batch_size=4, max_iters=4),
                os.path.join(ROOT, "config", "depth_cpu.py"), lambda scheme: {}, [1, 2], 0.0, n_layer=2, n_head=4,
                n_embd=32, block_size=16, batch_size=4, max_iters=4, warmup_iters=1, eval_iters=1)


def test_a_sweep_keeps_the_precision_of_a_run_stopped_part_way_and_measures_nothing(tmp_path, monkeypatch, capsys):
    """The resume command of a sweep at dtype=auto measured again, picked float32 where the first start had picked
    bfloat16, and then refused its own run stopped part-way in bfloat16: the precision of a run that resumes from its
    checkpoint (its last start record's) is the sweep's, as a finished run's is."""
    monkeypatch.setattr("lab.sweep_runs.choose_dtype", lambda *args: pytest.fail("measured"))
    runs = depth_runs(tmp_path)
    part_way, unstarted = (tmp_path / "runs" / f"preln_R{n_loop}_p0_lr0.001_seed0" for n_loop in (2, 1))
    part_way.mkdir(parents=True)
    (part_way / "ckpt.pt").write_bytes(b"weights")
    (part_way / "metrics.jsonl").write_text("".join(json.dumps(dict(type="start", iter=i, config=dict(dtype=dtype)))
                                                    + "\n" for i, dtype in ((0, "float32"), (4, "bfloat16"))))
    unstarted.mkdir()  # stopped before its first checkpoint: it starts over, in the sweep's precision
    (unstarted / "metrics.jsonl").write_text(json.dumps(dict(type="start", iter=0, config=dict(dtype="float32"))))
    assert runs.sweep_dtype("auto") == ("bfloat16", f"the precision of the runs in {tmp_path}")
    assert runs.dtype == "bfloat16"
    with pytest.raises(SystemExit):
        runs.sweep_dtype("float32")
    assert capsys.readouterr().err == f"error: {tmp_path} holds runs in bfloat16; a sweep keeps one precision: leave " \
                                      f"--dtype at auto or choose another --out_dir\n"
    write_result(tmp_path, "deeploop_R2_p0_lr0.001_seed0", **dict(RUN, scheme="deeploop"), dtype="float32")
    with pytest.raises(SystemExit):
        runs.sweep_dtype("auto")
    assert "holds runs in bfloat16, float32; a sweep keeps one precision" in capsys.readouterr().err


def test_a_sweep_without_runs_measures_the_model_of_the_run_it_is_given_on_one_thread(tmp_path, monkeypatch):
    measured = []
    monkeypatch.setattr("runtime.time_training_steps", lambda model, batch_shape: measured.append(
        (model.config, batch_shape, torch.get_num_threads())) or (dict(float32=[2.0] * 3, bfloat16=[1.0] * 3), 4, 1.0))
    monkeypatch.setattr("runtime.cpu_flags", lambda: {"avx512_bf16"})
    threads = torch.get_num_threads()
    try:
        dtype, why = depth_runs(tmp_path).sweep_dtype("auto", ("preln", 2, 0.0, 1e-3, 0))
    finally:
        torch.set_num_threads(threads)
    assert dtype == "bfloat16" and why.startswith("training steps of this model on 4 of the batch's 4 sequences of 16 "
                                                  "tokens")
    [(config, batch_shape, on_threads)] = measured
    assert (config.n_layer, config.n_loop, config.n_embd, config.residual, config.block_size) == (2, 2, 32, "preln", 16)
    assert config.vocab_size == 64 and batch_shape == (4, 16) and on_threads == 1  # 8 values and 16 cells, padded


# ---------------------------------------------------------------------------------------------------------------
# signals: a sweep of one run of 1,000 steps (~3 s), signalled at its first steps

STOPPABLE = ["--mode=loops", "--schemes=preln", "--loops=1", "--seeds=0", "--learning_rates=1e-3", "--max_iters=1000",
             "--warmup_iters=1", "--eval_iters=1", "--n_embd=32", "--block_size=32", "--workers=1",
             "--dtype=float32"]


def held(lock_path):
    """Whether a process holds the lock file of a train.py run."""
    with open(lock_path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


@pytest.mark.parametrize("signalled", ["the sweep", "the sweep and its run", "its run"])
def test_a_signal_stops_the_sweep_once_its_run_wrote_its_checkpoint_and_the_same_command_resumes_it(tmp_path,
                                                                                                    signalled,
                                                                                                    monkeypatch):
    """SIGTERM to the sweep; Ctrl-C (SIGINT to the sweep and its run, as the terminal sends it to both); SIGTERM to
    the run alone. The sweep exited 143 at once while its run went on without it, and on Ctrl-C said "error: run ...
    failed (exit 75)"."""
    out = tmp_path / "sweep"
    args = [f"--out_dir={out}", *STOPPABLE]
    run_dir = out / "runs" / "preln_R1_p0_lr0.001_seed0"
    signum = signal.SIGINT if signalled == "the sweep and its run" else signal.SIGTERM
    with open(tmp_path / "sweep.log", "w+") as log:
        started = Started("lab/sweep.py", *args, cwd=ROOT, log=log)
        try:
            deadline = time.monotonic() + 120
            while not ((run_dir / "metrics.jsonl").exists() and '"train"' in (run_dir / "metrics.jsonl").read_text()):
                assert started.poll() is None, log.seek(0) or log.read()
                assert time.monotonic() < deadline, "the run trained no step in 120 s"
                time.sleep(0.01)
            run_pid = int((run_dir / "train.lock").read_text().split()[1])
            if signalled != "its run":
                started.send_signal(signum)
            if signalled != "the sweep":
                os.kill(run_pid, signum)
            assert started.wait(timeout=120) == 75
        finally:
            if started.poll() is None:
                started.kill()
                started.wait()
        log.seek(0)
        text = log.read()
    assert text.endswith(f"stopped; resume with: python -m lab.sweep {shlex.join(args)}\n") and "error" not in text
    assert not held(run_dir / "train.lock") and not (run_dir / "result.json").exists()  # the run has ended
    step = torch.load(run_dir / "ckpt.pt", weights_only=False)["iter_num"]
    assert 0 < step < 1000
    # the resume's run forked from here, as the planning tests' are: what is tested of it is what it reads and writes
    monkeypatch.setattr(Runs, "run", lambda self, cmd, env: run_forked(cmd, env))
    r = sweep(*args)
    assert r.returncode == 0 and r.stdout.count(" s)\n") == 1, r.stderr
    starts = [record for record in read_metrics(run_dir / "metrics.jsonl") if record["type"] == "start"]
    assert [(start["resumed"], start["iter"]) for start in starts] == [(False, 0), (True, step)]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["steps"] == 1000 and result["val_curve"][-1][0] == 1000
    assert (result["settings"]["n_embd"], result["settings"]["batch_size"], result["settings"]["dataset"]) == \
        (32, 8, "builtin_bytes") and "out_dir" not in result["settings"]
