"""The MILP in matrix form, shared by both backends so they solve the same problem.

Variables: ``z[i,k]`` binary -- candidate ``i`` takes discard choice ``k`` --
and, for the least-peak problem, one continuous peak ``P``.

* at most one choice per root-to-leaf path (nothing checkpointed inside a
  checkpointed module): one row per leaf candidate over its ancestors, O(n * depth);
* memory: the timeline is cut where any candidate's savings start or end, so
  inside a segment the set of modules whose savings apply is fixed; each segment
  whose traced peak exceeds the budget needs ``sum of covering savings >= peak - budget``.
  A segment row is dropped when another row asks at least as much of a subset
  of its modules (it is implied), which leaves few rows: a covering row per
  distinct requirement, each an explicit knapsack the solvers can cut on;
* recomputation: at each candidate's backward start, its transient working
  memory must fit beside what the other checkpoints still save;
* objective: total recompute ms (or the peak ``P``).

Memory is in MiB inside the matrix to keep coefficients well scaled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import sparse

from autosac.solver.problem import Problem

MIB = float(1 << 20)


@dataclass
class MatrixMILP:
    c: np.ndarray
    A: sparse.csr_matrix
    row_lo: np.ndarray
    row_hi: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    integer: np.ndarray  # 1 for binaries
    z_index: list[list[int]]  # candidate -> column per choice
    peak_col: int | None  # least-peak mode: the column of the peak variable


@dataclass
class _Need:
    cover: int  # bitmask of candidates whose savings apply
    bytes: float  # traced live bytes there (segment peak, or live + work at a recompute)
    work_of: int | None  # candidate whose recompute working memory adds here


def _needs(problem: Problem) -> list[_Need]:
    n = len(problem.live)
    cands = problem.candidates
    cuts = sorted({0, n, *(c.start for c in cands), *(c.end for c in cands if c.end <= n)})
    starts = np.array(cuts[:-1], dtype=np.int64)
    peaks = np.maximum.reduceat(problem.live, starts) if n else np.zeros(0)
    # coverage per segment by sweeping interval starts and ends
    opening: dict[int, int] = {}
    closing: dict[int, int] = {}
    for i, c in enumerate(cands):
        opening[c.start] = opening.get(c.start, 0) | (1 << i)
        closing[c.end] = closing.get(c.end, 0) | (1 << i)
    needs, cover, cover_at = [], 0, {}
    for j, s in enumerate(starts):
        cover = (cover | opening.get(int(s), 0)) & ~closing.get(int(s), 0)
        cover_at[int(s)] = cover
        needs.append(_Need(cover, float(peaks[j]), None))
    for i, c in enumerate(cands):
        if c.work_bytes > 0 and c.end < n:
            needs.append(_Need(cover_at[c.end], float(problem.live[c.end] + c.work_bytes), i))
    return needs


def _prune(needs: list[_Need], floor: float) -> list[_Need]:
    """Keep needs above ``floor`` that no other kept need implies."""
    live = [nd for nd in needs if nd.bytes > floor]
    live.sort(key=lambda nd: (bin(nd.cover).count("1"), -nd.bytes))
    kept: list[_Need] = []
    for nd in live:
        implied = nd.work_of is None and any(
            k.work_of is None and k.bytes >= nd.bytes and (k.cover & ~nd.cover) == 0 for k in kept
        )
        if not implied:
            kept.append(nd)
    return kept


def milp_needs(problem: Problem, budget_bytes: int) -> list[_Need]:
    """The memory rows of the budgeted MILP (as needs), for the chain solver."""
    return _prune(_needs(problem), float(budget_bytes))


def build_milp(problem: Problem, budget_bytes: int | None) -> MatrixMILP:
    """The budgeted problem, or with ``budget_bytes=None`` the least-peak problem
    (minimise a peak variable ``P`` that stands in for the budget)."""
    cands = problem.candidates
    z_index, col = [], 0
    for c in cands:
        z_index.append(list(range(col, col + len(c.bytes))))
        col += len(c.bytes)
    n_z = col
    least_peak = budget_bytes is None
    n_cols = n_z + (1 if least_peak else 0)
    peak_col = n_z if least_peak else None

    rows, cols, vals, lo, hi = [], [], [], [], []

    def add(entries, low, high):
        r = len(lo)
        for cidx, v in entries:
            rows.append(r)
            cols.append(cidx)
            vals.append(v)
        lo.append(low)
        hi.append(high)

    # one choice per root-to-leaf path
    has_child = {a for c in cands for a in c.ancestors}
    for i, c in enumerate(cands):
        members = [i] if i in has_child else [i, *c.ancestors]
        add([(zc, 1.0) for k in members for zc in z_index[k]], -np.inf, 1.0)

    # memory: savings of the covering candidates (less the recomputing one's work) >= live - budget
    floor = -np.inf if least_peak else float(budget_bytes)
    for nd in _prune(_needs(problem), floor):
        entries = [(zc, b / MIB) for i in _bits(nd.cover) for zc, b in zip(z_index[i], cands[i].bytes)]
        if nd.work_of is not None:
            entries += [(zc, -cands[nd.work_of].work_bytes / MIB) for zc in z_index[nd.work_of]]
            base = float(problem.live[cands[nd.work_of].end])
        else:
            base = nd.bytes
        if least_peak:
            add(entries + [(peak_col, 1.0)], base / MIB, np.inf)
        else:
            add(entries, (base - budget_bytes) / MIB, np.inf)

    lb = np.zeros(n_cols)
    ub = np.ones(n_cols)
    c_vec = np.zeros(n_cols)
    if least_peak:
        ub[peak_col] = np.inf
        c_vec[peak_col] = 1.0
    else:
        for i, cand in enumerate(cands):
            c_vec[z_index[i]] = cand.ms
    integer = np.zeros(n_cols, dtype=np.int8)
    integer[:n_z] = 1
    A = sparse.csr_matrix((vals, (rows, cols)), shape=(len(lo), n_cols))
    return MatrixMILP(c_vec, A, np.array(lo), np.array(hi), lb, ub, integer, z_index, peak_col)


def with_objective_bound(m: MatrixMILP, lower: float) -> MatrixMILP:
    """``m`` plus the row ``objective >= lower`` (a bound proven elsewhere)."""
    A = sparse.vstack([m.A, sparse.csr_matrix(m.c)]).tocsr()
    return MatrixMILP(m.c, A, np.append(m.row_lo, lower), np.append(m.row_hi, np.inf), m.lb, m.ub,
                      m.integer, m.z_index, m.peak_col)


def encode(m: MatrixMILP, choice: dict[int, int]) -> np.ndarray:
    """The solution vector of a choice (the inverse of :func:`decode`)."""
    x = np.zeros(len(m.c))
    for i, k in choice.items():
        x[m.z_index[i][k - 1]] = 1.0
    return x


def _bits(mask: int):
    i = 0
    while mask:
        if mask & 1:
            yield i
        mask >>= 1
        i += 1


def decode(milp: MatrixMILP, x: np.ndarray) -> dict[int, int]:
    """Candidate index -> chosen choice (1-based) from a solution vector."""
    choice = {}
    for i, cols in enumerate(milp.z_index):
        for k, zc in enumerate(cols):
            if x[zc] > 0.5:
                choice[i] = k + 1
    return choice
