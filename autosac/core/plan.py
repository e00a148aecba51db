"""Plan: what to checkpoint, as plain data.  Produced by :func:`autosac.solve`,
read by :func:`autosac.apply`; saved and loaded as JSON (never pickle)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from autosac.core.budget import format_bytes
from autosac.core.errors import StatsFormatError
from autosac.core.loop import Loop
from autosac.core.schema import build, check, check_common, parse, short

PLAN_FORMAT = 7  # 7: Decision.host_rng (6: compiled["partitioner_budget"], which an autosac reading 5 would ignore)
READABLE_PLAN_FORMATS = (5, 6, 7)  # a format-5 or -6 plan means the same today, its host_rng unknown


@dataclass
class RecomputeOp:
    """One op call a decision discards and recomputes: ``call`` indexes
    :attr:`Decision.calls`, ``occurrence`` counts earlier calls of the same op
    in the module's forward (for display); ``writers`` are the calls that wrote
    its output in place, recomputed with it; ``module`` the submodule it ran
    in, relative to the decision's (``""``: the module's own code)."""

    op: str
    call: int
    occurrence: int
    bytes: int
    ms: float
    random: bool = False
    writers: list[int] = field(default_factory=list)
    module: str = ""

    @property
    def label(self) -> str:
        """How a table names it: where it ran and the op, e.g. ``attn.c_attn:addmm``."""
        name = self.op.lstrip("_").removeprefix("native_")
        return f"{self.module}:{name}" if self.module else name


@dataclass
class Decision:
    """One checkpointed module.

    ``calls`` is the module's traced forward, one ``[op name, [calls it
    reads]]`` per op call PyTorch's checkpointing shows a policy (dataflow as
    :mod:`autosac.core.dataflow` defines it).  At run time each call is matched by
    position: the policy keeps (caches) the ``save`` calls -- those with an
    output saved inside the module -- and recomputes every other one: the
    discarded ``ops`` and their writers, views, parameter casts, ops whose
    outputs nothing inside saves.  Of those, the ``skip`` calls feed nothing the
    replay needs: it does not compute them.  A forward whose op sequence or
    dataflow differs from ``calls`` is handled per call (see the applier).
    ``writes_outside``: the traced forward writes in place a tensor made before
    it (batch norm's running stats, say); True where unknown.  ``host_rng``:
    the traced forward drew from Python's or NumPy's global generator or a
    ``torch.Generator`` of its own, whose states the replay then starts from
    as the forward did; None where unknown (a plan of format 6 or older, or
    made from a compiled trace), handled as True and not priced.
    """

    fqn: str
    ratio: float  # discarded / discardable activation bytes, in (0, 1]
    discard_bytes: int
    discardable_bytes: int
    recompute_ms: float
    ops: list[RecomputeOp]
    calls: list[list] = field(default_factory=list)  # [[op, [reads...]], ...]
    save: list[int] = field(default_factory=list)
    skip: list[int] = field(default_factory=list)
    writes_outside: bool = True
    host_rng: bool | None = None
    mechanism_ms: float = 0.0  # of recompute_ms: what the checkpointing machinery costs the host (autosac.tools.calibrate)


@dataclass
class Plan:
    """Which modules to checkpoint and how much of each one's activations to discard.

    ``decisions`` maps module fqn -> discard ratio; ``details`` holds, per
    decision, the exact op calls it recomputes.  Bytes are peak tensor bytes of
    one training step (docs/memory-model.md); times are ms on ``target``.

    Example::

        >>> plan = autosac.solve(model, "60%", example_inputs=idx)
        >>> print(plan)                    # the decisions table and summary
        >>> plan.save("plan.json"); same = Plan.load("plan.json")
    """

    model: str
    fingerprint: str
    target: str
    world_size: int
    optimizer: str
    budget_bytes: int
    baseline_peak_bytes: int
    predicted_peak_bytes: int
    recompute_ms: float
    baseline_step_ms: float
    step_ms: float
    decisions: dict[str, float]
    details: dict[str, Decision]
    solver: dict
    versions: dict[str, str]
    input_shapes: list[list] = field(default_factory=list)  # [[where, shape, dtype]] it was made for
    device: str = ""  # the device class whose kernels it names: "cuda" or "cpu"
    autocast: str = ""  # the step runs under torch.autocast in this dtype ("bfloat16"), or ""
    sharding: str = ""  # with world_size > 1: how the FSDP2 units were chosen ("13 units one per block, and the root")
    gathered_dtypes: dict[str, str] = field(default_factory=dict)  # params it counts gathered downcast (autosac.zero3)
    # made for torch.compile (autosac.compile.fit): {backend, eager_peak_bytes, eager_budget_bytes, rounds}, and
    # partitioner_budget where the plan is torch.compile's partitioner at that activation_memory_budget for this
    # model's graphs (no module checkpointed: autosac.applier.partitioner); the predicted peak is the compiled step's
    compiled: dict = field(default_factory=dict)
    # the loop it is made for (autosac.core.loop): True = `out = model(x)` held through backward, False = dropped
    output_held: bool = True
    batches_ahead: int = 0  # batches the loop's data loader holds besides the step's (ModelStats.batches_ahead)
    zero_grad: str = "after_step"  # where the loop it is made for sets gradients to None (autosac.core.loop)
    grad_accumulation: int = 1  # micro-batches per optimizer step it is made for (ModelStats.grad_accumulation)
    mechanism_ms: float = 0.0  # of recompute_ms: what the checkpointing machinery costs the host (autosac.tools.calibrate)
    # the traced step saved parameter casts (autocast's weight copies): apply keeps them from being saved
    param_casts: bool = True
    # mixture-of-experts routing the plan assumes (ModelStats.routing: the assumption and the routing
    # decisions traced); {} for a model that routes nothing
    routing: dict = field(default_factory=dict)
    # parameters the traced step did not train (requires_grad False): one trainable now holds a gradient and
    # optimizer state the budget has no room for (autosac.applier.param_watch says so); [] in plans made before
    frozen: list[str] = field(default_factory=list)
    format: int = PLAN_FORMAT

    @property
    def overhead(self) -> float:
        """Recompute time as a fraction of the unmodified step time."""
        return self.recompute_ms / self.baseline_step_ms if self.baseline_step_ms else 0.0

    @property
    def loop(self) -> Loop:
        """The training loop the plan is made for, as one :class:`autosac.Loop`:
        pass it to :func:`autosac.measure` (``loop=plan.loop``) to measure that loop."""
        return Loop.of(self)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parse a plan; never executes code.

        Raises:
            StatsFormatError: not a plan of this format, or a field missing, mistyped
                or not finite, or inconsistent (one line naming it; see :meth:`validate`).
        """
        data = parse(text, "a plan")
        if not isinstance(data, dict) or not {"format", "decisions"} & data.keys():
            raise StatsFormatError("not an autosac plan (neither a plan format nor decisions in it): give a file "
                                   "Plan.save or `autosac plan --json` wrote")
        found = data.get("format")
        if type(found) is not int or found not in READABLE_PLAN_FORMATS:
            raise StatsFormatError(f"plan format {found!r} is not {PLAN_FORMAT}: re-plan with this autosac version")
        data = {**data, "format": PLAN_FORMAT}
        names = {f.name for f in fields(cls)}
        try:
            plan = build(cls, {k: v for k, v in data.items() if k in names}, "", strict=False)
        except StatsFormatError as e:
            raise StatsFormatError(f"malformed plan: {e}") from None
        plan.validate()
        return plan

    def validate(self) -> None:
        """Check every field's type and the plan's consistency (hand edits included).

        Raises:
            StatsFormatError: a field of the wrong type (or not finite), a ratio
                outside (0, 1], or decisions and details disagreeing.
        """
        try:
            check(self)
            check_common(self)
            self._check_decisions()
        except StatsFormatError as e:
            raise StatsFormatError(f"malformed plan: {e}") from None

    def _check_decisions(self) -> None:
        for name in ("budget_bytes", "baseline_peak_bytes", "predicted_peak_bytes"):
            if getattr(self, name) < 0:
                raise StatsFormatError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if set(self.decisions) != set(self.details):
            raise StatsFormatError("decisions and details name different modules")
        for fqn, ratio in self.decisions.items():
            if not 0 < ratio <= 1:
                raise StatsFormatError(f"discard ratio {ratio!r} of {fqn!r} is not in (0, 1]")
            _check_calls(self.details[fqn], f"details[{fqn!r}]")
        fraction = self.compiled.get("partitioner_budget")
        if fraction is not None:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
                raise StatsFormatError(f"compiled['partitioner_budget'] must be a number in [0, 1], got {fraction!r}")
            if self.decisions:
                raise StatsFormatError("a plan kept by the partitioner's budget checkpoints no module")
        names = set(self.decisions)
        for name in names:
            parts = name.split(".") if name else []
            outer = [".".join(parts[:i]) for i in range(len(parts))]  # "" (root), "a", "a.b", ...
            for a in outer:
                if a in names:
                    raise StatsFormatError(f"{name!r} is nested inside checkpointed {a or '(root)'!r}")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Load a plan saved with :meth:`save`.

        Raises:
            StatsFormatError: the file is not a valid plan.
            FileNotFoundError: no such file.
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise StatsFormatError(f"{path} is not a plan: not UTF-8 text (a plan is the JSON Plan.save writes)") from None
        return cls.from_json(text)

    def __str__(self) -> str:
        return plan_table(self)


def _check_calls(d: Decision, where: str) -> None:
    """A decision's op calls: ``[op, [earlier calls it reads]]`` each, and the
    indices into them (``save``, ``skip``, each op's ``call`` and ``writers``) in range."""
    n = len(d.calls)
    for i, call in enumerate(d.calls):
        if not (len(call) == 2 and isinstance(call[0], str) and isinstance(call[1], list)
                and all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < n for r in call[1])):
            raise StatsFormatError(f"{where}.calls[{i}] must be [op name, [indices of calls it reads]], got {short(call)}")
    indices = [("save", i) for i in d.save] + [("skip", i) for i in d.skip]
    indices += [(f"ops[{k}].call", op.call) for k, op in enumerate(d.ops)] if n else []
    indices += [(f"ops[{k}].writers", w) for k, op in enumerate(d.ops) for w in op.writers] if n else []
    for name, i in indices:
        if not 0 <= i < n:
            raise StatsFormatError(f"{where}.{name} holds call index {i}, outside the {n} calls")



# the plan's text (Plan.__str__), beside the plan: no display code imported
def plan_table(plan) -> str:
    lines = []
    if plan.details:
        width = max(len("module"), *(len(f or "(root)") for f in plan.details))
        lines.append(f"{'module':<{width}}  {'discard':>7}  {'freed':>11}  {'recompute':>11}  ops")
        for fqn, d in plan.details.items():  # as the solver ordered them: the model's order
            ops = _op_list([o.label for o in d.ops])
            lines.append(
                f"{fqn or '(root)':<{width}}  {d.ratio:>7.1%}  {format_bytes(d.discard_bytes):>11}"
                f"  {d.recompute_ms:>8.2f} ms  {ops}"
            )
    elif plan.compiled.get("partitioner_budget") is not None:
        lines.append(f"no module checkpointed: torch.compile's partitioner recomputes, at activation_memory_budget="
                     f"{plan.compiled['partitioner_budget']:.4g} for this model's graphs (under torch.compile only)")
    else:
        lines.append("no activation checkpointing needed: the step fits the budget as it is")
    s = plan.solver
    lines += [
        "",
        f"model            {plan.model} ({plan.fingerprint}), target {plan.target}, world size {plan.world_size}",
        *([f"FSDP2 units      {plan.sharding}"] if plan.sharding else []),
        *([f"downcast gather  {len(plan.gathered_dtypes)} parameters gathered in "
           f"{', '.join(sorted(set(plan.gathered_dtypes.values())))} (autosac.zero3.install_downcast_gather)"]
          if plan.gathered_dtypes else []),
        *([f"MoE routing      {routing_line(plan.routing)}"] if plan.routing else []),
        *([f"accumulation     {plan.grad_accumulation} micro-batches per optimizer step (peak and times per "
           "micro-batch, gradients alive throughout)"] if plan.grad_accumulation > 1 else []),
        *(["loop             zero_grad() before backward: the previous step's gradients alive through the "
            "forward"] if plan.zero_grad == "before_backward" and plan.grad_accumulation == 1 else []),
        f"baseline peak    {format_bytes(plan.baseline_peak_bytes)}",
        f"planned peak     {format_bytes(plan.predicted_peak_bytes)}"
        + (f" under torch.compile(backend={plan.compiled.get('backend')!r}); eager "
           f"{format_bytes(plan.compiled.get('eager_peak_bytes', 0))}" if plan.compiled else ""),
        f"budget           {format_bytes(plan.budget_bytes)}",
        f"recompute        {plan.recompute_ms:.2f} ms on a {plan.baseline_step_ms:.2f} ms step "
        f"(+{plan.overhead:.1%}), of which checkpointing machinery {plan.mechanism_ms:.2f} ms",
        f"solver           {s.get('backend')} {s.get('status')}, gap {_gap(s.get('gap'))}, "
        f"{s.get('seconds') or 0:.2f} s",
    ]
    return "\n".join(lines)


def routing_line(routing: dict) -> str:
    """``balanced, 4 routing decisions (2 of 8 experts per token, 1024 tokens)``."""
    a = routing.get("assumption", {})
    kind = a.get("kind", "balanced")
    factor = a.get("capacity_factor")
    what = f"capacity factor {factor:g}" if kind == "capacity" else kind
    calls = routing.get("routers", [])
    shapes = sorted({(c["top_k"], c["experts"], c["tokens"]) for c in calls})
    each = "; ".join(f"{k} of {n} experts per token, {t} tokens" for k, n, t in shapes)
    return f"{what}, assumed at {len(calls)} routing decision{'s' if len(calls) != 1 else ''} ({each})"


def _op_list(labels: list[str], shown: int = 4) -> str:
    """``a, b ×2, c and 3 more``: repeats of one label counted, the first few shown."""
    counts: dict[str, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    items = [f"{k} ×{n}" if n > 1 else k for k, n in counts.items()]
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _gap(gap) -> str:
    return "-" if gap is None else f"{gap:.1e}"
