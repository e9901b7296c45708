"""plot.py's reader of metrics.jsonl (the figure itself is drawn from two tiny runs in test_train.py)."""

import json

from plot import read_metrics


def test_a_record_cut_short_at_the_end_is_left_out_with_a_note(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    whole = [{"type": "start", "iter": 0}, {"type": "train", "iter": 0, "loss": 5.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in whole) + '{"type": "train", "it')
    assert read_metrics(str(path)) == whole
    assert capsys.readouterr().err == f"note: {path} ends in a record cut short; left out\n"
    path.write_text("".join(json.dumps(r) + "\n" for r in whole))
    assert read_metrics(str(path)) == whole and capsys.readouterr().err == ""
