"""The calibration's micro-benchmark models (:mod:`autosac.tools.calibrate`):
small transformer blocks, each region followed by a plain layer, in the
variants the calibration times -- plain, each region's forward run twice,
checkpointed whole, checkpointed selectively, and under the parameter-cast
hook (plain and under CPU autocast)."""

from __future__ import annotations

import time

import torch
from torch import nn

from autosac.core.host import HostCosts


class _Block(nn.Module):
    """A small pre-norm transformer block (attention and MLP), the kind of
    module plans checkpoint most; ``blocks`` of them form one region."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(width) for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _Twice(nn.Module):
    """Runs its region's forward twice, the first result dropped: what a
    checkpointed call re-runs, without the checkpoint's machinery."""

    def __init__(self, region: nn.Module) -> None:
        super().__init__()
        self.region = region

    def forward(self, x):
        self.region(x)
        return self.region(x)


class _Layer(nn.Module):
    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln_2(x))))


def replay_skips(stats, fqn: str) -> tuple[float, int]:
    """What a checkpoint's replay of ``fqn``'s first call skips that its
    forward run twice runs: it stops in its last saved tensor's op
    (:meth:`autosac.core.stats.ModuleStats.replay_end`), so the kernels from
    that op on (ms, traced) and the op calls after it (counted: the host
    time the calibration prices them at)."""
    m = stats.modules[fqn]
    stop, end = m.replay_end(), m.fw_windows[0][1]
    return float(sum(stats.timeline.ms[stop:end])), max(0, end - stop - 1)


def _gap_roots(setup: dict, regions: list[str]) -> float:
    """:func:`autosac.core.host.gap_roots` of a calibration model's ``regions`` checkpointed."""
    from autosac.core.host import gap_roots
    from autosac.solver.problem import build_problem

    stats = setup["stats"]
    if "machinery_points" not in setup:  # each candidate's forward start and replay, read once per model
        setup["machinery_points"] = {c.fqn: (c.window[0], c.end) for c in build_problem(stats).candidates}
    points = [p for fqn in regions for p in setup["machinery_points"][fqn]]
    return gap_roots(points, len(stats.timeline.ops))


def _tiny(width: int) -> nn.Module:
    """A region of one small Linear and a GELU: a checkpointed call that is
    nearly all per-call cost (it saves three tensors)."""
    return nn.Sequential(nn.Linear(width, width), nn.GELU())


def _large_models() -> tuple[dict, torch.Tensor]:
    """The calibration at the large size (:mod:`autosac.core.hostsize`): one
    block per region, plain, twice and whole (its selective figure is measured
    in place: :mod:`autosac.tools.calibration_size`)."""
    from autosac.core.hostsize import LARGE_BATCH, LARGE_REGIONS, LARGE_SEQ, LARGE_WIDTH

    x = torch.randn(LARGE_BATCH, LARGE_SEQ, LARGE_WIDTH)
    setup = _calibration_models(lambda: _Block(LARGE_WIDTH, 1), LARGE_REGIONS, x, plain=True)
    try:
        setup["kernels"] = StepKernels(setup["variants"]["none"], x, setup["stats"])
    except RuntimeError as e:  # priced as traced: kernels timed before the rounds, noisier, not lost
        import warnings

        warnings.warn(f"autosac: the calibration times its large model's kernels as traced instead ({e})",
                      stacklevel=2)
    return setup, x


class StepKernels:
    """A model's forward and backward op calls, each to be timed alone as
    the trace times an op (:func:`autosac.trace.costs.real_inputs`: tensors
    of its shapes, filled as ops are timed on; the least of a few calls) --
    in every round of the calibration, beside the steps whose time less
    these timings is the host's (:mod:`autosac.core.hostsize`).  Timings
    taken once, before the rounds, were of another moment of a VM whose
    speed drifts by tens of percent over seconds; at width 256 a step is
    mostly kernels, and the host's part, a difference of the two, read 0 to
    254 us per MiB between calibrations (158-305 with the forward's timed in
    each round).  The backward's, timed once, gave ``backward_untimed_us_per_mib``
    0-259 over nine calibrations on one VM (and a transformers-style Llama's
    step priced 35-42.5 ms by it, 33 measured).  The calls' inputs hold
    about 100 MiB while the calibration runs; timing them takes 0.3 s a round here."""

    def __init__(self, model: nn.Module, x: torch.Tensor, stats) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        from autosac.core.opkinds import is_view_op
        from autosac.trace.costs import real_inputs

        recorded = {"forward": [], "backward": []}
        calls = recorded["forward"]

        class _Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if not is_view_op(func):
                    try:  # inputs of its shapes, made now: the step's own tensors are not held
                        calls.append((func, real_inputs(args, kwargs)))
                    except RuntimeError:  # inputs that cannot be made: priced as traced
                        calls.append((func, None))
                return func(*args, **kwargs)

        with _Record():  # as the trace runs it: grad mode on
            loss = model(x).sum()
            calls = recorded["backward"]
            loss.backward()
        model.zero_grad(set_to_none=True)
        self.forward, self.forward_fixed_ms = _timed_calls(recorded["forward"], stats, backward=False)
        self.backward, self.backward_fixed_ms = _timed_calls(recorded["backward"], stats, backward=True)

    def ms(self, timed: int = 3) -> tuple[float, float]:
        """(forward, backward): the sum over each phase's op calls of each
        one's least time over ``timed`` calls after a warm-up
        (:func:`autosac.core.noise.best_ms`, as the trace times an op), in
        ms, with the trace's price of those it could not time."""
        from autosac.core.noise import best_ms

        def total(calls) -> float:
            return sum(best_ms(lambda c=c: c[0](*c[1], **c[2]), repeats=timed, max_repeats=timed)[0] for c in calls)

        return total(self.forward) + self.forward_fixed_ms, total(self.backward) + self.backward_fixed_ms


def _timed_calls(calls: list, stats, backward: bool) -> tuple[list, float]:
    """The op calls of one phase of a step that have inputs to time them on
    (``(op, (args, kwargs) or None)`` each, :func:`autosac.trace.costs.real_inputs`),
    and the traced ms of those that have none (inputs that cannot be made:
    the trace prices them by the roofline).  Raises RuntimeError where the calls
    are not the trace's ops of that phase, one for one."""
    tl = stats.timeline
    traced = [i for i, (ph, view) in enumerate(zip(tl.phases, tl.views)) if (ph == "backward") == backward and not view]
    if [tl.ops[i] for i in traced] != [func.overloadpacket.__name__ for func, _ in calls]:
        raise RuntimeError("the calibration model's step ran other ops than its trace")
    timed, fixed_ms = [], 0.0
    for i, (func, inputs) in zip(traced, calls):
        if inputs is None:
            fixed_ms += tl.ms[i]
        else:
            timed.append((func, *inputs))
    return timed, fixed_ms


def _calibration_models(region, blocks: int, x: torch.Tensor, selective: bool = False, casts: bool = False,
                        alone: bool = False, plain: bool = False) -> dict:
    """One calibration model (``blocks`` regions, each made by ``region()``
    and followed by a plain layer), its profile, and its variants: plain (where ``plain`` or ``selective``), each region's
    forward run twice, every region checkpointed whole, (``selective``)
    every region caching its first matmul, (``casts``) the plain model
    under the parameter-cast hook of a plan with casts, and (``alone``) the
    middle region alone checkpointed (``one``) or run twice (``twice_one``):
    ``setup["alone"]`` names it."""
    import copy
    import warnings
    from dataclasses import replace

    import autosac.applier
    import autosac.trace
    from autosac.core.devices import DEVICES
    from autosac.solver import plan_from_decisions

    # each region followed by a plain layer, never checkpointed: in a real plan other work runs between
    # checkpointed calls and evicts the machinery's code and data from the caches.  Calibrated back to
    # back, a call cost less than half (180 against 410 us here): a transformers Llama's norm region
    # was priced 0.36 ms and measured 0.52-0.59 ms in place (now 0.58; benchmarks/predict_suite.py)
    model = nn.Sequential(*[m for _ in range(blocks) for m in (region(), _Layer(x.shape[-1]))])
    regions = [str(i) for i in range(0, 2 * blocks, 2)]  # module "0" is the first region
    # the trace times each op on this CPU (cached): the kernels' part of the step
    spec = replace(DEVICES["cpu"], host=HostCosts())  # zero host costs: no calibration inside the calibration
    stats = autosac.trace.profile(model, x, target=spec, optimizer="none", output_held=False)
    whole = plan_from_decisions(stats, dict.fromkeys(regions, 1.0))
    variants = {"twice": _twice(model, regions)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        variants["whole"] = autosac.applier.apply(copy.deepcopy(model), whole)
        if plain or selective:
            variants["none"] = model
        if selective:  # the same regions, each caching its first matmul and recomputing the rest
            partial = copy.deepcopy(whole)
            for d in partial.details.values():
                d.save = [next(i for i, (op, _) in enumerate(d.calls) if op == "addmm")]
                d.skip = []
            variants["selective"] = autosac.applier.apply(copy.deepcopy(model), partial)
    setup = {"stats": stats, "variants": variants, "blocks": blocks, "regions": regions}
    if alone:  # one call among plain layers: the machinery runs cold (autosac.core.host.gap_roots)
        setup["alone"] = one = regions[blocks // 2]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            variants["one"] = autosac.applier.apply(copy.deepcopy(model), plan_from_decisions(stats, {one: 1.0}))
        variants["twice_one"] = _twice(model, [one])
    if casts:  # plain, under the cast hook; and both again under autocast, where it packs parameter casts
        for name, autocast, hooked in (("casts", False, True), ("ac_none", True, False), ("ac_casts", True, True)):
            variants[name] = _CastHooked(copy.deepcopy(model), autocast, hooked)
        setup["autocast_saves"] = variants["ac_none"].count_saves(x)
        setup["cast_op_us"] = _cast_op_us(model)
    return setup


def _twice(model: nn.Sequential, regions: list[str]) -> nn.Sequential:
    """A copy of ``model`` whose ``regions`` (names of its children) each run their forward twice."""
    import copy

    return nn.Sequential(*[_Twice(r) if str(i) in regions else r for i, r in enumerate(copy.deepcopy(model))])


def _cast_op_us(model: nn.Module, repeats: int = 20) -> float:
    """One weight's bfloat16 cast timed alone, as the trace times an op (the
    least of ``repeats``, mean over the model's matrices): the part of a cast
    made again that plans price as the cast's own op."""
    weights = [p.detach() for p in model.parameters() if p.dim() == 2]
    best = []
    for w in weights:
        took = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            w.to(torch.bfloat16)
            took.append(time.perf_counter() - t0)
        best.append(min(took))
    return sum(best) / max(1, len(best)) * 1e6


class _CastHooked(nn.Module):
    """A model run as a plan with parameter casts runs it (``hooked``): every
    tensor its forward saves goes through the cast hook
    (:mod:`autosac.applier.casts`); ``autocast``: under CPU autocast (bfloat16)."""

    def __init__(self, inner: nn.Module, autocast: bool, hooked: bool) -> None:
        super().__init__()
        self.inner, self.autocast, self.hooked = inner, autocast, hooked

    def forward(self, x):
        from contextlib import nullcontext

        from autosac.applier.casts import pack_cast, unpack_cast

        hooks = torch.autograd.graph.saved_tensors_hooks(pack_cast, unpack_cast) if self.hooked else nullcontext()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast), hooks:
            return self.inner(x)

    def count_saves(self, x) -> tuple[int, int]:
        """How many tensors one forward saves, and how many of them are parameter casts."""
        from autosac.applier.casts import _param_behind

        seen = [0, 0]

        def pack(t):
            seen[0] += 1
            seen[1] += _param_behind(t) is not None
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                self.inner(x)
        return seen[0], seen[1]
