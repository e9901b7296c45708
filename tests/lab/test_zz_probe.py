import os, torch, threading, sys
def test_probe():
    print("\nthreads", torch.get_num_threads(), torch.get_num_interop_threads(), "prec", torch.get_float32_matmul_precision(), "mkldnn", torch.backends.mkldnn.enabled, getattr(torch.backends.mkldnn, "matmul", None) and torch.backends.mkldnn.matmul.fp32_precision, "deterministic", torch.are_deterministic_algorithms_enabled())
    print("alive threads", [t.name for t in threading.enumerate()], "numba" in sys.modules)
    print("affinity", os.sched_getaffinity(0), "dtype", torch.get_default_dtype())
