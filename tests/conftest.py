import os
import sys

# the scripts are flat modules at the repo root, imported by the tests as they are
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
