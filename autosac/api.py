"""The one-call entry point: profile a model if need be, then solve."""

from __future__ import annotations

from autosac.core.devices import resolve_target
from autosac.core.loop import Loop, resolve_loop
from autosac.core.plan import Plan
from autosac.core.stats import ModelStats
from autosac.solver import check_solve_options, solve_budget
from autosac.trace import profile

__all__ = ["solve"]


def solve(
    model_or_stats,
    budget: str | int | float,
    example_inputs=None,
    *,
    loss_fn=None,
    optimizer="adamw",
    target="h100",
    world_size: int = 1,
    param_dtype=None,
    reduce_dtype=None,
    autocast=None,
    shard_units=None,
    output_held: bool = True,
    solver: str = "auto",
    time_limit_s: float = 60,
    reserve: str | int | float = 0,
    max_choices: int = 16,
    presolve: bool = True,
    compile: str | None = None,
    routing=None,
    grad_accumulation: int = 1,
    zero_grad: str = "after_step",
    batches_ahead: int = 0,
    loop: Loop | None = None,
) -> Plan:
    """Pick which modules to checkpoint, and how much of each one's activations
    to discard, so the step's peak fits ``budget`` with the least recompute time.

    Args:
        model_or_stats: an ``nn.Module`` (profiled here with ``example_inputs``,
            ``loss_fn``, ``optimizer``, ``target``, ``world_size``, ``param_dtype``,
            ``reduce_dtype``, ``autocast``, ``shard_units``, ``routing`` and the loop, as
            ``loop=`` (:class:`autosac.Loop`) or its keywords ``output_held``,
            ``grad_accumulation``, ``zero_grad``, ``batches_ahead``: see
            :func:`autosac.profile`) or a
            :class:`ModelStats` from :func:`autosac.profile` (profile once, solve many).
        budget: ``"8GiB"``, ``"500MB"``, ``"60%"`` of the unconstrained peak,
            ``"least"`` (the least peak any plan reaches, with the least recompute
            among the plans that reach it), an ``int`` of bytes or a ``float`` of GiB.
        solver: ``"auto"`` (CBC where PuLP has one, else HiGHS with a note), ``"cbc"`` (PuLP)
            or ``"highs"`` (SciPy); both reach the same optimum.
        time_limit_s: on hitting it the best feasible plan found is returned,
            flagged ``plan.solver["status"] == "time_limit"``.
        reserve: headroom kept free for allocator overheads, same forms as ``budget``
            (no percentages); subtracted from the budget.
        max_choices: discard choices offered per module (breakpoints of its curve).
        presolve: when module intervals nest (sequential models), solve exactly by
            the chain DP first and hand its optimum to the MILP as bound and start.
        compile: ``"inductor"`` (``torch.compile``'s default backend) or ``"aot_eager"``
            to plan for ``torch.compile(model, backend=compile)``: the compiled step is
            traced (fake mode) with each candidate plan applied and the budget lowered
            until the compiled peak fits (:mod:`autosac.compile.fit`).  Needs the model
            (not stats) and one process; a CPU or CUDA target, with or without
            ``autocast`` (a CUDA target's compiled step is traced with CUDA's casts
            and attention kernels and inductor's CPU code: no GPU is needed to
            plan).  ``None`` plans
            the eager step.

    Returns:
        Plan: decisions {fqn: discard ratio}, the ops each recomputes, predicted peak.

    Raises:
        InfeasibleBudgetError: no plan reaches the budget; ``.min_feasible_bytes`` says what does.
        SolveTimeoutError: the solver found no plan at all within ``time_limit_s``.
        ValueError: a malformed budget, an unknown solver, a model without example_inputs,
            or a ``compile=`` the planner cannot trace (see above).
        TypeError: neither an ``nn.Module`` nor a ModelStats.

    Example::

        >>> plan = autosac.solve(model, "60%", example_inputs=idx, target="h100")
        >>> plan.decisions
        {'blocks.0': 1.0, 'blocks.1.attn': 0.73, ...}
    """
    check_solve_options(solver, time_limit_s)  # before the profile, which may take a while
    loop = resolve_loop(loop, output_held=output_held, grad_accumulation=grad_accumulation, zero_grad=zero_grad,
                        batches_ahead=batches_ahead)
    if compile is not None:
        from autosac.compile.fit import check_request

        check_request(compile, budget, resolve_target(target).device_type, world_size, autocast is not None,
                      default_loop=loop.is_plain)
        if not hasattr(model_or_stats, "named_modules"):
            raise ValueError("solve(..., compile=...) traces the compiled step: pass the model and example_inputs, "
                             "not stats")
    if isinstance(model_or_stats, ModelStats):
        stats = model_or_stats
    elif not hasattr(model_or_stats, "named_modules"):
        raise TypeError(f"solve needs an nn.Module or a ModelStats, got {type(model_or_stats).__name__}")
    else:
        if example_inputs is None:
            raise ValueError("solve(model, ...) needs example_inputs= to profile the model (or pass a ModelStats)")
        stats = profile(model_or_stats, example_inputs, loss_fn=loss_fn, optimizer=optimizer,
                        target=target, world_size=world_size, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                        autocast=autocast, shard_units=shard_units, routing=routing, loop=loop)
    if compile is None:
        return solve_budget(stats, budget, solver=solver, time_limit_s=time_limit_s, reserve=reserve,
                            max_choices=max_choices, presolve=presolve)
    from autosac.compile.fit import fit_for_compile

    return fit_for_compile(model_or_stats, stats, budget, example_inputs, backend=compile, loss_fn=loss_fn,
                           optimizer=optimizer, reserve=reserve, solver=solver, time_limit_s=time_limit_s,
                           max_choices=max_choices, presolve=presolve)
