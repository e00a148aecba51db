"""An exact dynamic program for the common case where savings intervals nest.

In a sequential model a module whose forward ends earlier starts its backward
later, so ordered by forward end the candidates' intervals nest like
parentheses, and every memory row asks for a minimum sum of savings over a
*prefix* of that order.  Then one pass over the candidates, keeping for each
amount of savings so far only the cheapest partial plans (a Pareto front of
(bytes saved, ms) pairs), solves the problem exactly.

The MILP uses the result two ways: its plan as a starting solution, its
optimum as a proven lower bound on the objective, so the solvers only need to
confirm a solution instead of enumerating near-identical layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autosac.solver.problem import Problem
from autosac.solver.problem import bits as _bits


class NotAChain(Exception):
    """The problem lacks the nested shape the chain pass needs; use the MILP alone."""


@dataclass
class ChainResult:
    objective: float  # least recompute ms (candidate choices only)
    choice: dict[int, int]  # candidate -> choice (1-based)


def is_chain(problem: Problem) -> bool:
    """True when, ordered by forward end, candidates' intervals nest (and no
    candidates are linked: the pass chooses each one on its own)."""
    cands = problem.candidates
    if problem.linked:
        return False
    in_order = all(
        (a.start, -a.end) <= (b.start, -b.end) and b.end <= a.end for a, b in zip(cands, cands[1:])
    )
    # descendants must come before their ancestors (ties in interval broken by depth)
    return in_order and all(a > i for i, c in enumerate(cands) for a in c.ancestors)


def _requirements(problem: Problem, budget_bytes: int, needs):
    """Turn the MILP's memory rows into what the pass checks, or ``None`` when
    some row does not have the chain shape:

    * ``req[p]``: savings of candidates ``[0, p)`` must reach it;
    * ``when_chosen[i]``: if ``i`` is chosen, savings of the candidates before
      it must reach it plus its hold -- rows inside its backward or at its
      recompute, whose other candidates are all before ``i``, except its own
      descendants, which cannot be chosen alongside it.
    """
    cands = problem.candidates
    n = len(cands)
    req = np.full(n + 1, -np.inf)
    when_chosen = [np.full(len(c.bytes), -np.inf) for c in cands]
    sub_start = _subtree_starts(problem)
    for nd in needs:
        p = _prefix_len(nd.cover)
        if p is None:
            return None
        need = nd.bytes - budget_bytes
        holders = list(_bits(nd.penalty))
        if nd.work_of is None:
            req[p] = max(req[p], need)
        else:
            holders.append(nd.work_of)
        for i in holders:
            # everything between the covered prefix and i must be i's descendants
            if p < sub_start[i] or p > i:
                return None
            others = [h for h in holders if h != i]
            if any(h not in cands[i].ancestors and i not in cands[h].ancestors for h in others):
                return None
            extra = cands[i].hold + (np.asarray(cands[i].work) if nd.work_of == i else 0)
            when_chosen[i] = np.maximum(when_chosen[i], need + extra)
    return req, when_chosen


def solve_chain(problem: Problem, budget_bytes: int, needs) -> ChainResult | None:
    """Exact optimum when the problem has the chain shape (:func:`is_chain` and
    every memory row over a prefix); ``None`` when no plan fits.

    ``needs`` are the memory rows of :func:`autosac.solver.milp.milp_needs`.

    Raises:
        NotAChain: the shape is off; solve the MILP without this pass.
    """
    cands = problem.candidates
    if not is_chain(problem):
        raise NotAChain
    shaped = _requirements(problem, budget_bytes, needs)
    if shaped is None:
        raise NotAChain
    req, when_chosen = shaped
    if req[0] > 0:
        return None
    cap = max(0.0, float(np.max(req)), *(float(np.max(w)) for w in when_chosen))
    sub_start = _subtree_starts(problem)

    # state: last chosen candidate (canonicalised) -> front arrays (D, cost, back-pointer id)
    fronts = {-1: (np.zeros(1), np.zeros(1), np.array([-1]))}
    ancestors = [sorted(c.ancestors) for c in cands]
    next_id = 1
    node_parent = [np.array([-1])]
    node_cand = [np.array([-1])]
    node_choice = [np.array([0])]
    for i, c in enumerate(cands):
        new: dict[int, list] = {}
        for last, (d, cost, ids) in fronts.items():
            _push(new, _canon(last, i + 1, ancestors, sub_start), d, cost, ids, 0)
            if last < sub_start[i]:
                for k, (b, t) in enumerate(zip(c.bytes, c.ms), start=1):
                    ok = d >= when_chosen[i][k - 1] - 1e-6
                    _push(new, _canon(i, i + 1, ancestors, sub_start), np.minimum(d[ok] + b, cap), cost[ok] + t, ids[ok], k)
        fronts = {}
        for last, parts in new.items():
            d = np.concatenate([p[0] for p in parts])
            cost = np.concatenate([p[1] for p in parts])
            par = np.concatenate([p[2] for p in parts])
            ch = np.concatenate([p[3] for p in parts])
            keep = d >= req[i + 1] - 1e-6
            d, cost, par, ch = d[keep], cost[keep], par[keep], ch[keep]
            if not len(d):
                continue
            idx = _pareto(d, cost)
            ids = np.arange(next_id, next_id + len(idx))
            next_id += len(idx)
            node_parent.append(par[idx])
            node_cand.append(np.full(len(idx), i))
            node_choice.append(ch[idx])  # choice k of candidate i, 0 = skipped
            fronts[last] = (d[idx], cost[idx], ids)
        if not fronts:
            return None
    best = min(((cost.min(), ids[cost.argmin()]) for d, cost, ids in fronts.values()), key=lambda x: x[0])
    parent = np.concatenate(node_parent)
    cand_of = np.concatenate(node_cand)
    choice_of = np.concatenate(node_choice)
    choice, node = {}, int(best[1])
    while node > 0:
        if choice_of[node]:
            choice[int(cand_of[node])] = int(choice_of[node])
        node = int(parent[node])
    return ChainResult(float(best[0]), choice)


def _push(new, key, d, cost, ids, k):
    if len(d):
        new.setdefault(key, []).append((d, cost, ids, np.full(len(d), k)))


def _pareto(d: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Indices of the points no other point beats (more saved for no more ms)."""
    order = np.lexsort((cost, -d))  # most saved first, cheapest first among equals
    best = np.minimum.accumulate(cost[order])
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = cost[order][1:] < best[:-1] - 1e-12
    return order[keep]


def _prefix_len(mask: int) -> int | None:
    p = mask.bit_length()
    return p if mask == (1 << p) - 1 else None



def _subtree_starts(problem: Problem) -> list[int]:
    """Per candidate, the smallest index among it and its candidate descendants."""
    start = list(range(len(problem.candidates)))
    for j, c in enumerate(problem.candidates):
        for a in c.ancestors:
            start[a] = min(start[a], j)
    return start


def _canon(last: int, nxt: int, ancestors, sub_start) -> int:
    """Only whether the last chosen candidate blocks a later one matters, and
    the later candidates it blocks are its ancestors: map it to the largest
    subtree start among its ancestors still to come, else -1."""
    if last < 0:
        return -1
    starts = [sub_start[q] for q in ancestors[last] if q >= nxt]
    return max(starts) if starts else -1
