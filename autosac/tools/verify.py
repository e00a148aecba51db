"""``autosac verify``: run a saved plan for real on this machine and compare
predicted against measured peak bytes and step time."""

from __future__ import annotations

import contextlib
import copy
import math
import statistics

import torch

from autosac.core.budget import format_bytes
from autosac.core.errors import PlanMismatchError


def verify_plan_file(args) -> int:
    """Build the model with real weights (on the GPU for a CUDA plan, else the
    CPU), measure it unmodified and with the plan applied (under the plan's
    autocast, if any; compiled with the plan's backend if it was made for
    ``torch.compile``), and print predicted vs measured.  Exit status 1 when
    the measured peak exceeds the plan's budget."""
    import autosac.applier
    import autosac.tools.measure
    from autosac.core.fingerprint import model_fingerprint
    from autosac.core.inputs import format_signature, input_signature, split_inputs
    from autosac.core.plan import Plan
    from autosac.models.spec import build_from_spec

    plan = Plan.load(args.plan)
    model, inputs = build_from_spec(args.model, args.model_arg, args.batch, args.seq, device="meta")
    if model_fingerprint(model) != plan.fingerprint:
        raise PlanMismatchError(
            f"{args.plan} was made for another model ({plan.model} {plan.fingerprint}): pass the same model options"
        )
    found = input_signature(*split_inputs(inputs))
    if plan.input_shapes and found != plan.input_shapes:
        raise PlanMismatchError(
            f"{args.plan} was made for inputs {format_signature(plan.input_shapes)}, not {format_signature(found)}: "
            "pass the --batch, --seq and --model-arg it was planned with (its budget holds only for those)"
        )
    device = _device_for(plan, args.plan)
    model, inputs = build_from_spec(args.model, args.model_arg, args.batch, args.seq, device=device)
    amp = getattr(torch, plan.autocast) if plan.autocast else None
    # two micro-batches reach an accumulating step's peak: from the second on, every gradient is alive
    loop = dict(steps=args.steps, optimizer=plan.optimizer, autocast=amp, loop=plan.loop.measuring())
    # the weights the routing is measured with: on the CPU meanwhile (a CUDA peak counts every tensor on the device)
    routed = copy.deepcopy(model).to("cpu") if plan.routing else None
    unplanned = copy.deepcopy(model)
    autosac.applier.apply(model, plan)
    run = model
    if plan.compiled:  # planned for torch.compile: measured compiled, as the prediction is
        torch._dynamo.reset()
        run = torch.compile(model, backend=plan.compiled["backend"])
        print(f"(the plan was made for torch.compile(backend={plan.compiled['backend']!r}): measured compiled)")
    baseline, planned = interleaved({"unplanned": (unplanned, unplanned), "planned": (run, model)}, inputs, loop,
                                    args.rounds, device)
    ratios = [p.step_ms / u.step_ms for u, p in zip(baseline, planned)]
    baseline, planned = _summary(baseline), _summary(planned)
    rows = [
        ("peak, no checkpointing", plan.baseline_peak_bytes, baseline.peak_bytes),
        ("peak, with the plan", plan.predicted_peak_bytes, planned.peak_bytes),
    ]
    print(f"{'':<24}{'predicted':>14}{'measured':>14}{'error':>9}")
    for label, pred, meas in rows:
        print(f"{label:<24}{format_bytes(pred):>14}{format_bytes(meas):>14}{(pred - meas) / meas:>+9.1%}")
    comparable = plan.target == "cpu" or device == "cuda"
    print(f"{'step, no checkpointing':<24}{plan.baseline_step_ms:>11.1f} ms{baseline.step_ms:>11.1f} ms")
    print(f"{'step, with the plan':<24}{plan.step_ms:>11.1f} ms{planned.step_ms:>11.1f} ms")
    print(f"measured overhead {statistics.median(ratios) - 1:+.1%} (predicted {plan.overhead:+.1%}): the median "
          f"over {len(ratios)} interleaved rounds, {min(ratios) - 1:+.1%} to {max(ratios) - 1:+.1%} (a busy "
          "machine spreads them: more --rounds narrow the median's uncertainty)")
    if not comparable:
        print(f"(times predicted for {plan.target}, measured on this CPU: compare the overheads, not the ms)")
    elif device == "cuda":
        print(f"(measured on {torch.cuda.get_device_name()}; predicted for {plan.target})")
    ok = planned.peak_bytes <= plan.budget_bytes
    print(f"budget {format_bytes(plan.budget_bytes)}: {'kept' if ok else 'EXCEEDED'}"
          + ("" if ok else f" by {format_bytes(planned.peak_bytes - plan.budget_bytes)}"))
    if plan.routing:
        print(routing_report(plan, measured_routing(routed.to(device), inputs, plan, amp), ok))
    return 0 if ok else 1


def measured_routing(model, inputs, plan, autocast=None):
    """The routing one real forward of ``model`` takes at the routing
    decisions ``plan`` was traced with (:func:`autosac.trace.routing.observe`)."""
    from autosac.core.inputs import split_inputs
    from autosac.trace.routing import RouterCall, observe

    args, kwargs = split_inputs(inputs)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    amp = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with torch.no_grad(), amp, observe([RouterCall(**c) for c in plan.routing["routers"]]) as seen:
        model(*args, **kwargs)
    return seen


def routing_report(plan, seen, kept: bool) -> str:
    """What routing the plan assumed, what the real step took, and -- when the
    budget was exceeded under a routing busier than assumed -- the assumption
    that covers it."""
    from autosac.core.plan import routing_line
    from autosac.trace.routing import routing_from_dict

    assumed = routing_from_dict(plan.routing.get("assumption"))
    factor = seen.capacity_factor
    text = (f"MoE routing: planned for {routing_line(plan.routing)}; measured: the busiest expert got "
            f"{factor:.2f}x its balanced share (capacity factor {factor:.2f}) over {len(seen.factors)} "
            "routing decisions")
    if not kept and factor > assumed.capacity_factor:
        text += ("\nthe real routing is busier than the plan assumed: re-plan with "
                 f"--routing {math.ceil(factor * 100) / 100:g} for a budget that holds under it")
    return text


def interleaved(models: dict, inputs, loop: dict, rounds: int, device: str = "cpu") -> tuple[list, list]:
    """Measure the ``"unplanned"`` and ``"planned"`` models (name -> (what to run,
    its module), :func:`autosac.tools.measure.measure` with ``loop``) in turns
    (:func:`autosac.tools.measure.in_rounds`); each one's measurements, round
    by round.  On a GPU the model not being measured waits on the CPU: a CUDA
    peak counts every tensor on the device."""
    from autosac.tools.measure import in_rounds, measure

    def run(name):
        if device == "cuda":
            for other, (_, module) in models.items():
                module.to("cpu" if other != name else device)
        return measure(models[name][0], inputs, **loop)

    got = in_rounds([(name, lambda name=name: run(name)) for name in ("unplanned", "planned")], rounds)
    return got["unplanned"], got["planned"]


def _summary(runs: list):
    """Rounds' measurements as one: the most peak bytes any round read, the median step time."""
    from dataclasses import replace

    return replace(max(runs, key=lambda m: m.peak_bytes), step_ms=statistics.median(m.step_ms for m in runs),
                   step_ms_all=[t for m in runs for t in m.step_ms_all])


def _device_for(plan, path: str) -> str:
    """Where a plan can be measured: a CUDA plan on this machine's GPU, a CPU plan on the CPU."""
    if plan.device != "cuda":
        return "cpu"
    if not torch.cuda.is_available():
        raise PlanMismatchError(
            f"{path} names the ops a CUDA device runs ({plan.target}) and this machine has no GPU: "
            "verify it on one, or plan with --target cpu to verify here"
        )
    return "cuda"
