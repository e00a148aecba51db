import atexit
import os
import shutil
import tempfile

import torch

# Deterministic, single-threaded CPU math: equal results run to run, and each
# of the README command's two pytest-xdist workers keeps to one core.
torch.manual_seed(0)
# ``target="cpu"`` timings are kept per machine; the suite keeps its own, in a temporary folder
# (made by the first process, which the xdist workers inherit it from, and removed when that one ends)
if "AUTOSAC_CACHE_DIR" not in os.environ:
    os.environ["AUTOSAC_CACHE_DIR"] = tempfile.mkdtemp(prefix="autosac-test-cache-")
    atexit.register(shutil.rmtree, os.environ["AUTOSAC_CACHE_DIR"], ignore_errors=True)
torch.set_num_threads(int(os.environ.get("AUTOSAC_TEST_THREADS", "1")))
# and so do the processes tests start (the command line, notebook kernels): two
# OpenMP threads each beside the other worker spin-wait, several times slower
os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("AUTOSAC_TEST_THREADS", "1"))
