import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from tqdm import tqdm

# the lesson's scripts are flat modules at the repo root and the lab a package beside them, imported by the tests as
# they are; tests/ holds the helpers every test file imports (scripts.py, hub_server.py), also those under tests/lab
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

# One thread per process, in this one and in the scripts the tests start: the models here are tiny, and on 2 shared
# cores a second thread only adds contention (and waits for the first at every op). In-process results then also
# match a subprocess's to the bit.
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
torch.set_num_threads(1)
# tqdm's monitor thread would be running when tests/scripts.py forks a run, and a child forked while it held tqdm's
# lock would wait for it forever at its first progress bar
tqdm.monitor_interval = 0


# Runs started when the session starts. Most of the suite runs in this one process, on one core; the few runs that
# need processes of their own for 10-30 s (gpu_check's dry run, compiled runs, a real sweep) run one after another on
# the other core meanwhile (beside the second process below), and their tests, moved to the end of the session,
# collect the results. A test file lists its own: EARLY = {test name: function of a private folder -> the command
# lines after `python`, run in the repo's root one after another until one fails}. A script or -m module runs in a
# child forked from the runner, which imported torch once for all of them (~2 s of CPU a run, tests/scripts.py's
# python_forked); a `-c` line in a new python (the allocator's test is of what a new process does).
_RUNNER = """
import json, os, subprocess, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from scripts import python_forked
del sys.path[0]
for folder, commands in json.loads(sys.argv[1]):
    with open(os.path.join(folder, "stdout.txt"), "w") as out, open(os.path.join(folder, "stderr.txt"), "w") as err:
        for command in commands:
            if command[0] == "-c":
                returncode = subprocess.run([sys.executable, *command], stdout=out, stderr=err).returncode
            else:
                returncode = python_forked(command, os.getcwd(), dict(os.environ), 600, out, err)
            if isinstance(returncode, str):  # the timeout
                print(returncode, file=err, flush=True)
                returncode = -9
            if returncode:
                break
    with open(os.path.join(folder, "returncode.part"), "w") as f:
        f.write(f"{returncode} {time.monotonic()}")
    os.replace(os.path.join(folder, "returncode.part"), os.path.join(folder, "returncode"))
"""
_early = {}  # node id -> (its folder, its command lines)
_runner = []  # the process that runs them
_runner_started = []  # when, by time.monotonic
_runner_ended = []  # seconds after that, once every run has ended
_second_ended = []  # the same of the tests in a second process


def _module_setting(item, name, default):
    """A setting of the test's module (EARLY, SECOND_PROCESS, ...), or default; the second process's items have none."""
    return getattr(getattr(item, "module", None), name, default)


def _early_commands(item):
    return _module_setting(item, "EARLY", {}).get(item.name)


# The tests of some modules run in a second pytest process, started with the session beside this one and the EARLY
# runner: a module whose tests leave their process changed for good (LEAVES_THE_PROCESS_CHANGED: vLLM's engine run in
# it), there after the others, and modules of seconds of computing that move there to keep the two cores equally busy
# (SECOND_PROCESS). Here each of their tests is an item that waits for that process and reports what the test did
# there.
_SECOND = "DEEPLOOP_TESTS_REPORT"  # set in that process: the file its tests' reports go to, a JSON line each
_second = []  # [the process, its reports' file, its output's file, when it started], once started


def _leaves_the_process_changed(item):
    return _module_setting(item, "LEAVES_THE_PROCESS_CHANGED", False)


def _in_second_process(item):
    return _SECOND not in os.environ and (_leaves_the_process_changed(item) or
                                          _module_setting(item, "SECOND_PROCESS", False))


class InSecondProcess(pytest.Item):
    def runtest(self):
        process, reports, output, _ = _second
        try:
            process.wait(timeout=600)
        except subprocess.TimeoutExpired:
            pytest.fail("the second pytest process still running after 10 minutes", pytrace=False)
        mine = [json.loads(line) for line in reports.read_text().splitlines()]
        mine = [r for r in mine if r["nodeid"] == self.nodeid]
        if not any(r["when"] == "call" or r["outcome"] != "passed" for r in mine):  # a crash ends it before its call
            pytest.fail(f"the second pytest process (exit {process.returncode}) did not run this test to its end:\n"
                        f"{output.read_text()[-3000:]}", pytrace=False)
        for r in mine:
            if r["outcome"] == "failed":
                pytest.fail(f"in the second pytest process, at {r['when']}:\n{r['text']}", pytrace=False)
        for r in mine:
            if r["outcome"] == "skipped":
                pytest.skip(r["text"])

    def reportinfo(self):
        return self.path, None, self.name


@pytest.hookimpl(trylast=True)  # after -k and -m deselected theirs
def pytest_collection_modifyitems(items):
    items[:] = [InSecondProcess.from_parent(item.parent, name=item.name) if _in_second_process(item) else item
                for item in items]
    # stable: the tests that wait for another process go last, and those that leave the process changed after all
    items.sort(key=lambda item: (_leaves_the_process_changed(item),
                                 isinstance(item, InSecondProcess) or _early_commands(item) is not None))


def pytest_runtest_logreport(report):
    if _SECOND in os.environ:
        skip = report.skipped and isinstance(report.longrepr, tuple)
        with open(os.environ[_SECOND], "a") as f:
            f.write(json.dumps(dict(nodeid=report.nodeid, when=report.when, outcome=report.outcome,
                                    text=report.longrepr[2] if skip else report.longreprtext,
                                    at=time.monotonic())) + "\n")


def pytest_collection_finish(session):
    if second := [item.nodeid for item in session.items if isinstance(item, InSecondProcess)]:
        folder = Path(tempfile.mkdtemp(prefix="deeploop-second-"))
        reports, output = folder / "reports.jsonl", folder / "output.txt"
        reports.touch()
        with open(output, "w") as out:
            process = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *second],
                                       cwd=session.config.rootpath, stdout=out, stderr=subprocess.STDOUT,
                                       env=dict(os.environ, **{_SECOND: str(reports)}), start_new_session=True)
        _second.extend([process, reports, output, time.monotonic()])
    for item in session.items:
        if _early_commands(item):
            folder = Path(tempfile.mkdtemp(prefix="deeploop-early-"))
            _early[item.nodeid] = (folder, _early_commands(item)(folder))
    if _early:
        from prepare_data import prepare_builtin_if_missing
        cwd = os.getcwd()
        os.chdir(ROOT)
        prepare_builtin_if_missing("builtin_bytes")  # here, once: the runs below would all start preparing it
        os.chdir(cwd)
        jobs = json.dumps([(str(folder), [[str(arg) for arg in command] for command in commands])
                           for folder, commands in _early.values()])
        _runner.append(subprocess.Popen([sys.executable, "-c", _RUNNER, jobs], cwd=ROOT, start_new_session=True))
        _runner_started.append(time.monotonic())


def pytest_terminal_summary(terminalreporter):
    # the suite lasts as long as the longest of this process, the runner and the second process: their
    # ends, beside pytest's total, show which to move tests off
    if _runner_ended:
        terminalreporter.write_line(f"EARLY runs: those of {len(_early)} tests ended {_runner_ended[0]:.0f} s after "
                                    f"the session started them")
    if _second_ended:
        terminalreporter.write_line(f"The tests in a second process ended {_second_ended[0]:.0f} s after the session "
                                    f"started it")


@pytest.fixture
def early(request):
    """(this test's EARLY runs as subprocess.run returns them: the last one's exit code, everything they wrote; the
    runs' private folder), once the runs have ended."""
    folder, commands = _early[request.node.nodeid]
    deadline = time.monotonic() + 600
    while not (folder / "returncode").exists():
        assert _runner[0].poll() is None, f"the session's runner of EARLY runs ended with {_runner[0].returncode}"
        assert time.monotonic() < deadline, "EARLY runs still running after 10 minutes"
        time.sleep(0.05)
    return subprocess.CompletedProcess(commands, int((folder / "returncode").read_text().split()[0]),
                                       (folder / "stdout.txt").read_text(), (folder / "stderr.txt").read_text()), folder


def pytest_sessionfinish(session):
    ended = [float((folder / "returncode").read_text().split()[1]) for folder, _ in _early.values()
             if (folder / "returncode").exists()]
    if _runner_started and len(ended) == len(_early):
        _runner_ended.append(max(ended) - _runner_started[0])
    for process in _runner + _second[:1]:
        if process.returncode is None:  # not reaped yet: its group still exists
            os.killpg(process.pid, signal.SIGKILL)  # and the run it is at, if the session ends first
        process.wait()
    if _second:
        if reports := _second[1].read_text().splitlines():
            _second_ended.append(json.loads(reports[-1])["at"] - _second[3])
        shutil.rmtree(_second[1].parent, ignore_errors=True)
    for folder, _ in _early.values():
        shutil.rmtree(folder, ignore_errors=True)
