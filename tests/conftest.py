import os
import sys

import pytest
import torch
from tqdm import tqdm

# the scripts are flat modules at the repo root, imported by the tests as they are
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# One thread per process, in this one and in the scripts the tests start: the models here are tiny, and on 2 shared
# cores a second thread only adds contention (and waits for the first at every op). In-process results then also
# match a subprocess's to the bit.
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
torch.set_num_threads(1)
# tqdm's monitor thread would be running when tests/scripts.py forks a run, and a child forked while it held tqdm's
# lock would wait for it forever at its first progress bar
tqdm.monitor_interval = 0


@pytest.fixture(scope="session")
def builtin_bytes(tmp_path_factory):
    """data/builtin_bytes prepared once for all tests (~3 s each time): a test links it into the folder it runs in."""
    from prepare_data import prepare
    out_dir = tmp_path_factory.mktemp("builtin") / "builtin_bytes"
    prepare("builtin", tokenizer="bytes", out_dir=str(out_dir), quiet=True)
    return out_dir
