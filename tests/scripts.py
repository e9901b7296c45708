"""Run one of the repo's scripts (train.py, sample.py, ...) inside the test process.

A subprocess costs ~3 s on the test machines before the script's first line runs (importing torch alone is 2.2 s);
most tests run a script for a fraction of a second after that. Tests that need a process of their own (signals,
SIGKILL, DDP, torch.compile, file-size limits) still start one. In-process and subprocess runs give the same
numbers: conftest.py sets the one thread that the tests' subprocesses use.
"""

import contextlib
import io
import os
import signal
import subprocess
import sys
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script, *args, cwd=ROOT, env=None):
    """python <script> <args> in cwd, here -> subprocess.CompletedProcess (returncode, stdout, stderr), as
    subprocess.run(..., capture_output=True, text=True) gives it. env: variables set for the run, then put back."""
    path = os.path.join(ROOT, script)
    saved_cwd, saved_argv, saved_env = os.getcwd(), sys.argv, dict(os.environ)
    saved_handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    out, err = io.StringIO(), io.StringIO()
    # the script's globals: kept here so that what it leaves open (train.py's lock file) is closed below, also
    # when it ends by sys.exit
    namespace = {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}
    code = 0
    try:
        os.chdir(cwd)
        sys.argv = [path, *map(str, args)]
        os.environ.update(env or {})
        with open(path) as f:
            source = compile(f.read(), path, "exec")
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                exec(source, namespace)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if e.code is not None and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        lock_file = namespace.get("lock_file")
        if lock_file is not None and hasattr(lock_file, "close"):
            lock_file.close()
        namespace.clear()  # the script's functions hold its globals in a cycle: break it now, not at the next gc
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        for s, handler in saved_handlers.items():
            signal.signal(s, handler)
        torch.set_flush_denormal(False)  # train.py turns it on for the process
    return subprocess.CompletedProcess([sys.executable, path, *args], code, out.getvalue(), err.getvalue())
