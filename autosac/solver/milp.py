"""The MILP in matrix form, shared by both backends so they solve the same problem.

Variables: ``z[i,k]`` binary (candidate ``i`` takes discard choice ``k``), and
one continuous ``S[j]`` per timeline segment: the bytes checkpointing frees in
segment ``j``.  Segments are the stretches between consecutive interval ends,
so the set of modules whose savings apply is constant inside each; ``S`` is
carried from one segment to the next by adding the savings that start and
subtracting those that end -- each ``z`` appears in two such rows, so the
matrix stays linear in the model size instead of quadratic.

* at most one choice per candidate, and one checkpointed module per root-to-leaf path;
* every segment: ``peak(segment) - S[j] <= budget`` (a lower bound on ``S[j]``);
* every candidate's recomputation: ``live + work * y_i - S <= budget``;
* objective: total recompute ms.

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
    peak_col: int | None  # min-peak mode: the column of the peak variable


def _segments(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    n = len(problem.live)
    cuts = {0, n}
    for c in problem.candidates:
        cuts.update((c.start, c.end))
    bounds = np.array(sorted(x for x in cuts if 0 <= x <= n))
    starts = bounds[:-1]
    peaks = np.maximum.reduceat(problem.live, starts) if n else np.zeros(0)
    return starts, peaks


def build_milp(problem: Problem, budget_bytes: int | None) -> MatrixMILP:
    """The budgeted problem, or with ``budget_bytes=None`` the least-peak problem
    (minimise a peak variable ``P`` that replaces the budget)."""
    cands = problem.candidates
    starts, peaks = _segments(problem)
    seg_of = {int(s): j for j, s in enumerate(starts)}
    z_index, col = [], 0
    for c in cands:
        z_index.append(list(range(col, col + len(c.bytes))))
        col += len(c.bytes)
    n_z = col
    s_col = n_z  # S[j] at s_col + j
    n_cols = n_z + len(starts) + (1 if budget_bytes is None else 0)
    peak_col = n_cols - 1 if budget_bytes is None else None

    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0

    def add(entries, low, high):
        nonlocal r
        for cidx, v in entries:
            rows.append(r)
            cols.append(cidx)
            vals.append(v)
        lo.append(low)
        hi.append(high)
        r += 1

    # S chain: S[j] - S[j-1] - (savings starting at j) + (savings ending at j) = 0
    starting: dict[int, list[int]] = {}
    ending: dict[int, list[int]] = {}
    for i, c in enumerate(cands):
        starting.setdefault(seg_of[c.start], []).append(i)
        if c.end in seg_of:  # savings that last to the step's end never need subtracting
            ending.setdefault(seg_of[c.end], []).append(i)
    for j in range(len(starts)):
        entries = [(s_col + j, 1.0)]
        if j > 0:
            entries.append((s_col + j - 1, -1.0))
        for i in starting.get(j, ()):
            entries += [(zc, -b / MIB) for zc, b in zip(z_index[i], cands[i].bytes)]
        for i in ending.get(j, ()):
            entries += [(zc, b / MIB) for zc, b in zip(z_index[i], cands[i].bytes)]
        add(entries, 0.0, 0.0)

    # one choice per candidate and per root-to-leaf path
    has_child = {a for c in cands for a in c.ancestors}
    for i, c in enumerate(cands):
        if i in has_child:
            continue
        entries = [(zc, 1.0) for k in [i, *c.ancestors] for zc in z_index[k]]
        add(entries, -np.inf, 1.0)
    for i in has_child:
        add([(zc, 1.0) for zc in z_index[i]], -np.inf, 1.0)

    # recomputation working memory at each candidate's backward start
    for i, c in enumerate(cands):
        if c.work_bytes <= 0 or c.end not in seg_of:
            continue
        j = seg_of[c.end]
        base = float(problem.live[c.end]) / MIB
        entries = [(zc, c.work_bytes / MIB) for zc in z_index[i]] + [(s_col + j, -1.0)]
        if budget_bytes is None:
            add(entries + [(peak_col, -1.0)], -np.inf, -base)
        else:
            add(entries, -np.inf, budget_bytes / MIB - base)

    lb = np.zeros(n_cols)
    ub = np.full(n_cols, np.inf)
    ub[:n_z] = 1.0
    if budget_bytes is None:
        for j, m in enumerate(peaks):
            add([(s_col + j, 1.0), (peak_col, 1.0)], float(m) / MIB, np.inf)
    else:
        lb[s_col : s_col + len(starts)] = np.maximum(0.0, (peaks - budget_bytes) / MIB)

    c_vec = np.zeros(n_cols)
    if budget_bytes is None:
        c_vec[peak_col] = 1.0
    else:
        for i, cand in enumerate(cands):
            c_vec[z_index[i]] = cand.ms
    integer = np.zeros(n_cols, dtype=np.int8)
    integer[:n_z] = 1
    A = sparse.csr_matrix((vals, (rows, cols)), shape=(r, n_cols))
    return MatrixMILP(c_vec, A, np.array(lo), np.array(hi), lb, ub, integer, z_index, peak_col)


def decode(milp: MatrixMILP, x: np.ndarray) -> dict[int, int]:
    """Candidate index -> chosen choice (1-based) from a solution vector."""
    choice = {}
    for i, cols in enumerate(milp.z_index):
        for k, zc in enumerate(cols):
            if x[zc] > 0.5:
                choice[i] = k + 1
    return choice
