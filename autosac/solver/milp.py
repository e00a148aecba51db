"""The MILP in matrix form, shared by both backends so they solve the same problem.

Variables: ``z[i,k]`` binary -- candidate ``i`` takes discard choice ``k`` --,
``y[s,r]`` in [0, 1] per shared hold ``s`` (an input several checkpoints keep)
and release ``r`` -- it is still held at events up to ``r`` -- and, for the
least-peak problem, one continuous peak ``P``.

* at most one choice per root-to-leaf path (nothing checkpointed inside a
  checkpointed module): one row per leaf candidate over its ancestors, O(n * depth);
* the candidates of one module called several times (one per call) take the
  same choice: equality rows;
* memory: the timeline is cut where any candidate's savings start or end, so
  inside a segment the set of modules whose savings apply is fixed; each segment
  whose traced peak exceeds the budget needs ``sum of covering savings >= peak - budget``.
  A segment row is dropped when another row asks at least as much of a subset
  of its modules (it is implied), which leaves few rows: a covering row per
  distinct requirement, each an explicit knapsack the solvers can cut on;
* a shared hold is held up to the last backward of its chosen holders:
  ``y[s,r] >= z`` of each holder whose backward ends at ``r``, and
  ``y[s,r] >= y[s,r']`` for the next release ``r'``; memory rows charge its
  bytes once, through ``y`` (nothing pushes ``y`` above what the choice implies);
* recomputation: at each candidate's backward start, its transient working
  memory must fit beside what the other checkpoints still save;
* objective: total recompute ms (or the peak ``P``).

Memory is in MiB inside the matrix to keep coefficients well scaled.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np
from scipy import sparse

from autosac.solver.problem import Problem
from autosac.solver.problem import bits as _bits

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
    held_cols: dict[int, list[int]] = field(default_factory=dict)  # y column -> candidates that make it 1


@dataclass
class _Need:
    cover: int  # bitmask of candidates whose savings apply
    penalty: int  # bitmask of candidates whose checkpoint holds extra bytes here (inside their backward)
    bytes: float  # traced live bytes there (segment peak, or live bytes at a recompute)
    work_of: int | None  # candidate whose recompute adds its working memory here
    shared: frozenset = frozenset()  # (shared hold, release): held here if a holder released at or after it is chosen


def _needs(problem: Problem) -> list[_Need]:
    n = len(problem.live)
    cands = problem.candidates
    cuts = {0, n}
    for c in cands:
        cuts.update((c.start, c.end, c.bw_end + 1))
    cuts.update(s.freed for s in problem.shared)
    cuts.update(s.release(cands[i]) + 1 for s in problem.shared for i in s.holders)
    releases = [sorted({s.release(cands[i]) for i in s.holders}) for s in problem.shared]

    def shared_at(t: int) -> frozenset:
        out = []
        for si, s in enumerate(problem.shared):
            if s.freed <= t <= releases[si][-1]:
                out.append((si, releases[si][bisect.bisect_left(releases[si], t)]))
        return frozenset(out)

    starts = np.array(sorted(x for x in cuts if x < n), dtype=np.int64)
    peaks = np.maximum.reduceat(problem.live, starts) if n else np.zeros(0)
    # sweep the cuts, tracking whose savings and whose holds apply
    events: dict[int, list[tuple[str, int]]] = {}
    for i, c in enumerate(cands):
        events.setdefault(c.start, []).append(("cover+", i))
        events.setdefault(c.end, []).append(("cover-", i))
        events.setdefault(c.end, []).append(("pen+", i))
        events.setdefault(c.bw_end + 1, []).append(("pen-", i))
    needs, cover, pen, at = [], 0, 0, {}
    for j, s in enumerate(starts):
        for what, i in events.get(int(s), ()):
            bit = 1 << i
            if what == "cover+":
                cover |= bit
            elif what == "cover-":
                cover &= ~bit
            elif what == "pen+":
                pen |= bit
            else:
                pen &= ~bit
        at[int(s)] = (cover, pen)
        needs.append(_Need(cover, pen, float(peaks[j]), None, shared_at(int(s))))
    for i, c in enumerate(cands):
        if c.end < n:
            cov, pn = at[c.end]
            # the replay runs before the backward op there allocates anything
            needs.append(_Need(cov, pn & ~(1 << i), float(problem.live[c.end] - problem.made[c.end]), i,
                               shared_at(c.end)))
    return needs


def _prune(needs: list[_Need], floor: float, problem: Problem) -> list[_Need]:
    """Drop needs that cannot bind above ``floor`` or that another need implies
    (a subset of its savings, a superset of its holds, at least its bytes)."""
    cands = problem.candidates
    most_held = {}

    def held(mask: int) -> int:
        if mask not in most_held:
            most_held[mask] = sum(cands[i].hold for i in _bits(mask))
        return most_held[mask]

    live = []
    for nd in needs:
        top = nd.bytes + held(nd.penalty) + sum(problem.shared[si].bytes for si, _ in nd.shared)
        if nd.work_of is not None:
            c = cands[nd.work_of]
            top += c.hold + max(c.work)
        if top > floor:
            live.append(nd)
    live.sort(key=lambda nd: (bin(nd.cover).count("1"), -nd.bytes))
    kept: list[_Need] = []
    for nd in live:
        implied = nd.work_of is None and any(
            k.work_of is None and k.bytes >= nd.bytes and (k.cover & ~nd.cover) == 0 and (nd.penalty & ~k.penalty) == 0
            and nd.shared <= k.shared
            for k in kept
        )
        if not implied:
            kept.append(nd)
    return kept


def milp_needs(problem: Problem, budget_bytes: int) -> list[_Need]:
    """The memory rows of the budgeted MILP (as needs), for the chain solver."""
    return _prune(_needs(problem), float(budget_bytes), problem)


class _Rows:
    """Constraint rows ``lo <= A x <= hi``, built one at a time."""

    def __init__(self) -> None:
        self.rows, self.cols, self.vals, self.lo, self.hi = [], [], [], [], []

    def add(self, entries, low: float, high: float) -> None:
        r = len(self.lo)
        for cidx, v in entries:
            self.rows.append(r)
            self.cols.append(cidx)
            self.vals.append(v)
        self.lo.append(low)
        self.hi.append(high)

    def matrix(self, n_cols: int):
        return sparse.csr_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.lo), n_cols))


def _columns(problem: Problem):
    """Column indices: ``z[i]`` (candidate ``i``'s choices, binary), then
    ``y[s, r]`` (shared hold ``s`` held at events up to release ``r``: some
    chosen holder's backward ends at or after ``r``) and the holders each
    ``y`` column stands for."""
    cands = problem.candidates
    z_index, col = [], 0
    for c in cands:
        z_index.append(list(range(col, col + len(c.bytes))))
        col += len(c.bytes)
    y_col: dict[tuple[int, int], int] = {}
    held_cols: dict[int, list[int]] = {}
    for si, s in enumerate(problem.shared):
        for r in sorted({s.release(cands[i]) for i in s.holders}):
            y_col[si, r] = col
            held_cols[col] = [i for i in s.holders if s.release(cands[i]) >= r]
            col += 1
    return z_index, y_col, held_cols, col


def _structure_rows(rows: _Rows, problem: Problem, z_index, y_col) -> None:
    """One choice per root-to-leaf path; the calls of one module choose
    alike; a shared hold is held to the last chosen holder's release."""
    cands = problem.candidates
    has_child = {a for c in cands for a in c.ancestors}
    for i, c in enumerate(cands):
        members = [i] if i in has_child else [i, *c.ancestors]
        rows.add([(zc, 1.0) for k in members for zc in z_index[k]], -np.inf, 1.0)
    for group in problem.linked:  # one policy for every call
        for other in group[1:]:
            for a, b in zip(z_index[group[0]], z_index[other]):
                rows.add([(a, 1.0), (b, -1.0)], 0.0, 0.0)
    # y[s, r] >= y[s, r'] for the next release r', and >= z of each holder released at r
    for si, s in enumerate(problem.shared):
        rs = sorted({s.release(cands[i]) for i in s.holders})
        for r, nxt in zip(rs, rs[1:]):
            rows.add([(y_col[si, r], 1.0), (y_col[si, nxt], -1.0)], 0.0, np.inf)
        for i in s.holders:
            rows.add([(y_col[si, s.release(cands[i])], 1.0)] + [(zc, -1.0) for zc in z_index[i]], 0.0, np.inf)


def _memory_rows(rows: _Rows, problem: Problem, budget_bytes: int | None, z_index, y_col, peak_col) -> None:
    """Savings of the covering candidates, less the holds of those in their
    backward (and the recomputing one's work) >= live - budget (or - P)."""
    cands = problem.candidates
    floor = -np.inf if budget_bytes is None else float(budget_bytes)
    for nd in _prune(_needs(problem), floor, problem):
        entries = [(zc, b / MIB) for i in _bits(nd.cover) for zc, b in zip(z_index[i], cands[i].bytes)]
        entries += [(zc, -cands[i].hold / MIB) for i in _bits(nd.penalty) for zc in z_index[i]]
        if nd.work_of is not None:
            w = cands[nd.work_of]
            entries += [(zc, -(x + w.hold) / MIB) for zc, x in zip(z_index[nd.work_of], w.work)]
        entries += [(y_col[key], -problem.shared[key[0]].bytes / MIB) for key in nd.shared]
        if budget_bytes is None:
            rows.add(entries + [(peak_col, 1.0)], nd.bytes / MIB, np.inf)
        else:
            rows.add(entries, (nd.bytes - budget_bytes) / MIB, np.inf)


def build_milp(problem: Problem, budget_bytes: int | None) -> MatrixMILP:
    """The budgeted problem, or with ``budget_bytes=None`` the least-peak problem
    (minimise a peak variable ``P`` that stands in for the budget)."""
    z_index, y_col, held_cols, col = _columns(problem)
    n_z = sum(len(z) for z in z_index)
    least_peak = budget_bytes is None
    n_cols = col + (1 if least_peak else 0)
    peak_col = col if least_peak else None
    rows = _Rows()
    _structure_rows(rows, problem, z_index, y_col)
    _memory_rows(rows, problem, budget_bytes, z_index, y_col, peak_col)
    lb = np.zeros(n_cols)
    ub = np.ones(n_cols)
    c_vec = np.zeros(n_cols)
    if least_peak:
        ub[peak_col] = np.inf
        c_vec[peak_col] = 1.0
    else:
        for i, cand in enumerate(problem.candidates):
            c_vec[z_index[i]] = cand.ms
    integer = np.zeros(n_cols, dtype=np.int8)
    integer[:n_z] = 1
    return MatrixMILP(c_vec, rows.matrix(n_cols), np.array(rows.lo), np.array(rows.hi), lb, ub, integer, z_index,
                      peak_col, held_cols)


def with_objective_bound(m: MatrixMILP, lower: float) -> MatrixMILP:
    """``m`` plus the row ``objective >= lower`` (a bound proven elsewhere)."""
    A = sparse.vstack([m.A, sparse.csr_matrix(m.c)]).tocsr()
    return MatrixMILP(m.c, A, np.append(m.row_lo, lower), np.append(m.row_hi, np.inf), m.lb, m.ub,
                      m.integer, m.z_index, m.peak_col, m.held_cols)


def encode(m: MatrixMILP, choice: dict[int, int]) -> np.ndarray:
    """The solution vector of a choice (the inverse of :func:`decode`)."""
    x = np.zeros(len(m.c))
    for i, k in choice.items():
        x[m.z_index[i][k - 1]] = 1.0
    for col, holders in m.held_cols.items():
        x[col] = float(any(i in choice for i in holders))
    return x


def decode(milp: MatrixMILP, x: np.ndarray) -> dict[int, int]:
    """Candidate index -> chosen choice (1-based) from a solution vector."""
    choice = {}
    for i, cols in enumerate(milp.z_index):
        for k, zc in enumerate(cols):
            if x[zc] > 0.5:
                choice[i] = k + 1
    return choice
