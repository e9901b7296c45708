"""Run one of the repo's scripts (train.py, sample.py, ...) inside the test process.

A subprocess costs ~3 s on the test machines before the script's first line runs (importing torch alone is 2.2 s);
most tests run a script for a fraction of a second after that. run_script runs it here; fork_python runs it in a
child forked from this process (torch already imported), as a new python would: Started for tests that signal or
kill a run, python_forked for `python ARGS` in conftest.py's EARLY runner and the README's commands. Tests of what a
real process does at its own start and end (DDP, torch.compile's caches) still start a new one. In-process, forked and
subprocess runs give the same numbers: conftest.py sets the one thread that the tests' subprocesses use.
A script "-m lab.train" (or "-m lab.sample") runs the lesson's train.py (sample.py) with the lab's Lab as its LAB, as
the lab's entry point does.
"""

import atexit
import contextlib
import importlib
import io
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import torch
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def entry(script):
    """(the file to run, its sys.argv[0], its namespace) of a script: a file of the repo, or "-m lab.train" and
    "-m lab.sample", the lesson's script with the lab's Lab as its LAB."""
    module = script[len("-m "):] if script.startswith("-m ") else None
    path = os.path.join(ROOT, module.split(".")[-1] + ".py" if module else script)
    namespace = {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}
    if module:
        namespace["LAB"] = importlib.import_module(module).Lab()
    return path, script if module else path, namespace


def execute(path, namespace):
    """Run the script at path in namespace -> the exit code python would end with (exit_code)."""
    with open(path) as f:
        source = compile(f.read(), path, "exec")
    return exit_code(lambda: exec(source, namespace))


def exit_code(run):
    """Call run, a script's body -> the exit code python would end with: a sys.exit argument that is not a number
    printed to stderr (code 1), an uncaught exception's traceback printed (code 1)."""
    try:
        run()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    return 0


def run_script(script, *args, cwd=ROOT, env=None):
    """python <script> <args> in cwd, here -> subprocess.CompletedProcess (returncode, stdout, stderr), as
    subprocess.run(..., capture_output=True, text=True) gives it. env: variables set for the run, then put back."""
    path, argv0, namespace = entry(script)
    saved_cwd, saved_argv, saved_env = os.getcwd(), sys.argv, dict(os.environ)
    saved_handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    out, err = io.StringIO(), io.StringIO()
    # the script's globals (namespace): kept here so that what it leaves open (train.py's lock file) is closed below,
    # also when it ends by sys.exit
    try:
        os.chdir(cwd)
        sys.argv = [argv0, *map(str, args)]
        os.environ.update(env or {})
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = execute(path, namespace)
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


def fork_python(run, argv, cwd, environ, out, err):
    """Fork a child that runs run() (a script's body -> its exit code) as a new python would run the script: sys.argv
    argv, in cwd, with environ as its whole environment, the default SIGTERM and SIGINT handlers, none of this
    process's exit handlers but the script's own, its stdout and stderr to the open files out and err (one file for
    both: as a terminal shows them) -> the child's pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 1  # the child: leaves by os._exit, never back into pytest or the caller's loop
    try:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # not pytest's capture
        sys.stderr = sys.stdout if out is err else open(2, "w", buffering=1, closefd=False)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        atexit._clear()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in a new python until the script sets its own
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # a lock of its own for tqdm's progress lines: tqdm's default one is a semaphore shared with this process, and
        # a child killed while writing a line would leave it held, hanging the next run here for good
        tqdm.set_lock(threading.RLock())
        sys.argv = argv
        code = run()
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Started:
    """python <script> <args> in cwd, forked from this process (fork_python), its stdout and stderr to log (an open
    file): subprocess.Popen's pid, returncode, poll, wait, send_signal and kill, and log. env: variables added for
    it. A script "-m lab.train" runs through the module's own entry, as python -m runs it (runpy.run_module), with
    this process's sys.path."""

    def __init__(self, script, *args, cwd, log, env=None):
        self.log, self.returncode = log, None
        if script.startswith("-m "):
            def run():
                return exit_code(lambda: runpy.run_module(script[len("-m "):], run_name="__main__", alter_sys=True))
            argv0 = script  # run_module sets it to the module's file, as python -m does
        else:
            path, argv0, namespace = entry(script)

            def run():
                return execute(path, namespace)
        self.pid = fork_python(run, [argv0, *map(str, args)], cwd, {**os.environ, **(env or {})}, log, log)

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -signal when killed, as Popen's
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"{sys.executable} {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, signum):
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def run_forked(cmd, env):
    """lab.sweep_runs.Runs.run's (exit code, stderr) of `python -m lab.train ...` (cmd), the run forked from this
    process (Started) instead of a new python: for tests of what a sweep plans and reads of its runs, not of how it
    starts them (their stdout is in the stderr returned)."""
    assert cmd[:3] == [sys.executable, "-m", "lab.train"], cmd
    with tempfile.TemporaryFile("w+") as log:
        code = Started("-m lab.train", *cmd[3:], cwd=os.getcwd(), log=log, env=env).wait()
        log.seek(0)
        return code, log.read()


def python_forked(args, cwd, env, timeout, out, err):
    """`python ARGS` (a script or -m module and its arguments) in cwd with env, forked from this process
    (fork_python) with python's sys.path[0], its stdout and stderr to the open files out and err -> its exit code, or
    "timeout after N s" (it was killed)."""
    module = args[1] if args[0] == "-m" else None

    def run():
        sys.path[0] = cwd if module else os.path.dirname(os.path.abspath(args[0]))
        return exit_code(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True) if module
                         else runpy.run_path(args[0], run_name="__main__"))
    pid = fork_python(run, args[1:] if module else args, cwd, env, out, err)
    deadline = time.monotonic() + timeout
    while not (waited := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return f"timeout after {timeout} s"
        time.sleep(0.01)
    return os.waitstatus_to_exitcode(waited[1])


def block_calls_counted(module, stream, eager_backend=False):
    """Python source for `python -c`: the module (a script of this repo, as `python -m module` runs it) with a count of
    the blocks' calls that ran compiled and of those that did not, printed last on stream ("stdout" or "stderr"):
    is_compiling is True while dynamo traces, and the graph it captures adds 1 to the first tensor at every call (a
    counter that no guard reads). eager_backend: torch.compile with the eager backend, the same graphs without the
    compiler's time."""
    return f"""
import runpy, sys, torch, model
compiled, eager = torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)
forward = model.Block.forward
def counted(self, *args, **kwargs):
    (compiled if torch.compiler.is_compiling() else eager).add_(1)
    return forward(self, *args, **kwargs)
model.Block.forward = counted
if {eager_backend!r}:
    compile = torch.compile
    torch.compile = lambda *args, **options: compile(*args, **{{**options, "backend": "eager"}})
try:
    runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
finally:
    print(f"block calls: {{compiled.item()}} compiled, {{eager.item()}} not", file=sys.{stream}, flush=True)
"""
