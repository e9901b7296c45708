"""lab.sweep_phi on made-up runs (a run whose folder holds result.json is not trained again, so these tests train
nothing): its rate walks, the phi table and its differences against hand values, and going on elsewhere from its
runs.jsonl."""

import json

from dataset import FORMAT
from scripts import run_script

SECOND_PROCESS = True  # ~15 s of the sweep's planning and tables, run beside the rest of the session (conftest.py)

ARGS = ["--widths=32,64", "--learning_rates=1e-3,3e-3,1e-2", "--start_rate=3e-3", "--seeds=0,1,2", "--walk_seeds=0,1",
        "--budgets=100", "--report_only=True"]
SHAPES = {"2x1": (2, 1), "2x3": (2, 3), "6x1": (6, 1)}
# made-up phi by (width, scheme) and seed: Pre-LN 0.4 / 0.5 / 0.6 at both widths, DeepLoop 0.3 / 0.2 / 0.3 above it
# at width 32 and 0.4 / 0.4 / 0.3 above it at width 64
PHI = {(32, "preln+paper"): (0.4, 0.5, 0.6), (32, "deeploop+paper"): (0.7, 0.7, 0.9),
       (64, "preln+paper"): (0.4, 0.5, 0.6), (64, "deeploop+paper"): (0.8, 0.9, 0.9)}


def write_run(out, width, shape, scheme, lr, seed, val_loss, test_loss, steps=100):
    name = f"{scheme}_R{SHAPES[shape][1]}_p0_lr{lr:g}_seed{seed}_it{steps}"
    run_dir = out / f"w{width}_{shape}" / "runs" / name
    run_dir.mkdir(parents=True)
    result = dict(name=name, scheme=scheme, n_loop=SHAPES[shape][1], exponent=0.0, lr=lr, seed=seed, steps=steps,
                  seconds=2.0, val_loss=val_loss, test_loss=test_loss, test_tokens=1000)
    (run_dir / "result.json").write_text(json.dumps(result))


def made_up_study(out, skip=(), phis_by_cell=PHI, budget=100):
    """Every run the walks ask for: val loss 1.0 + 0.1 per grid step from the best rate, 3e-3 (1e-2 at 6x1 of width
    64, whose walk moves there and on past the grid's edge, to 3e-2, which is worse); test losses that give PHI."""
    steps = [1e-3, 3e-3, 1e-2, 3e-2]
    for (width, scheme), phis in phis_by_cell.items():
        for shape in SHAPES:
            best = 1e-2 if (width, shape) == (64, "6x1") else 3e-3
            for lr in steps[:4 if best == 1e-2 else 3]:
                val = 1.0 + 0.1 * abs(steps.index(lr) - steps.index(best))
                for seed in (0, 1, 2):
                    if seed == 2 and lr != best or (width, shape, scheme, lr, seed) in skip:
                        continue
                    test = {"2x1": 2.0, "6x1": 1.8, "2x3": 2.0 - 0.2 * phis[seed]}[shape]
                    write_run(out, width, shape, scheme, lr, seed, val + 0.01 * seed, test, budget)


def test_phi_table_its_differences_and_the_walks_against_hand_values(tmp_path):
    out = tmp_path / "phi"
    made_up_study(out)
    r = run_script("lab/sweep_phi.py", f"--out_dir={out}", *ARGS)
    assert r.returncode == 0, r.stderr
    assert " s)\n" not in r.stdout  # nothing trained
    table = (out / "results.md").read_text()
    # the walks: 3e-3 wins among its neighbours, except at 6x1 of width 64, which walks to 1e-2 and one step past
    assert "| 32 | 2x3 | preln+paper | 0.001: 1.1050; 0.003: 1.0050; 0.01: 1.1050 | **0.003** |" in table
    assert "| 64 | 6x1 | deeploop+paper | 0.001: 1.2050; 0.003: 1.1050; 0.01: 1.0050; 0.03: 1.1050 | **0.01** |" \
        in table
    # phi per seed and its t-interval: 0.4, 0.5, 0.6 has mean 0.5, s.e. 0.0577, t(2) 4.303: half-width 0.248
    assert "| 32 | preln+paper | 0.400, 0.500, 0.600 | 0.500 ± 0.248 (3, p 0.013) | 3.46 |" in table
    # phi with 2x3 one rate step off (the made-up test losses do not depend on the rate): the walk seeds' phi
    assert "| 32 | preln+paper | 0.001: 0.400, 0.500 (mean 0.450) | 0.01: 0.400, 0.500 (mean 0.450) |" in table
    # DeepLoop minus Pre-LN, paired: 0.3, 0.2, 0.3 -> 0.267 ± 0.143; at width 64: 0.4, 0.4, 0.3 -> 0.367 ± 0.143
    # and test loss by shape: only 2x3 differs, by -0.2 * phi's difference: -0.06, -0.04, -0.06 -> -0.053 ± 0.029
    assert "| 32 | +0.000 ± 0.000 (3, p 1) | -0.053 ± 0.029 (3, p 0.015) | +0.000 ± 0.000 (3, p 1) " \
        "| +0.267 ± 0.143 (3, p 0.015) |" in table
    assert "| 64 | +0.000 ± 0.000 (3, p 1) | -0.073 ± 0.029 (3, p 0.0082) | +0.000 ± 0.000 (3, p 1) " \
        "| +0.367 ± 0.143 (3, p 0.0082) |" in table
    # the change with width, paired by seed: 0.1, 0.2, 0.0 -> 0.100 ± 0.248
    assert "Change of the difference from width 32 to 64 (paired by seed): +0.100 ± 0.248 (3, p 0.23)." in table
    assert (out / "phi.png").stat().st_size > 10000
    # the study goes on elsewhere from its runs.jsonl: the same tables
    runs_file = out / "runs.jsonl"
    assert len(runs_file.read_text().splitlines()) == 4 * 3 * 7 + 2 * 2  # 7 runs a cell, 2 more where a walk moved
    elsewhere = tmp_path / "elsewhere"
    r = run_script("lab/sweep_phi.py", f"--out_dir={elsewhere}", f"--results_from={runs_file}", *ARGS)
    assert r.returncode == 0, r.stderr
    assert (elsewhere / "results.md").read_text().split("## The rate walks")[1].split("| machines |")[0] == \
        table.split("## The rate walks")[1].split("| machines |")[0]


def test_a_walk_waits_for_its_runs_and_a_wider_walk_for_the_narrower_one(tmp_path):
    out = tmp_path / "phi"
    made_up_study(out, skip={(32, "2x3", "preln+paper", 1e-2, 1), (32, "2x3", "deeploop+paper", 1e-2, 0),
                             (32, "2x3", "deeploop+paper", 1e-2, 1)})
    r = run_script("lab/sweep_phi.py", f"--out_dir={out}", *ARGS)
    assert r.returncode == 0, r.stderr
    table = (out / "results.md").read_text()
    assert "| 32 | 2x3 | preln+paper | 0.001: 1.1050; 0.003: 1.0050; 0.01: 1.1000 (1 of 2 seeds) | walking |" in table
    assert "| 32 | 2x3 | deeploop+paper | 0.001: 1.1050; 0.003: 1.0050; 0.01: — | walking |" in table  # none run yet
    assert "| 64 | 2x3 | preln+paper |" not in table  # it starts where width 32's walk ends
    assert "| 32 | preln+paper | 2.0000 ± 0.0000 (3) | — | 1.8000 ± 0.0000 (3) |" in table
    assert "| 32 | preln+paper | — | — | — |" in table  # no phi without the looped shape


def test_bad_settings_are_one_line_errors(tmp_path):
    for args, message in ((["--shapes=2x1,2x3"], "shapes must be 2x1,2x3,6x1 (phi needs all three)"),
                          (["--walk_seeds=5"], "walk_seeds must be among seeds=0,1,2"),
                          (["--start_rate=5e-3"], "start_rate must be one of learning_rates"),
                          (["--widths=40"], "every width must be a multiple of head_size=16"),
                          (["--widths=0"], "every one of widths must be above 0, got '0'"),
                          (["--widths=-64"], "every one of widths must be above 0, got '-64'"),
                          (["--learning_rates=0,3e-3"], "every one of learning_rates must be above 0"),
                          (["--workers=0"], "workers must be a positive integer, got 0"),
                          (["--head_size=0"], "head_size must be a positive integer, got 0"),
                          (["--schemes=preln+bogus"], "unknown variant 'bogus' in scheme 'preln+bogus': use add,"),
                          (["--budgets=8000,4000"], "budgets must be positive step counts in increasing order"),
                          (["--dataset=builtin_bytes"], "unknown config key 'dataset'")):
        r = run_script("lab/sweep_phi.py", f"--out_dir={tmp_path}", *args)
        assert r.returncode == 2 and r.stderr.startswith(f"error: {message}") and r.stderr.count("\n") == 1, r.stderr


def test_results_from_is_checked_whole_before_anything_is_written(tmp_path):
    out = tmp_path / "phi"
    made_up_study(out)
    r = run_script("lab/sweep_phi.py", f"--out_dir={out}", *ARGS)
    assert r.returncode == 0, r.stderr
    lines = (out / "runs.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    del last["test_loss"]  # the last line of the file: every cell before it would be taken first
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(lines[:-1] + [json.dumps(last)]) + "\n")
    elsewhere = tmp_path / "elsewhere"
    for _ in range(2):  # and the same again: the first try left nothing behind
        r = run_script("lab/sweep_phi.py", f"--out_dir={elsewhere}", f"--results_from={broken}", *ARGS)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(f"error: --results_from={broken}, line {len(lines)}: run {last['name']} has no "
                                   f"test_loss: name the file a phi study wrote, e.g. docs/runs/phi_study_runs.jsonl")
        assert not elsewhere.exists()
    # a diverged run has no test loss to need
    diverged = dict(last, val_loss=None)
    broken.write_text("\n".join(lines[:-1] + [json.dumps(diverged)]) + "\n")
    r = run_script("lab/sweep_phi.py", f"--out_dir={elsewhere}", f"--results_from={broken}", *ARGS)
    assert r.returncode == 0 and "runs of w64_6x1 taken as done" in r.stdout, r.stderr
    elsewhere = tmp_path / "elsewhere2"
    # a budget study's file says it is one
    budget_file = tmp_path / "budget.jsonl"
    budget_file.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "cell"}) + "\n"
                                   for line in lines))
    r = run_script("lab/sweep_phi.py", f"--out_dir={elsewhere}", f"--results_from={budget_file}", *ARGS)
    assert r.returncode == 2 and r.stderr == f"error: --results_from={budget_file} is a budget study's runs.jsonl " \
        f"(its lines do not name a cell): name the file a phi study wrote, e.g. docs/runs/phi_study_runs.jsonl\n"
    assert not elsewhere.exists()


def test_a_result_without_test_loss_or_checkpoint_is_one_line(tmp_path):
    out = tmp_path / "phi"
    made_up_study(out)
    result_file = next((out / "w32_2x1" / "runs").glob("*/result.json"))
    result = json.loads(result_file.read_text())
    del result["test_loss"]
    result_file.write_text(json.dumps(result))
    r = run_script("lab/sweep_phi.py", f"--out_dir={out}", *ARGS)
    assert r.returncode == 2 and r.stderr == f"error: {result_file} has no test_loss and the run no checkpoint to " \
        f"compute it from: delete {result_file.parent}, and the study trains that run again\n", r.stderr


def test_the_tenfold_slope_and_the_verdicts_against_hand_values():
    import math
    from lab.sweep_budget import lead_verdict, tenfold_slope
    # seed by seed at 1e6 and 1e7 bytes: slopes -0.2, -0.2, -0.3 per tenfold; mean -0.2333, s.e. 0.0577 / sqrt(3) =
    # 0.0333, t(2) 4.303: half-width 0.1434, t = 7.0, p 0.0198
    fading = {1e6: {0: 0.3, 1: 0.2, 2: 0.3}, 1e7: {0: 0.1, 1: 0.0, 2: 0.0}}
    mean, half, n, p = tenfold_slope(fading)
    assert (round(mean, 4), round(half, 4), n, round(p, 4)) == (-0.2333, 0.1434, 3, 0.0198)
    # three budgets: each seed's least-squares line, here through 0, 0.1, 0.2 (seed 0) and 0, 0.1, 0.3 (seed 1)
    mean, half, n, p = tenfold_slope({1e5: {0: 0.0, 1: 0.0}, 1e6: {0: 0.1, 1: 0.1}, 1e7: {0: 0.2, 1: 0.3}})
    assert (round(mean, 4), n) == (0.125, 2) and math.isclose(half, 12.706 * 0.025, rel_tol=1e-3)
    assert tenfold_slope({1e6: {0: 0.1}}) is None  # one budget: no slope
    assert lead_verdict(1, fading) == "the lead fades: slope -0.233 ± 0.143 (3, p 0.02) per tenfold bytes, and at " \
        "10.0M bytes (+0.033 ± 0.143 (3, p 0.42)) the interval holds zero."
    # a loss: a negative difference is the lead; here the same numbers, mirrored, are a lead that persists
    persisting = {1e6: {0: -0.3, 1: -0.2, 2: -0.3}, 1e7: {0: -0.3, 1: -0.2, 2: -0.25}}
    assert lead_verdict(-1, persisting).startswith("the lead persists at 10.0M bytes (-0.250 ± 0.124 (3, p 0.0")
    assert lead_verdict(1, persisting).startswith("the lead reverses at 10.0M bytes")
    unclear = {1e6: {0: 0.1, 1: -0.1, 2: 0.05}, 1e7: {0: 0.1, 1: -0.1, 2: 0.0}}
    assert lead_verdict(1, unclear).startswith("cannot be told yet: at 10.0M bytes (+0.000 ± 0.248 (3, p 1)) the "
                                               "interval holds zero, and the slope -0.017")


def test_two_budgets_report_each_and_the_differences_across_them(tmp_path):
    """Width 32 at 100 steps as in the first test (DeepLoop's phi 0.3, 0.2, 0.3 above Pre-LN's), and at 1,000 steps
    (the walks start at 100 steps' 3e-3 and stay) 0.1, 0.0, 0.0 above: 51,200 and 512,000 bytes, one tenfold apart."""
    out = tmp_path / "phi"
    width32 = {cell: phis for cell, phis in PHI.items() if cell[0] == 32}
    made_up_study(out, phis_by_cell=width32)
    made_up_study(out, budget=1000, phis_by_cell={(32, "preln+paper"): (0.4, 0.5, 0.6),
                                                  (32, "deeploop+paper"): (0.5, 0.5, 0.6)})
    args = [a for a in ARGS if not a.startswith(("--widths", "--budgets"))]
    r = run_script("lab/sweep_phi.py", f"--out_dir={out}", "--widths=32", "--budgets=100,1000", *args)
    assert r.returncode == 0, r.stderr
    assert " s)\n" not in r.stdout  # nothing trained
    table = (out / "results.md").read_text()
    assert "| 100 | 0.1M | " in table and "| 1,000 | 0.5M | " in table  # what each budget reads
    assert "## The rate walks at 1,000 steps" in table
    assert "| 32 | preln+paper | 0.400, 0.500, 0.600 | 0.500 ± 0.248 (3, p 0.013) | 3.46 |" in table
    # the differences: phi 0.3, 0.2, 0.3 then 0.1, 0.0, 0.0 (slope as in the hand values above); L(2x3) = 2 - 0.2 phi
    # and the loop gain 0.2 phi, so their differences are -0.2 and 0.2 times phi's
    assert "| 32 | phi | +0.267 ± 0.143 (3, p 0.015) | +0.033 ± 0.143 (3, p 0.42) | -0.233 ± 0.143 (3, p 0.02) |" \
        in table
    assert "| 32 | L(2x3) | -0.053 ± 0.029 (3, p 0.015) | -0.007 ± 0.029 (3, p 0.42) | +0.047 ± 0.029 (3, p 0.02) |" \
        in table
    assert "- width 32, phi: the lead fades: slope -0.233 ± 0.143 (3, p 0.02) per tenfold bytes, and at 0.5M bytes " \
        "(+0.033 ± 0.143 (3, p 0.42)) the interval holds zero." in table
    assert "- width 32, L(2x3): the lead fades: slope +0.047 ± 0.029 (3, p 0.02)" in table
    assert (out / "budgets.png").stat().st_size > 10000


def test_a_corpus_of_other_settings_in_the_studys_folder_is_one_line_naming_the_study(tmp_path):
    """prepare_data.py's way out (--name, --out) is no option of the study's."""
    folder = tmp_path / "data" / "stdlib_bytes_heldout"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps(dict(format=FORMAT, test_share=0.3)))
    r = run_script("lab/sweep_phi.py", f"--out_dir={tmp_path / 'phi'}", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: data/stdlib_bytes_heldout already holds a dataset prepared with other "
                               "settings (") and "test_share=0.3 there, 0.5 asked" in r.stderr
    assert r.stderr.endswith("): it is lab.sweep_phi's own corpus, which lab.sweep_phi prepares: move the folder "
                             "away or delete it\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
