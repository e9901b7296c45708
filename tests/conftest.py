import os
import sys

import torch

# the scripts are flat modules at the repo root, imported by the tests as they are
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# One thread per process, in this one and in the scripts the tests start: the models here are tiny, and on 2 shared
# cores a second thread only adds contention (and waits for the first at every op). In-process results then also
# match a subprocess's to the bit.
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
torch.set_num_threads(1)
