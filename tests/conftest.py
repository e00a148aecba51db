import atexit
import os
import shutil
import tempfile

import torch

# Deterministic, single-threaded CPU math: equal results run to run, and each
# of the README command's two pytest-xdist workers keeps to one core.
torch.manual_seed(0)


def _state_host_figures() -> None:
    """This machine's host figures written to the suite's cache, as if measured
    (host-costs-v30, taken on the 2-core VM that runs the suite): the tests
    plan with them instead of calibrating, which cost one worker 25-50 s (its
    rounds doubled beside the other worker) while the other waited on its
    lock.  tests/test_calibration_noise.py measures for real, in folders of its own.
    Not written where the suite runs on a cache folder of the caller's
    (``AUTOSAC_CACHE_DIR`` set); ``AUTOSAC_REMEASURE=1`` measures anyway, and a
    process the tests start with another ``OMP_NUM_THREADS`` reads its own file."""
    from autosac.core.host import HostCosts
    from autosac.tools import calibrate
    from autosac.trace.timings import TimingCache

    stated = HostCosts(
        op_us=10.612, checkpoint_call_us=282.47, saved_tensor_us=18.279, selective_op_us=16.158,
        untimed_op_us=4.384, backward_op_us=7.25, backward_untimed_us=3.426, small_op_bytes=25203.0,
        large_op_bytes=778077.0, untimed_us_per_mib=143.285, backward_untimed_us_per_mib=97.254,
        selective_us_per_mib=99.059, largest_op_bytes=2097152.0, cold_read_us_per_mib=28.916,
        cast_hook_us=4.165, cast_remake_us=59.623, call_gap_us=12.63, state_item_us=0.2912, host_rng_us=170.0)
    calibrate._measured(TimingCache(), lambda: stated)

# ``target="cpu"`` timings are kept per machine; the suite keeps its own, in a temporary folder
# (made by the first process, which the xdist workers inherit it from, and removed when that one ends)
_OWN_CACHE = "AUTOSAC_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["AUTOSAC_CACHE_DIR"] = tempfile.mkdtemp(prefix="autosac-test-cache-")
    atexit.register(shutil.rmtree, os.environ["AUTOSAC_CACHE_DIR"], ignore_errors=True)
torch.set_num_threads(int(os.environ.get("AUTOSAC_TEST_THREADS", "1")))
# and so do the processes tests start (the command line, notebook kernels): two
# OpenMP threads each beside the other worker spin-wait, several times slower
os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("AUTOSAC_TEST_THREADS", "1"))
if _OWN_CACHE:  # the first process; after the threads are set (the cache is kept per thread count)
    _state_host_figures()
