"""
nanoGPT-style configuration: a script keeps its settings as plain module-level variables, then calls

    from configurator import configure
    configure(globals(), sys.argv[1:])

which runs the config files named on the command line (python files of `key = value` lines), then applies the
`--key=value` overrides, and returns the settings. The settings are the names the script itself assigns at its
top level, in lower case: not the names it imports (train.py's EVAL_SEED, sample.py's MAX_LOOPS) nor its UPPER_CASE
constants. Values are read with ast.literal_eval, never eval; a value that
is no Python literal is taken as a bare string (`--dataset=builtin`). A value has its default's type (an int may stand
for a float; None only where the default is None). Anything wrong stops the script with one line on stderr and exit
code 2, also a config file that does not run (the line names the file and its line). A script that must tell a
setting given from its default (sweep.py, where a given one overrides a mode's own budget) passes a set as `given`:
it receives the keys that the files and overrides set.
"""

import ast
import importlib
import os
import sys
import traceback

SIMPLE_TYPES = (int, float, bool, str, type(None))
CONFIG_FILE = "a config file holds python lines of settings, like batch_size = 4"


def die(message):
    """Stop with a one-line error and exit code 2: no traceback, since the problem is the input, not the code."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def read_text(path, what, fix):
    """The text of the UTF-8 file at path, or a one-line error: what names the file ("the prompt file"), fix says
    what to do when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        die(f"cannot read {what} {path} ({e.strerror}); {fix}")
    except UnicodeDecodeError as e:
        die(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8")


def require(*packages, install="pip install -r requirements-lab.txt"):
    """Import each of the lab's packages named, or stop with one line that names the command installing them: the
    lesson's requirements.txt leaves them out."""
    for package in packages:
        try:
            importlib.import_module(package)
        except ImportError as e:
            die(f"this needs {package}, one of the lab's packages ({e}): {install}")


def _checked(key, value, config, source):
    """The value converted to the type of the key's default; dies on an unknown key or a wrong type."""
    if key not in config:
        die(f"unknown config key '{key}' in {source}; known keys: {', '.join(sorted(config))}")
    default = config[key]
    if default is None or type(value) is type(default):  # None only where the default is None
        return value
    if type(default) is float and type(value) is int:
        return float(value)
    die(f"config key '{key}' in {source} must be {type(default).__name__} (like {default!r}), "
        f"got {type(value).__name__} {value!r}")


def declared(namespace):
    """The names a script's file assigns at its top level in lower case -> a set; None where the namespace has no file
    (a dict of settings, as the tests pass): then every name counts."""
    path = namespace.get("__file__")
    if not path or not os.path.isfile(path):
        return None
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    targets = [t for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    names = {n.id for t in targets for n in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(n, ast.Name)}
    return {name for name in names if not name.isupper()}


def configure(namespace, argv, given=None, extra=None):
    """extra: the settings of what extends the script (the lab's, under python -m lab.train), set by the same files
    and overrides, and written back to it as well as to the namespace."""
    extra = {} if extra is None else extra
    namespace.update(extra)
    settings = declared(namespace)
    settings = settings if settings is None else settings | set(extra)
    config = {k: v for k, v in namespace.items() if not k.startswith("_") and isinstance(v, SIMPLE_TYPES)
              and (settings is None or k in settings)}
    for arg in argv:
        if not arg.startswith("--"):
            if not os.path.isfile(arg):
                die(f"config file not found: {arg} (config files live in config/, e.g. config/smoke_cpu.py)")
            file_globals = {}
            source = read_text(arg, "the config file", "check its permissions")
            try:
                exec(compile(source, arg, "exec"), file_globals)
            except SyntaxError as e:
                die(f"{arg}, line {e.lineno}: {e.msg}; {CONFIG_FILE}")
            except Exception as e:  # NameError, ImportError, ...: the config file's line, not a traceback
                lines = [frame.lineno for frame in traceback.extract_tb(e.__traceback__) if frame.filename == arg]
                die(f"{arg}{f', line {lines[-1]}' if lines else ''}: {type(e).__name__}: {e}; {CONFIG_FILE}")
            for key, value in file_globals.items():
                if not key.startswith("_") and isinstance(value, SIMPLE_TYPES):
                    config[key] = namespace[key] = _checked(key, value, config, arg)
                    if given is not None:
                        given.add(key)
            continue
        key, eq, text = arg[2:].partition("=")
        if not eq:
            die(f"override {arg} has no value; write it as --{key}=value")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # a bare string, e.g. --device=cpu
        if isinstance(config.get(key), str) and not isinstance(value, str):
            value = text  # a string setting keeps what was typed, e.g. --out_dir=2024
        config[key] = namespace[key] = _checked(key, value, config, f"--{key}")
        if given is not None:
            given.add(key)
    extra.update({k: namespace[k] for k in extra})
    return config
