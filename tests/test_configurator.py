import subprocess
import sys

import pytest

from configurator import configure, require


def defaults():
    return dict(batch_size=12, learning_rate=6e-4, compile=True, dataset="openwebtext", top_k=None, n_loop=2)


def test_config_file_then_overrides(tmp_path):
    cfg = tmp_path / "c.py"
    cfg.write_text("import math\nbatch_size = 4\nlearning_rate = 1e-3\ndataset = 'builtin'\n")
    ns = defaults()
    configure(ns, [str(cfg), "--batch_size=8", "--compile=False", "--dataset=builtin_bytes", "--top_k=5",
                   "--learning_rate=1"])
    assert ns == dict(batch_size=8, learning_rate=1.0, compile=False, dataset="builtin_bytes", top_k=5, n_loop=2)
    assert isinstance(ns["learning_rate"], float)


def test_given_receives_the_keys_that_files_and_overrides_set_even_to_their_default(tmp_path):
    cfg = tmp_path / "c.py"
    cfg.write_text("batch_size = 12\nlearning_rate = 1e-3\n")  # batch_size as its default: still given
    ns, given = defaults(), set()
    configure(ns, [str(cfg), "--n_loop=2", "--top_k=5"], given)
    assert given == {"batch_size", "learning_rate", "n_loop", "top_k"}


def test_string_key_keeps_what_was_typed():
    ns = defaults()
    configure(ns, ["--dataset=2024"])
    assert ns["dataset"] == "2024"


def test_literal_eval_never_runs_code():
    ns = defaults()
    configure(ns, ["--top_k=__import__('os').getcwd()"])
    assert ns["top_k"] == "__import__('os').getcwd()"  # kept as a plain string, not executed


@pytest.mark.parametrize("argv,message", [
    (["--batch_sise=3"], "unknown config key 'batch_sise' in --batch_sise"),
    (["--batch_size=3.5"], "config key 'batch_size' in --batch_size must be int (like 12), got float 3.5"),
    (["--compile=1"], "config key 'compile' in --compile must be bool"),
    (["--n_loop"], "override --n_loop has no value; write it as --n_loop=value"),
    (["--n_loop=None"], "config key 'n_loop' in --n_loop must be int (like 2), got NoneType None"),
    (["--learning_rate=None"], "config key 'learning_rate' in --learning_rate must be float (like 0.0006), got "
                               "NoneType None"),
    (["config/nope.py"], "config file not found: config/nope.py"),
])
def test_errors_are_one_line_with_exit_code_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        configure(defaults(), argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + message) and err.count("\n") == 1


def test_unknown_key_in_config_file(tmp_path, capsys):
    cfg = tmp_path / "bad.py"
    cfg.write_text("n_loops = 4\n")
    with pytest.raises(SystemExit) as e:
        configure(defaults(), [str(cfg)])
    assert e.value.code == 2
    assert f"unknown config key 'n_loops' in {cfg}" in capsys.readouterr().err


def test_error_from_a_script_has_no_traceback(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import sys\nsys.path.insert(0, %r)\nn_loop = 2\n"
                      "from configurator import configure\nconfigure(globals(), sys.argv[1:])\n" % str(
                          __import__("pathlib").Path(__file__).resolve().parents[1]))
    r = subprocess.run([sys.executable, str(script), "--n_loop=two"], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr == "error: config key 'n_loop' in --n_loop must be int (like 2), got str 'two'\n"


def test_none_only_where_the_default_is_none(tmp_path, capsys):
    """A numeric setting given None ran on until the first arithmetic with it failed in a traceback."""
    ns = defaults()
    configure(ns, ["--top_k=None"])  # its default is None: None is one of its values
    assert ns["top_k"] is None
    cfg = tmp_path / "c.py"
    cfg.write_text("batch_size = None\n")
    with pytest.raises(SystemExit) as e:
        configure(defaults(), [str(cfg)])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"error: config key 'batch_size' in {cfg} must be int (like 12), got NoneType None\n"


def test_only_the_lower_case_names_a_script_assigns_are_settings(tmp_path, capsys):
    """Names a script imports (train.py's EVAL_SEED, the evaluation windows every run shares; sample.py's MAX_LOOPS,
    which its own check of n_loop reads) and its UPPER_CASE constants are globals too, but no settings."""
    script = tmp_path / "s.py"
    script.write_text("from dataset import EVAL_SEED\nTOLERANCE = 1e-5\nn_loop = 2\nout_dir, seed = 'out', 1\n")
    namespace = {"__file__": str(script), "EVAL_SEED": 1234, "TOLERANCE": 1e-5, "n_loop": 2, "out_dir": "out",
                 "seed": 1}
    assert configure(dict(namespace), ["--n_loop=3", "--seed=4", "--out_dir=x"]) == dict(n_loop=3, seed=4,
                                                                                         out_dir="x")
    for key in ("EVAL_SEED", "TOLERANCE"):
        with pytest.raises(SystemExit) as e:
            configure(dict(namespace), [f"--{key}=5"])
        assert e.value.code == 2
        assert capsys.readouterr().err == \
            f"error: unknown config key '{key}' in --{key}; known keys: n_loop, out_dir, seed\n"


@pytest.mark.parametrize("text,message", [
    ("batch_size = 4\nn_loop = (2\n", "line 2: '(' was never closed"),
    ("batch_size = 4\n\nn_loop = two\n", "line 3: NameError: name 'two' is not defined"),
    ("import nowhere_to_be_found\n", "line 1: ModuleNotFoundError: No module named 'nowhere_to_be_found'"),
])
def test_a_config_file_that_does_not_run_is_one_line_naming_its_line(tmp_path, capsys, text, message):
    cfg = tmp_path / "bad.py"
    cfg.write_text(text)
    with pytest.raises(SystemExit) as e:
        configure(defaults(), [str(cfg)])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"error: {cfg}, {message}; a config file holds python lines of settings, like " \
                                      f"batch_size = 4\n"


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "latin1.py"
    cfg.write_bytes("# réglages\nbatch_size = 4\n".encode("latin-1"))
    with pytest.raises(SystemExit) as e:
        configure(defaults(), [str(cfg)])
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"error: the config file {cfg} is not UTF-8 text (invalid continuation byte at "
                                       f"byte 3); convert it to UTF-8\n")


def test_a_missing_package_names_the_install_command_of_its_caller(capsys):
    require("json")  # there: nothing happens
    for install, said in ((None, "pip install -r requirements-lab.txt"), ("pip install -r requirements-serve.txt",
                                                                          "pip install -r requirements-serve.txt")):
        with pytest.raises(SystemExit) as e:
            require("json", "no_such_package_here", **({"install": install} if install else {}))
        assert e.value.code == 2
        assert capsys.readouterr().err == (f"error: this needs no_such_package_here, one of the lab's packages (No "
                                           f"module named 'no_such_package_here'): {said}\n")
