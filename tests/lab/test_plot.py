"""plot.py's reader of metrics.jsonl, and its figure of a run resumed with other eval_loops (the figure of two tiny
real runs is drawn in test_train.py)."""

import json

from lab.plot import read_metrics
from scripts import run_script

SECOND_PROCESS = True  # seconds of plots drawn, run beside the rest of the session (conftest.py)


def test_a_record_cut_short_at_the_end_is_left_out_with_a_note(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    whole = [{"type": "start", "iter": 0}, {"type": "train", "iter": 0, "loss": 5.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in whole) + '{"type": "train", "it')
    assert read_metrics(str(path)) == whole
    assert capsys.readouterr().err == f"note: {path} ends in a record cut short; left out\n"
    path.write_text("".join(json.dumps(r) + "\n" for r in whole))
    assert read_metrics(str(path)) == whole and capsys.readouterr().err == ""


def test_a_run_resumed_with_other_eval_loops_plots_what_each_evaluation_has(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    config = dict(residual="deeploop", n_loop=2, n_layer=1)
    evals = [({"1": 3.1, "2": 3.0}, 100), ({"1": 2.9, "2": 2.8}, 200),  # eval_loops=1,2, then resumed with 1,4
             ({"1": 2.7, "4": 2.5}, 300)]
    records = [dict(type="start", iter=0, config=config)]
    records += [dict(type="train", iter=i, tokens=i * 10, loss=3.0) for i in (0, 10, 20)]
    records += [dict(type="eval", iter=tokens // 10, tokens=tokens, val_loss=by_loops["1"], loop=dict(kappa=[1.5]),
                     val_loss_by_loops=by_loops) for by_loops, tokens in evals]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    r = run_script("lab/plot.py", str(run), f"--png={tmp_path / 'runs.png'}")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "runs.png").stat().st_size > 10000
    assert "| run | 1 | 4 |" in r.stdout and "| deeploop, n_loop=2 | 2.700 | 2.500 |" in r.stdout


def test_probes_of_the_stream_get_a_panel_and_a_table_by_visit(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    config = dict(residual="postln", n_loop=2, n_layer=1, n_prelude=1, n_coda=0, loop_input="add")
    loop = dict(kappa=[1.0], token_probe=[1.0, 0.5, 0.125], position_probe=[0.9, 0.25, 0.0625])
    records = [dict(type="start", iter=0, config=config), dict(type="train", iter=0, tokens=0, loss=3.0),
               dict(type="eval", iter=10, tokens=100, val_loss=2.0, loop=loop, val_loss_by_loops={"2": 2.0})]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    r = run_script("lab/plot.py", str(run), f"--png={tmp_path / 'runs.png'}")
    assert r.returncode == 0, r.stderr
    assert "wrote " + str(tmp_path / "runs.png") + ": postln, n_loop=2, 1/1/0 blocks, loop_input=add\n" in r.stdout
    tables = r.stdout.split("token_probe (the stream after each visit of the core; 0: its input) at the last "
                            "evaluation, by visit:")[1]
    assert "| run | 0 | 1 | 2 |" in tables
    assert "| postln, n_loop=2, 1/1/0 blocks, loop_input=add | 1.000 | 0.500 | 0.125 |" in tables
    label = "postln, n_loop=2, 1/1/0 blocks, loop_input=add"
    assert f"| {label} | 0.900 | 0.250 | 0.062 |" in tables.split("position_probe")[1]
