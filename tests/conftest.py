import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from tqdm import tqdm

# the scripts are flat modules at the repo root, imported by the tests as they are
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# One thread per process, in this one and in the scripts the tests start: the models here are tiny, and on 2 shared
# cores a second thread only adds contention (and waits for the first at every op). In-process results then also
# match a subprocess's to the bit.
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
torch.set_num_threads(1)
# tqdm's monitor thread would be running when tests/scripts.py forks a run, and a child forked while it held tqdm's
# lock would wait for it forever at its first progress bar
tqdm.monitor_interval = 0


# Runs started when the session starts. The suite runs in this one process, on one core; the few runs that need
# processes of their own for 10-30 s (gpu_check's dry run, a compiled bench, a real sweep) start at once on the other
# core, and their tests collect the results when they come to them. A test file lists its own: EARLY = {test name:
# function of a private folder -> the command line after `python`, run in the repo's root}.
_early = {}  # node id -> (Popen, its folder, stdout file, stderr file)


def pytest_collection_finish(session):
    starts = [(item.nodeid, getattr(item.module, "EARLY", {}).get(item.name)) for item in session.items]
    starts = [(nodeid, command) for nodeid, command in starts if command]
    if starts:
        from prepare_data import prepare_builtin_if_missing
        cwd = os.getcwd()
        os.chdir(ROOT)
        prepare_builtin_if_missing("builtin_bytes")  # here, once: the runs below would all start preparing it
        os.chdir(cwd)
    for nodeid, command in starts:
        folder = Path(tempfile.mkdtemp(prefix="deeploop-early-"))
        out, err = open(folder / "stdout.txt", "w+"), open(folder / "stderr.txt", "w+")
        proc = subprocess.Popen([sys.executable, *command(folder)], cwd=ROOT, stdout=out, stderr=err, text=True)
        _early[nodeid] = (proc, folder, out, err)


@pytest.fixture
def early(request):
    """(this test's EARLY run as subprocess.run returns it, the run's private folder), once the run has ended."""
    proc, folder, out, err = _early[request.node.nodeid]
    proc.wait(timeout=600)
    out.seek(0)
    err.seek(0)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read()), folder


def pytest_sessionfinish(session):
    for proc, folder, out, err in _early.values():
        proc.kill()
        proc.wait()
        out.close()
        err.close()
        shutil.rmtree(folder, ignore_errors=True)
