"""The batch size and the plan together: of several batch sizes, the one whose
training step -- with the checkpointing it needs to fit -- runs the most
samples per second within a memory.

Each batch size is profiled once (fake mode, as :func:`autosac.profile`) and
solved for the memory (as :func:`autosac.solve`).  A row's predicted step time
is the whole step's: the unmodified step (kernels and dispatch, as
``ModelStats.step_ms``) plus what its plan re-runs and what the checkpointing
machinery costs (``Plan.step_ms``); with gradient accumulation, every
micro-batch's forward and backward and one optimizer step.

Example::

    >>> result = autosac.search(model, lambda b: torch.randint(0, 50304, (b, 1024), device="meta"),
    ...                         "80GiB", batch_sizes=(4, 8, 16, 32), target="h100")
    >>> print(result)                       # the table, the choice marked
    >>> result.best.batch_size, result.best.plan
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_leaves, tree_map

from autosac.core.budget import format_bytes, is_least, parse_budget
from autosac.core.devices import resolve_target
from autosac.core.errors import InfeasibleBudgetError
from autosac.core.fingerprint import model_fingerprint
from autosac.core.inputs import split_inputs
from autosac.core.loop import resolve_loop
from autosac.core.plan import Plan
from autosac.core.stats import ModelStats
from autosac.solver import check_solve_options, solve_stats
from autosac.solver.chain import NotAChain, is_chain, solve_chain
from autosac.solver.milp import milp_needs
from autosac.solver.problem import build_problem
from autosac.trace import profile

__all__ = ["SearchRow", "SearchResult", "search", "rebatched", "DEFAULT_BATCH_SIZES"]

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
# what search passes on to autosac.profile besides the model, the inputs and the target
_PROFILE_OPTIONS = tuple(n for n in inspect.signature(profile).parameters if n not in ("model", "example_inputs",
                                                                                        "target"))


@dataclass
class SearchRow:
    """One batch size.  ``batch_size`` is what ``make_inputs`` got: one
    micro-batch of one rank; ``samples_per_step`` what an optimizer step
    takes in over all ranks (batch x accumulation x world size).

    A feasible row has ``plan`` (``None`` where the step fits as it is),
    ``predicted_peak_bytes`` (per rank), ``predicted_step_ms`` (one
    optimizer step) and ``predicted_samples_per_s``.  A row that does not fit
    has ``min_feasible_bytes``, the least peak any plan reaches (where the
    exact chain DP applies, a lower bound on it within 0.1 %), and
    ``over_bytes``, by how much that exceeds the memory; a row not profiled
    (``skipped``: a smaller batch already did not fit) has ``over_bytes`` as
    a lower bound.  ``note`` says which in words; ``stats`` is the row's
    profile."""

    batch_size: int
    grad_accumulation: int
    samples_per_step: int
    feasible: bool
    plan: Plan | None = None
    predicted_peak_bytes: int | None = None
    predicted_step_ms: float | None = None
    predicted_samples_per_s: float | None = None
    baseline_peak_bytes: int | None = None
    min_feasible_bytes: int | None = None
    over_bytes: int | None = None
    skipped: bool = False
    note: str = ""
    stats: ModelStats | None = field(default=None, repr=False, compare=False)
    unplanned: Plan | None = field(default=None, repr=False, compare=False)  # the empty plan of a step that fits
    remedy: str = field(default="", repr=False)  # what would make a row that does not fit fit

    def plan_to_save(self) -> Plan | None:
        """The plan to write for this row: its plan, or, where the step fits as
        it is, an empty one (applies nothing; records the shapes and loop)."""
        return self.plan if self.plan is not None else self.unplanned


@dataclass
class SearchResult:
    """Every batch size's row, in increasing batch size; ``best`` the feasible
    row with the most predicted samples per second (``None`` when nothing
    fits: ``message`` then says what the smallest batch needs)."""

    memory_bytes: int  # what a plan may use: the memory less the reserve
    rows: list[SearchRow]
    model: str = ""
    target: str = ""
    world_size: int = 1
    global_batch: int | None = None
    key: tuple = field(default=(), repr=False, compare=False)  # the profile options the rows' stats were made with

    @property
    def best(self) -> SearchRow | None:
        fits = [r for r in self.rows if r.feasible]
        # ties go to the smaller batch: the same speed with less memory
        return max(fits, key=lambda r: (r.predicted_samples_per_s, -r.batch_size), default=None)

    @property
    def message(self) -> str:
        """One line: the choice, or why there is none (and what would help)."""
        from autosac.tools.search_report import search_message

        return search_message(self)

    def __str__(self) -> str:
        from autosac.tools.search_report import search_table

        return search_table(self)


def search(
    model: torch.nn.Module,
    make_inputs: Callable[[int], object],
    memory: str | int | float,
    batch_sizes: Iterable[int] = DEFAULT_BATCH_SIZES,
    *,
    target="h100",
    global_batch: int | None = None,
    reserve: str | int | float = 0,
    solver: str = "auto",
    time_limit_s: float = 60,
    profile_all: bool = False,
    reuse: SearchResult | None = None,
    on_row: Callable[[int, int], None] | None = None,
    **profile_options,
) -> SearchResult:
    """Plan each batch size for ``memory`` and pick the fastest that fits.

    Args:
        model: the model (on ``meta`` or with real weights; left unchanged).
        make_inputs: ``make_inputs(batch_size)`` returns one batch of that
            size (one rank's micro-batch), as ``example_inputs`` of
            :func:`autosac.profile`; :func:`rebatched` makes one from a batch.
        memory: per rank, ``"80GiB"``, ``"500MB"``, an ``int`` of bytes or a
            ``float`` of GiB (a percentage has no one peak to be of here).
        batch_sizes: the candidates (each profiled at most once).
        target: as :func:`autosac.profile`.
        global_batch: keep the samples per optimizer step fixed: each batch
            size runs ``global_batch / (batch_size * world_size)`` micro-batches
            per step (gradient accumulation), which must be whole.  ``None``:
            ``grad_accumulation`` (default 1) for every batch size.
        reserve, solver, time_limit_s: as :func:`autosac.solve`.
        profile_all: also profile batch sizes above one that does not fit
            (their rows then say by exactly how much they miss).  By default
            they are skipped: a larger batch needs more memory (with at least
            the gradients alive the smaller one had).
        reuse: an earlier result (for another memory, say): its profiles are
            reused where the model, ``make_inputs`` (the same function),
            target and profile options are the same, else profiled anew.
        on_row: called as ``on_row(done, total)`` after each batch size (progress).
        profile_options: ``loss_fn``, ``optimizer``, ``world_size``,
            ``autocast``, ``grad_accumulation``, ... as :func:`autosac.profile`.

    Returns:
        SearchResult: ``.rows`` (one per batch size) and ``.best`` (``None``
        when nothing fits; ``.message`` says by how much the smallest misses).

    Raises:
        ValueError: a malformed or percentage memory, batch sizes that are not
            positive ints, a ``global_batch`` they do not divide, or a
            ``make_inputs`` whose batch is not the size asked for.
        TypeError: an option :func:`autosac.profile` does not take.
    """
    if profile_options.get("loop") is not None:  # each batch size's accumulation is set below: as keywords
        profile_options = {**profile_options, **dataclasses.asdict(resolve_loop(profile_options.pop("loop")))}
        if global_batch is not None and profile_options["grad_accumulation"] == 1:
            del profile_options["grad_accumulation"]
    accums = _accumulations(_check_sizes(batch_sizes), global_batch, profile_options)
    memory_bytes = _usable_memory(memory, reserve)
    check_solve_options(solver, time_limit_s)
    if not callable(make_inputs):
        raise TypeError(f"make_inputs must be a function of the batch size, got {type(make_inputs).__name__}")
    key = _profile_key(model, make_inputs, target, profile_options)
    cache = {(r.batch_size, r.grad_accumulation > 1): r.stats for r in (reuse.rows if reuse and reuse.key == key
                                                                         else []) if r.stats is not None}
    world = profile_options.get("world_size", 1)
    rows: list[SearchRow] = []
    blocker: SearchRow | None = None
    for i, (b, accum) in enumerate(accums.items()):
        if blocker is not None and not profile_all and (accum > 1 or blocker.grad_accumulation == 1):
            rows.append(_skipped(b, accum, world, blocker))
        else:
            stats = cache.get((b, accum > 1))
            if stats is None:
                stats = profile(model, _inputs_of(make_inputs, b), target=target,
                                **{**profile_options, "grad_accumulation": accum})
                cache[(b, accum > 1)] = stats
            row = _solve_row(dataclasses.replace(stats, grad_accumulation=accum), b, accum, world, memory_bytes,
                             solver=solver, time_limit_s=time_limit_s)
            rows.append(row)
            if not row.feasible and blocker is None:
                blocker = row
        if on_row is not None:
            on_row(i + 1, len(accums))
    return SearchResult(memory_bytes, rows, type(model).__name__, resolve_target(target).name, world,
                        global_batch, key)


def _check_sizes(batch_sizes) -> list[int]:
    try:
        sizes = list(batch_sizes)
    except TypeError:
        raise ValueError(f"batch_sizes must be a list of positive ints, got {batch_sizes!r}") from None
    bad = [b for b in sizes if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if not sizes or bad:
        raise ValueError(f"batch_sizes must be positive ints, got {bad[0] if bad else 'none'}")
    return sorted(set(sizes))


def _accumulations(sizes: list[int], global_batch, options: dict) -> dict[int, int]:
    """Batch size -> micro-batches per optimizer step."""
    unknown = sorted(set(options) - set(_PROFILE_OPTIONS))
    if unknown:
        raise TypeError(f"search got option(s) autosac.profile does not take: {', '.join(unknown)}")
    fixed = options.get("grad_accumulation", 1)
    if global_batch is None:
        return {b: fixed for b in sizes}
    if "grad_accumulation" in options:
        raise ValueError("give global_batch or grad_accumulation, not both: global_batch sets each batch size's "
                         "accumulation")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be a positive int (samples per optimizer step), got {global_batch!r}")
    world = options.get("world_size", 1)
    out = {}
    for b in sizes:
        if global_batch % (b * world):
            raise ValueError(f"batch size {b} x world size {world} does not divide global_batch {global_batch}: "
                             "leave it out of batch_sizes")
        out[b] = global_batch // (b * world)
        if out[b] > 1 and world > 1:
            raise ValueError(f"global_batch {global_batch} needs {out[b]} micro-batches at batch size {b}, and "
                             "gradient accumulation is modelled for one process only: with world_size > 1 give "
                             "batch sizes of global_batch / world_size")
    return out


def _usable_memory(memory, reserve) -> int:
    if is_least(memory) or (isinstance(memory, str) and memory.strip().endswith("%")):
        raise ValueError(f"memory {memory!r}: give a size such as '80GiB' (a percentage or 'least' is of one "
                         "batch size's peak, and the search has several)")
    usable = parse_budget(memory, 0, what="memory")
    if reserve:
        if isinstance(reserve, str) and reserve.strip().endswith("%"):
            raise ValueError("reserve must be an absolute size like '2GiB', not a percentage")
        usable -= parse_budget(reserve, 0, what="reserve")
        if usable <= 0:
            raise ValueError("reserve is not smaller than the memory: nothing left to plan for")
    return usable


def _inputs_of(make_inputs, b: int):
    """``make_inputs(b)``, checked to hold a batch of ``b``."""
    inputs = make_inputs(b)
    args, kwargs = split_inputs(inputs)
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not any(t.dim() and t.shape[0] == b for t in leaves):
        shapes = ", ".join(str(tuple(t.shape)) for t in leaves) or "no tensors"
        raise ValueError(f"make_inputs({b}) returned {shapes}: it must return a batch of {b} (first dimension)")
    return inputs


def _identity(value):
    return value if isinstance(value, (str, int, float, bool, type(None), torch.dtype)) else ("object", id(value))


def _profile_key(model, make_inputs, target, options: dict) -> tuple:
    """What the profiles depend on besides the batch size (for ``reuse``)."""
    spec = resolve_target(target)
    return (id(model), model_fingerprint(model), id(make_inputs), repr(spec),
            tuple(sorted((k, _identity(v)) for k, v in options.items() if k != "grad_accumulation")))


def _step_ms(micro_step_ms: float, optimizer_ms: float, accum: int) -> float:
    """One optimizer step: ``accum`` forwards and backwards (each as the traced
    one, re-runs and checkpointing machinery included), one optimizer update."""
    return accum * (micro_step_ms - optimizer_ms) + optimizer_ms


def _solve_row(stats: ModelStats, b: int, accum: int, world: int, memory_bytes: int, *, solver: str,
               time_limit_s: float) -> SearchRow:
    samples = b * accum * world
    problem = build_problem(stats)
    row = SearchRow(b, accum, samples, False, baseline_peak_bytes=problem.baseline_peak, stats=stats)
    least = _chain_least_peak(problem, memory_bytes)
    try:
        if least is not None:
            raise InfeasibleBudgetError("", min_feasible_bytes=least)
        plan = solve_stats(stats, memory_bytes, solver=solver, time_limit_s=time_limit_s, problem=problem)
    except InfeasibleBudgetError as e:
        row.min_feasible_bytes = e.min_feasible_bytes
        row.over_bytes = e.min_feasible_bytes - memory_bytes
        row.note = f"does not fit: needs at least {format_bytes(e.min_feasible_bytes)}, " \
                   f"{format_bytes(row.over_bytes)} over"
        row.remedy = _remedy(stats, e.min_feasible_bytes)
        return row
    row.feasible = True
    row.predicted_peak_bytes = plan.predicted_peak_bytes
    row.predicted_step_ms = _step_ms(plan.step_ms, stats.optimizer_ms, accum)
    row.predicted_samples_per_s = samples / (row.predicted_step_ms / 1e3) if row.predicted_step_ms > 0 else 0.0
    if plan.decisions:
        row.plan = plan
        n = len(plan.decisions)
        row.note = f"{n} module{'s' if n > 1 else ''} checkpointed, recompute +{plan.overhead:.1%}"
    else:
        row.unplanned = plan
        row.note = "fits without checkpointing"
    return row


LEAST_TOLERANCE = 1e-3  # relative: how close to the least peak a row that does not fit is bracketed


def _chain_least_peak(problem, memory_bytes: int) -> int | None:
    """Where the exact chain DP applies (intervals nest, no shared inputs)
    and proves ``memory_bytes`` infeasible: a lower bound on the least peak,
    within :data:`LEAST_TOLERANCE` of it (bisection by the DP, a few tenths of
    a second a call, against the least-peak MILP's seconds on a large model).
    ``None`` where the memory is feasible or the DP does not apply (the
    solver then decides, exactly)."""
    def fits(budget: int):
        chain = solve_chain(problem, budget, milp_needs(problem, budget))
        return None if chain is None else problem.evaluate(chain.choice)

    if problem.shared or not is_chain(problem):
        return None
    try:
        if fits(memory_bytes) is not None:
            return None
        lo, hi = memory_bytes, problem.baseline_peak  # lo: proven infeasible; hi: reached (nothing checkpointed)
        while hi - lo > LEAST_TOLERANCE * hi:
            mid = (lo + hi) // 2
            reached = fits(mid)
            lo, hi = (mid, hi) if reached is None else (lo, reached)
    except NotAChain:
        return None
    return lo + 1


def _remedy(stats: ModelStats, least: int) -> str:
    """What would help a batch that does not fit: when the optimizer step's
    state (and the target's library workspaces) fill most of its least peak,
    no checkpointing or batch size can; else more memory or a smaller batch."""
    state = (stats.param_bytes + stats.grad_bytes + stats.optimizer_bytes) / stats.world_size
    state += stats.peak_breakdown.get("workspace", 0)
    if state < 0.5 * least:
        return "give at least that much memory, or try smaller batch sizes"
    return (f"the parameters, gradients and {stats.optimizer} state (with the target's library workspaces) alone "
            f"take {format_bytes(state)} per rank, which no checkpointing lowers: shard over more ranks "
            "(world_size), use a lighter optimizer, or give more memory")


def _skipped(b: int, accum: int, world: int, blocker: SearchRow) -> SearchRow:
    return SearchRow(b, accum, b * accum * world, False, over_bytes=blocker.over_bytes, skipped=True,
                     note=f"not profiled: batch {blocker.batch_size} already does not fit "
                          f"(at least {format_bytes(blocker.over_bytes)} over)")


def rebatched(example_inputs, batch_size: int):
    """``example_inputs`` with ``batch_size`` rows: every tensor whose first
    dimension is the batch's (the first tensor's) takes its rows in turn
    (row ``i`` is row ``i % n``); other values stay.  Real, ``meta`` and fake
    tensors alike.

    Example::

        >>> make_inputs = lambda b: rebatched(idx, b)    # idx: (8, 1024) token ids
        >>> make_inputs(32).shape
        torch.Size([32, 1024])
    """
    leaves = [t for t in tree_leaves(example_inputs) if isinstance(t, torch.Tensor)]
    batched = [t for t in leaves if t.dim()]
    if not batched:
        raise ValueError("the example inputs hold no tensor with a batch dimension to resize")
    n = batched[0].shape[0]

    def resize(t):
        if not isinstance(t, torch.Tensor) or not t.dim() or t.shape[0] != n:
            return t
        if t.is_meta:
            return torch.empty((batch_size, *t.shape[1:]), dtype=t.dtype, device="meta")
        rows = torch.arange(batch_size, device=t.device) % n
        return t.index_select(0, rows)

    return tree_map(resize, example_inputs)
