"""autosac never hangs: an in-place op that writes a view used to deadlock the
trace on autograd's own lock (no signal ended it).  Every case that could hang
runs in a child process with a deadline, so a regression fails instead of
stalling the suite; the plans then hold as every plan must (bitwise step,
measured peak within budget, predicted within 3 %)."""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from suite import check_model, seeded
from torch import nn

DEADLINE_S = 120

# in-place writes into a view: the 3-D linear output is a view of its matmul's
_CASES = textwrap.dedent("""
    import torch
    from torch import nn
    import autosac

    class MulInPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            h = self.a(x)
            h.mul_(2)
            return self.b(h)

    relu = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 8))
    for model in (relu, MulInPlace()):
        autosac.profile(model, (torch.randn(2, 3, 8),), target="cpu")
        print("profiled", type(model).__name__, flush=True)
""")

_SWIN = textwrap.dedent("""
    import torch, transformers, autosac
    cfg = transformers.Swinv2Config(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                    window_size=4, num_labels=3)
    model = transformers.Swinv2ForImageClassification(cfg).train()
    autosac.profile(model, {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([0, 2])}, target="cpu")
    print("profiled Swinv2", flush=True)
""")


def _run(code: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"autosac.profile did not return within {DEADLINE_S} s (hang)")


def test_inplace_op_on_a_view_profiles_without_hanging():
    done = _run(_CASES)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["profiled", "Sequential", "profiled", "MulInPlace"]


def test_swinv2_position_bias_mlp_profiles_without_hanging():
    pytest.importorskip("transformers")
    done = _run(_SWIN)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "profiled Swinv2" in done.stdout


def _stderr_after_ctrl_c(code: str, what: str, wait_s: float) -> str:
    """Run ``code`` in a child process that prints "started" when it begins
    its work, send it SIGINT ``wait_s`` seconds later, and return its stderr;
    a child still running 30 s after the signal fails the test (and is killed)
    with the stacks of its threads where it was (faulthandler, on SIGUSR1)."""
    # Ctrl-C as in a terminal: a child inherits an ignored SIGINT (some library in the test process may
    # have set it so: in one CI run both Ctrl-C tests waited out their 30 s), and Python then keeps it ignored
    code = ("import faulthandler, signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "faulthandler.register(signal.SIGUSR1, all_threads=True)\n" + code)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        time.sleep(wait_s)
        proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # where it is stuck, on its stderr
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGKILL)
        err = proc.communicate()[1]
        pytest.fail(f"{what} did not stop within 30 s of Ctrl-C; its stacks then:\n{err[-4000:]}")
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_ctrl_c_ends_profiling_promptly():
    """SIGINT reaches a profile in progress as KeyboardInterrupt (the old hang
    sat in a C++ mutex, where no signal handler runs)."""
    head, loop = _CASES.split("for model in ")
    code = head + "print('started', flush=True)\nwhile True:\n    for model in " + textwrap.indent(loop, "    ").lstrip()
    err = _stderr_after_ctrl_c(code, "a profile", wait_s=3)  # inside the profiling loop by now
    assert "KeyboardInterrupt" in err, err[-2000:]


class _ViewWrite(nn.Module):
    """A linear on a 3-D input (its output a view) written in place, twice."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(64, 256), nn.ReLU(inplace=True), nn.Linear(256, 64)

    def forward(self, x):
        h = self.fc1(x)
        h.mul_(0.5)
        return x + self.fc2(self.act(h))


def test_plans_of_a_model_writing_views_in_place_hold():
    """Exact to the byte at the least budget, the number ``mul_(0.5)`` keeps
    inside autograd's ``CopySlices`` counted (16 bytes over without it)."""
    build = seeded(lambda: (nn.Sequential(*[_ViewWrite() for _ in range(4)]), torch.randn(32, 64, 64)))
    faulthandler.dump_traceback_later(DEADLINE_S, exit=True)  # a hang ends the worker, not the suite
    try:
        rows = check_model("view-write", build, target="cpu", labels=("least",), tolerance=0)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert [(r.bitwise, r.predicted) for r in rows] == [(True, rows[0].measured)]


_HARD_MILP = textwrap.dedent("""
    import numpy as np
    from scipy import sparse
    from autosac.solver.backends import solve_highs
    from autosac.solver.milp import MatrixMILP

    rng = np.random.default_rng(0)
    n, m = 300, 150  # a random multi-dimensional knapsack: HiGHS runs out a 60 s limit on it
    A = rng.integers(1, 100, (m, n)).astype(float)
    milp = MatrixMILP(c=-rng.integers(1, 100, n).astype(float), A=sparse.csr_matrix(A), row_lo=np.full(m, -np.inf),
                      row_hi=A.sum(1) // 2, lb=np.zeros(n), ub=np.ones(n), integer=np.ones(n), z_index=[], peak_col=None)
    print("started", flush=True)
    solve_highs(milp, time_limit_s=60)
""")


def test_ctrl_c_ends_a_highs_solve_promptly():
    """HiGHS checks no signals: without the worker thread Ctrl-C waited out the time limit."""
    err = _stderr_after_ctrl_c(_HARD_MILP, "a HiGHS solve", wait_s=2)
    assert "KeyboardInterrupt" in err, err[-2000:]
