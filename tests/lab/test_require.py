"""lab.require on an install of the lesson's requirements.txt only, which the lab's packages are not part of: one
process of its own (conftest.py's EARLY) in which importing any of them fails, as there. Each lab entry point that
needs one stops with one line naming requirements-lab.txt; train.py and sample.py, which import lab modules, run.
`python tests/lab/test_require.py FOLDER` runs the cases in FOLDER and writes FOLDER/results.json."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# requirements-lab.txt's packages and those they bring that the lesson's do not, as imported
LAB_PACKAGES = ("matplotlib", "pyarrow", "huggingface_hub", "lm_eval", "transformers", "safetensors", "accelerate",
                "datasets", "tokenizers")


def cases(folder):
    """[(what runs: a script path or "-m module", its arguments, the package its one line names or None: it runs)]"""
    out = os.path.join(folder, "out")
    return [
        ("train.py", ["config/smoke_cpu.py", f"--out_dir={out}", "--max_iters=2", "--eval_interval=2",
                      "--eval_iters=1", "--log_interval=1"], None),
        ("sample.py", [f"--out_dir={out}", "--num_samples=1", "--max_new_tokens=5", "--device=cpu"], None),
        ("-m lab.plot", [out, f"--png={os.path.join(folder, 'runs.png')}"], "matplotlib"),
        ("-m lab.exit_eval", [f"--out_dir={out}", f"--png={os.path.join(folder, 'exit.png')}"], "matplotlib"),
        ("-m lab.model_update", [f"--png={os.path.join(folder, 'steps.png')}"], "matplotlib"),
        ("-m lab.sweep", ["--mode=exponent", f"--out_dir={os.path.join(folder, 'sweep')}"], "matplotlib"),
        ("-m lab.eval_downstream", [f"--out_dir={out}"], "lm_eval"),
        ("-m lab.export_hf", [f"--out_dir={out}", f"--to={os.path.join(folder, 'hf')}"], "safetensors"),
        ("prepare_data.py", ["fineweb_edu", f"--out={os.path.join(folder, 'fw')}"], "huggingface_hub"),
        ("prepare_data.py", [os.path.join(folder, "docs.parquet"), f"--out={os.path.join(folder, 'pq')}"],
         "pyarrow"),
    ]


def run_cases(folder):
    """Each case run here, the lab's packages hidden -> [{"case", "code", "stdout", "stderr"}]."""
    import contextlib
    import importlib.abc
    import io
    import runpy
    import traceback

    class HideLabPackages(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in LAB_PACKAGES:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    preloaded = sorted(name for name in sys.modules if name.split(".")[0] in LAB_PACKAGES)
    sys.meta_path.insert(0, HideLabPackages())
    open(os.path.join(folder, "docs.parquet"), "wb").close()  # a source file of the type: never read
    results = [dict(case="packages imported before the finder", code=0 if not preloaded else 1,
                    stdout="", stderr=", ".join(preloaded))]
    for target, args, _ in cases(folder):
        out, err = io.StringIO(), io.StringIO()
        sys.argv = [target, *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if target.startswith("-m "):
                    runpy.run_module(target[3:], run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(os.path.join(ROOT, target), run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except Exception:
                traceback.print_exc()
                code = 1
        results.append(dict(case=" ".join([target, *args]), code=code, stdout=out.getvalue(), stderr=err.getvalue()))
    return results


EARLY = {"test_lab_modules_without_their_packages_name_requirements_lab_and_the_lesson_runs":
         lambda folder: [[os.path.join("tests", "lab", "test_require.py"), str(folder)]]}


def test_lab_modules_without_their_packages_name_requirements_lab_and_the_lesson_runs(early):
    result, folder = early
    assert result.returncode == 0, result.stderr[-3000:]
    with open(folder / "results.json") as f:
        preloaded, *results = json.load(f)
    assert preloaded["code"] == 0, f"imported at start-up, before the finder could hide them: {preloaded['stderr']}"
    expected = cases(str(folder))
    assert len(results) == len(expected)
    for (_, _, package), run in zip(expected, results):
        if package is None:
            assert run["code"] == 0, f"{run['case']} with the lesson's packages only:\n{run['stderr'][-3000:]}"
        else:
            assert (run["code"], run["stdout"]) == (2, ""), f"{run['case']}:\n{run['stdout']}{run['stderr'][-3000:]}"
            assert run["stderr"] == (f"error: this needs {package}, one of the lab's packages (No module named "
                                     f"'{package}'): pip install -r requirements-lab.txt\n"), run["case"]


if __name__ == "__main__":
    sys.path[:0] = [ROOT]
    os.chdir(ROOT)
    folder = sys.argv[1]  # before the cases set sys.argv
    results = run_cases(folder)
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
