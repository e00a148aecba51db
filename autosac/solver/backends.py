"""Two MILP backends over the same matrix: CBC through PuLP, and HiGHS through SciPy.

``solver="auto"`` (the default) is CBC where PuLP has one, else HiGHS with a
note: PuLP 4 (what pip picks on Python >= 3.12 without autosac's ``pulp<4``
bound) bundles no CBC and changed the API used here.  An explicit
``solver="cbc"`` without CBC is one line naming the fix.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass

import numpy as np

from autosac.core.errors import MissingExtraError
from autosac.solver.milp import MatrixMILP

GAP = 1e-4


@dataclass
class Solution:
    x: np.ndarray | None  # None: no feasible point found
    status: str  # optimal | time_limit | infeasible | error
    objective: float
    bound: float  # best proven lower bound on the objective
    gap: float  # relative gap between objective and bound
    seconds: float
    backend: str


def _gap(obj: float, bound: float) -> float:
    if not math.isfinite(obj) or not math.isfinite(bound):
        return math.inf
    return max(0.0, obj - bound) / max(abs(obj), 1e-9)


def interruptible(fn):
    """``fn()`` on a worker thread, this one waiting in short joins: HiGHS
    checks no signals (it runs without the GIL), so Ctrl-C would otherwise wait
    out the solve's time limit.  The interrupted solve ends with its limit."""
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, name="autosac-highs", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.05)
    if "error" in box:
        raise box["error"]
    return box["out"]


def solve_highs(m: MatrixMILP, time_limit_s: float, start: np.ndarray | None = None) -> Solution:
    # SciPy's HiGHS interface takes no starting solution; ``start`` is accepted for symmetry.
    from scipy.optimize import Bounds, LinearConstraint, milp

    t0 = time.perf_counter()
    res = interruptible(lambda: milp(
        m.c,
        integrality=m.integer,
        bounds=Bounds(m.lb, m.ub),
        constraints=[LinearConstraint(m.A, m.row_lo, m.row_hi)] if m.A.shape[0] else [],
        options={"time_limit": float(time_limit_s), "mip_rel_gap": GAP, "disp": False},
    ))
    dt = time.perf_counter() - t0
    if res.x is None:
        status = "infeasible" if res.status == 2 else ("time_limit" if res.status == 1 else "error")
        return Solution(None, status, math.inf, math.nan, math.inf, dt, "highs")
    obj = float(m.c @ res.x)
    bound = float(res.mip_dual_bound) if res.mip_dual_bound is not None else obj
    status = "optimal" if res.status == 0 else "time_limit"
    return Solution(res.x, status, obj, bound, _gap(obj, bound), dt, "highs")


def solve_cbc(m: MatrixMILP, time_limit_s: float, start: np.ndarray | None = None) -> Solution:
    import pulp

    check_cbc()
    t0 = time.perf_counter()
    prob = pulp.LpProblem("autosac", pulp.LpMinimize)
    xs = []
    for j in range(len(m.c)):
        cat = pulp.LpBinary if m.integer[j] and m.ub[j] == 1 and m.lb[j] == 0 else pulp.LpContinuous
        ub = None if math.isinf(m.ub[j]) else float(m.ub[j])
        xs.append(prob.add_variable(f"x{j}", lowBound=float(m.lb[j]), upBound=ub, cat=cat))
    prob += pulp.LpAffineExpression([(xs[j], float(v)) for j, v in enumerate(m.c) if v != 0.0]) + 0.0
    A = m.A.tocsr()
    for r in range(A.shape[0]):
        lo_i, hi_i = A.indptr[r], A.indptr[r + 1]
        expr = pulp.LpAffineExpression([(xs[j], float(v)) for j, v in zip(A.indices[lo_i:hi_i], A.data[lo_i:hi_i])])
        lo, hi = m.row_lo[r], m.row_hi[r]
        if lo == hi:
            prob += expr == float(lo)
        else:
            if math.isfinite(lo):
                prob += expr >= float(lo)
            if math.isfinite(hi):
                prob += expr <= float(hi)
    if start is not None:
        for v, val in zip(xs, start):
            v.setInitialValue(float(val))
    fd, log = tempfile.mkstemp(suffix=".log")
    os.close(fd)
    try:
        prob.solve(_cbc_command(time_limit_s, log, warm=start is not None))
        with open(log) as f:
            text = f.read()
    finally:
        os.unlink(log)
    dt = time.perf_counter() - t0
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        status = "infeasible" if prob.status == pulp.LpStatusInfeasible else (
            "time_limit" if "time limit" in text.lower() or "Stopped" in text else "error")
        return Solution(None, status, math.inf, math.nan, math.inf, dt, "cbc")
    x = np.array([v.value() or 0.0 for v in xs])
    obj = float(m.c @ x)
    bound = _cbc_bound(text, obj)
    status = "optimal" if prob.sol_status == pulp.LpSolutionOptimal and "Stopped on time" not in text else "time_limit"
    return Solution(x, status, obj, bound, _gap(obj, bound), dt, "cbc")


def _cbc_command(time_limit_s: float, log: str, warm: bool = False):
    """A system CBC if one is installed, else the binary PuLP 3 bundles; None if neither is there."""
    import pulp

    opts = dict(msg=False, timeLimit=time_limit_s, gapRel=GAP, threads=1, logPath=log, warmStart=warm)
    coin = pulp.COIN_CMD(**opts)
    if coin.available():
        return coin
    bundled = getattr(pulp, "PULP_CBC_CMD", None)  # gone in PuLP 4
    if bundled is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3.x flags its bundled CBC for 4.0
        cmd = bundled(**opts)
    return cmd if cmd.available() else None


def cbc_missing() -> tuple[str, str] | None:
    """Why CBC through PuLP cannot run here and how to get it, or None when it can."""
    try:
        import pulp
    except ImportError:
        return "PuLP is not installed", _PIP
    version = getattr(pulp, "__version__", "?")
    if not hasattr(pulp, "LpSolutionOptimal") or not hasattr(pulp.LpProblem, "add_variable"):
        return f"autosac runs CBC through PuLP 3.3.1 up to 4, and PuLP {version} is installed", _PIP
    if _cbc_command(1.0, os.devnull) is None:
        return (f"PuLP {version} finds no CBC binary (none bundled for this platform, none on PATH)",
                "put a cbc binary on PATH (e.g. apt install coinor-cbc)")
    return None


_PIP = "pip install 'pulp>=3.3.1,<4' (PuLP 3 bundles CBC)"


def check_cbc() -> None:
    """Raises MissingExtraError (one line naming the fix) where solver='cbc' cannot run."""
    missing = cbc_missing()
    if missing is not None:
        why, fix = missing
        raise MissingExtraError(f"solver='cbc' cannot run: {why}: {fix}, or pass solver='highs' (the same optimum)")


def resolve_solver(solver: str) -> str:
    """The backend that runs for ``solver``: ``"auto"`` is CBC where PuLP has
    one, else HiGHS (with a note); an explicit ``"cbc"`` must have CBC."""
    if solver == "cbc":
        check_cbc()
    if solver != "auto":
        return solver
    missing = cbc_missing()
    if missing is None:
        return "cbc"
    why, fix = missing
    warnings.warn(f"autosac: solving with HiGHS (SciPy) in place of CBC: {why}; for CBC, {fix}",
                  UserWarning, stacklevel=2)
    return "highs"


def _cbc_bound(log: str, obj: float) -> float:
    """CBC's best bound from its log ("Lower bound:"), the objective when it closed the tree."""
    m = re.findall(r"Lower bound:\s+([-0-9.eE+]+)", log)
    if m:
        return float(m[-1])
    return obj


BACKENDS = {"cbc": solve_cbc, "highs": solve_highs}
SOLVERS = ("auto", *BACKENDS)  # what solver= accepts
