"""The ``autosac`` command: plan, sweep and verify from the shell.

User mistakes end in one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from contextlib import contextmanager

from autosac.core.budget import format_bytes, is_least, parse_budget
from autosac.core.devices import DEVICES
from autosac.core.errors import MissingExtraError, SolveTimeoutError, StatsFormatError, TraceError
from autosac.models.spec import UserError, build_from_spec

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _model_options(p: argparse.ArgumentParser, batch_sizes: bool = False) -> None:
    p.add_argument("--model", default="gpt2", help="built-in name (gpt2, llama-7b, ...), hf:NAME (hf:llama, hf:gpt2, hf:bert, hf:mistral, "
                        "hf:qwen2, hf:qwen3, hf:mixtral, hf:qwen3_moe: a transformers config, no download) or "
                        "package.module:factory")
    p.add_argument("--model-arg", action="append", default=[], metavar="K=V", help="config override, repeatable")
    if batch_sizes:  # plan: one size with --budget; with --memory, the sizes to search
        p.add_argument("--batch", default=None, metavar="N|auto|A..B|N,M,...",
                       help="batch size; with --memory the sizes to search: auto (1..64), A..B (A, 2A, 4A, ... up to "
                            "B) or a list 4,8,16")
    else:
        p.add_argument("--batch", type=_positive_int, default=None)
    p.add_argument("--seq", type=_positive_int, default=None)
    p.add_argument("--target", default="h100", choices=list(DEVICES),
                   help="h100, h200, a100, l4, or cpu (timed locally); another device: autosac.DeviceSpec in Python")
    p.add_argument("--world-size", type=_positive_int, default=1)
    p.add_argument("--param-dtype", choices=sorted(_DTYPES), default=None,
                   help="FSDP2 MixedPrecisionPolicy param_dtype (with --world-size > 1)")
    p.add_argument("--reduce-dtype", choices=sorted(_DTYPES), default=None,
                   help="FSDP2 MixedPrecisionPolicy reduce_dtype (default: the param dtype)")
    p.add_argument("--shard-units", default=None, metavar="NAMES",
                   help="FSDP2 units (with --world-size > 1): module names or patterns, comma-separated, "
                        "e.g. 'layers.*' (default: one per block)")
    p.add_argument("--autocast", choices=["bf16", "fp16"], default=None,
                   help="train under torch.autocast in this dtype (traced with the target's cast policy)")
    p.add_argument("--downcast-gather", action="store_true",
                   help="with --world-size > 1 and --autocast: count the parameters the step only uses cast as "
                        "gathered already cast (autosac.zero3.install_downcast_gather)")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--drop-output", action="store_true",
                   help="plan for a loop that drops the model's output at the loss (loss_fn(model(x)).backward()); "
                        "default: `out = model(x)` held through backward (verify runs the plan's own loop)")
    p.add_argument("--grad-accumulation", type=_positive_int, default=1, metavar="N",
                   help="micro-batches per optimizer step (--batch is one micro-batch): plan for the micro-batch "
                        "that runs with every gradient already alive (default: 1)")
    p.add_argument("--zero-grad", choices=["after_step", "before_backward"], default="after_step",
                   help="where the loop sets gradients to None: after the optimizer step (default) or between the "
                        "loss and backward (Lightning's order: the previous gradients are alive in the forward)")
    p.add_argument("--routing", default=None, metavar="ROUTING",
                   help="mixture-of-experts models: the routing to plan for: balanced, worst, or a capacity factor "
                        "such as 1.25 (the busiest experts get 1.25x the balanced load); default: balanced where "
                        "the forward reads the routing's values, with a warning")
    p.add_argument("--solver", default="auto", choices=["auto", "cbc", "highs"])
    p.add_argument("--time-limit", type=_positive_float, default=60.0, help="seconds for the solver")
    p.add_argument("--quiet", action="store_true", help="no progress lines (they are shown only on a terminal)")


class _Progress:
    """Progress lines on stderr while profiling and solving: only on a terminal, never with --quiet."""

    def __init__(self, quiet: bool) -> None:
        self.on = not quiet and sys.stderr.isatty()

    @contextmanager
    def stage(self, text: str):
        start = time.perf_counter()
        if self.on:
            print(f"autosac: {text} ...", end="", file=sys.stderr, flush=True)
        try:
            yield self
        finally:
            if self.on:
                print(f"\rautosac: {text}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

    def count(self, text: str):
        """A callback ``(done, total)`` that rewrites one line."""
        def show(done: int, total: int) -> None:
            if self.on:
                print(f"\rautosac: {text} {done}/{total} ...", end="", file=sys.stderr, flush=True)
        return show


def _positive(convert, what: str):
    """An argparse type: ``convert(text)``, refused in one line unless it is above 0."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{value if isinstance(value, int) else format(value, 'g')} is not positive")
        return value
    return parse


_positive_float = _positive(float, "a number")
_positive_int = _positive(int, "a whole number")


def _profile_options(args) -> dict:
    """What ``autosac.trace.profile`` takes from the model options (besides model, inputs and target)."""
    import torch

    dtypes = {k: getattr(torch, _DTYPES[v]) for k, v in (("param_dtype", args.param_dtype),
                                                          ("reduce_dtype", args.reduce_dtype),
                                                          ("autocast", args.autocast)) if v}
    return dict(optimizer=args.optimizer, world_size=args.world_size, shard_units=args.shard_units,
                output_held=not args.drop_output, routing=args.routing, grad_accumulation=args.grad_accumulation,
                zero_grad=args.zero_grad, **dtypes)


def _profile(args):
    import autosac.api
    import autosac.core.devices
    import autosac.trace
    import autosac.zero3

    if args.downcast_gather and (args.world_size < 2 or not args.autocast):
        raise ValueError("--downcast-gather needs --world-size > 1 and --autocast (bf16 or fp16)")
    model, inputs = build_from_spec(args.model, args.model_arg, args.batch, args.seq)
    options = _profile_options(args)
    with _Progress(args.quiet).stage(f"profiling {type(model).__name__} (one training step in fake mode)"):
        stats = autosac.trace.profile(model, inputs, target=args.target, **options)
    if args.downcast_gather:
        stats = autosac.zero3.with_downcast_gather(stats, options["autocast"])
    return stats, model, inputs


def batch_sizes(text: str | None, global_batch: int | None = None, world_size: int = 1) -> list[int]:
    """``--batch`` with ``--memory``: ``auto`` (1, 2, 4, ... 64, or with a
    global batch every power of two that divides it per rank), ``A..B`` (A,
    2A, 4A, ... up to B), ``4,8,16`` or one size.

    Raises:
        UserError: anything else, in one line.
    """
    forms = "give auto, a doubling range such as 1..64, a list such as 4,8,16, or one size"
    text = "auto" if text is None else text.strip()
    if text == "auto":
        top = global_batch // world_size if global_batch else 64
        return [1 << k for k in range(top.bit_length()) if not global_batch or (top % (1 << k) == 0)]
    try:
        if ".." in text:
            low, high = (int(x) for x in text.split(".."))
            if not 1 <= low <= high:
                raise ValueError
            return [low << k for k in range((high // low).bit_length())]
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--batch {text!r} is not a batch size or sizes: {forms} (whole numbers, a range from low to high)") from None
    if any(b < 1 for b in sizes):
        raise UserError(f"--batch {text!r}: batch sizes must be positive; {forms}")
    return sizes


def cmd_plan(args) -> int:
    import autosac.api
    import autosac.core.devices
    import autosac.trace
    import autosac.zero3

    if (args.budget is None) == (args.memory is None):
        raise UserError("plan needs --budget (one batch size) or --memory (the batch size that runs fastest in "
                        "it), not both" if args.budget else "plan needs --budget, or --memory to search the batch size")
    if args.memory is not None:
        return cmd_search(args)
    if args.global_batch is not None:
        raise UserError("--global-batch goes with --memory (the batch-size search); with --budget use "
                        "--grad-accumulation")
    args.batch = None if args.batch is None else _one_batch(args.batch)
    if not is_least(args.budget):
        parse_budget(args.budget, 1 << 60)  # reject a malformed budget before the profile runs
    if args.compile:
        from autosac.compile.fit import check_request, fit_for_compile

        check_request(args.compile, args.budget, autosac.core.devices.resolve_target(args.target).device_type,
                      args.world_size, bool(args.autocast),
                      default_loop=args.grad_accumulation == 1 and args.zero_grad == "after_step")
    stats, model, inputs = _profile(args)
    if args.compile:
        with _Progress(args.quiet).stage(f"fitting a plan for {args.budget} to the compiled step"):
            plan = fit_for_compile(model, stats, args.budget, inputs, backend=args.compile,
                                   optimizer=args.optimizer, reserve=args.reserve or 0, solver=args.solver,
                                   time_limit_s=args.time_limit)
    else:
        with _Progress(args.quiet).stage(f"solving for {args.budget}"):
            plan = autosac.api.solve(stats, args.budget, solver=args.solver, time_limit_s=args.time_limit,
                                 reserve=args.reserve or 0)
    print(plan)
    if args.json:
        plan.save(args.json)
        print(f"\nplan written to {args.json}")
    return 0


def _one_batch(text: str) -> int:
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError as e:
        raise UserError(f"--batch {text!r}: {e}; several sizes (auto, 1..64, 4,8,16) go with --memory in place "
                        "of --budget") from None


def cmd_search(args) -> int:
    """``plan --memory``: the batch size and plan with the most predicted samples per second."""
    from autosac.tools.search import rebatched, search
    from autosac.tools.search_report import search_table

    if args.compile or args.downcast_gather:
        raise UserError("--memory searches the eager step: leave out --compile and --downcast-gather")
    if args.global_batch is not None and args.grad_accumulation != 1:
        raise UserError("give --global-batch or --grad-accumulation, not both: the global batch sets each "
                        "batch size's accumulation")
    sizes = batch_sizes(args.batch, args.global_batch, args.world_size)
    options = _profile_options(args)
    if args.global_batch is not None:
        options.pop("grad_accumulation")
    model, inputs = build_from_spec(args.model, args.model_arg, sizes[0], args.seq)
    progress = _Progress(args.quiet)
    with progress.stage(f"planning {type(model).__name__} at {len(sizes)} batch sizes"):
        result = search(model, lambda b: rebatched(inputs, b), args.memory, sizes, target=args.target,
                        global_batch=args.global_batch, reserve=args.reserve or 0, solver=args.solver,
                        time_limit_s=args.time_limit, on_row=progress.count("batch size"), **options)
    print(search_table(result))
    if result.best is None:
        raise UserError(result.message)
    if args.json:
        result.best.plan_to_save().save(args.json)
        print(f"\nplan for batch {result.best.batch_size} written to {args.json}")
    return 0


def cmd_sweep(args) -> int:
    from autosac.tools.report import sweep_table
    from autosac.tools.sweep import measure_sweep, sweep

    budgets = [item.strip() for item in args.budgets.split(",")]
    for item in budgets:
        if not is_least(item):
            parse_budget(item, 1 << 60)
    if args.plot:
        _check_plot_extra(args.plot)
    if args.verify and args.target != "cpu":
        raise UserError("--verify runs the plans on this machine's CPU: plan with --target cpu")
    progress = _Progress(args.quiet)
    stats, _, _ = _profile(args)
    with progress.stage(f"solving {len(budgets)} budgets"):
        result = sweep(stats, budgets, solver=args.solver, time_limit_s=args.time_limit, reserve=args.reserve or 0,
                       on_point=progress.count("solving budget"))
    if args.verify:
        model, inputs = build_from_spec(args.model, args.model_arg, args.batch, args.seq, device="cpu")
        with progress.stage("running each plan for real (--verify)"):
            measure_sweep(result, model, inputs, rounds=args.rounds, optimizer=args.optimizer)
    print(f"{stats.model} on {stats.target['name']}: baseline peak {format_bytes(result.baseline_peak_bytes)}, "
          f"step {stats.step_ms:.2f} ms\n")
    if args.reserve:
        print(f"(budgets less the reserve of {args.reserve}: what each plan may use)")
    print(sweep_table(result))
    if args.plot:
        from autosac.tools.plot import pareto_plot

        pareto_plot(result, args.plot)
        print(f"\nplot written to {args.plot}")
    over = [p for p in result.points if p.measured_peak_bytes is not None and p.measured_peak_bytes > p.budget_bytes]
    if over:
        print(f"\n{len(over)} plan(s) measured above their budget: " + ", ".join(format_bytes(p.budget_bytes)
                                                                         for p in over))
        return 1
    return 0


def _check_plot_extra(path: str) -> None:
    """Before any work: --plot without matplotlib is one line naming the extra,
    and a file name without a format matplotlib writes one line too."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingExtraError("--plot needs matplotlib: pip install 'autosac[plot]'") from None
    formats = Figure().canvas.get_supported_filetypes()
    suffix = path.rsplit(".", 1)[-1].lower() if "." in path.rsplit("/", 1)[-1] else ""
    if suffix not in formats:
        raise UserError(f"--plot {path}: name a file ending in .png, .svg or .pdf (matplotlib writes "
                        f"{', '.join(sorted(formats))})")


def cmd_verify(args) -> int:
    from autosac.tools.verify import verify_plan_file

    return verify_plan_file(args)


def cmd_build_native(args) -> int:
    from autosac.zero3 import native

    try:
        where = native.build(verbose=args.verbose)
    except native.NativeBuildError as e:
        print(f"autosac: error: {e} (run with --verbose for the compiler's output)", file=sys.stderr)
        return 2
    kernels = "CPU and CUDA" if native.has_cuda_kernel() else "CPU"
    print(f"autosac: native pack_downcast built ({kernels}) in {where}")
    return 0


def cmd_calibrate(args) -> int:
    """This machine's host costs (measured once, cached); ``--remeasure``: again now."""
    import time

    from autosac.tools import calibrate as host

    costs = host.remeasure(ops=not args.keep_op_timings) if args.remeasure else host.calibrate()
    for name, value in costs.to_dict().items():
        unit = "bytes" if name.endswith("_bytes") else "us/MiB" if name.endswith("_per_mib") else "us"
        print(f"{name:28s} {'-' if value is None else f'{value:.3f} {unit}'}")
    until = host.noisy_until()
    if until:
        print(f"not measured cleanly (a busy or drifting machine): measured again after "
              f"{time.strftime('%H:%M', time.localtime(until))}, or now with autosac calibrate --remeasure")
    return 0


def _plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="print the activation-checkpointing plan for a budget, or the batch size and "
                                    "plan that run fastest in a memory")
    _model_options(p, batch_sizes=True)
    p.add_argument("--budget", default=None, help='"8GiB", "500MB", "60%%" of the unconstrained peak, "least" (the '
                   'least feasible), or a whole number of bytes')
    p.add_argument("--memory", default=None, metavar="SIZE",
                   help="in place of --budget: plan every --batch size (default auto: 1..64) for this memory per "
                        "rank, e.g. 80GiB, and pick the one with the most predicted samples/s")
    p.add_argument("--global-batch", type=_positive_int, default=None, metavar="N",
                   help="with --memory: samples per optimizer step kept fixed, each batch size accumulating "
                        "N / (batch x world size) micro-batches")
    p.add_argument("--reserve", default=None, help="headroom to keep free, e.g. 2GiB")
    p.add_argument("--json", default=None, help="write the plan (with --memory: the chosen one) to this file")
    p.add_argument("--compile", default=None, metavar="BACKEND",
                   help="plan for torch.compile(model, backend=BACKEND): inductor or aot_eager (one process)")
    p.set_defaults(func=cmd_plan)


class _Parser(argparse.ArgumentParser):
    """A mistake in the options is one line on stderr (exit 2), as every other mistake is, not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="autosac", description="Fit a PyTorch training step into a memory budget.")
    sub = parser.add_subparsers(dest="command", required=True)
    _plan_parser(sub)
    s = sub.add_parser("sweep", help="plan for several budgets from one profile")
    _model_options(s)
    s.add_argument("--budgets", default="90%,80%,70%,60%,50%,40%,30%")
    s.add_argument("--reserve", default=None, help="headroom to keep free under every budget, e.g. 2GiB")
    s.add_argument("--plot", default=None, metavar="FILE",
                   help="draw budget vs recompute overhead to FILE (.png, .svg, .pdf; needs autosac[plot])")
    s.add_argument("--verify", action="store_true",
                   help="also run each plan for real on this CPU (with --target cpu) and plot the measured points")
    s.add_argument("--rounds", type=_positive_int, default=3,
                   help="with --verify: interleaved rounds of every variant; overheads are medians over them")
    s.set_defaults(func=cmd_sweep)
    v = sub.add_parser("verify", help="run a plan for real on this machine: predicted vs measured")
    v.add_argument("plan")
    _model_options(v)
    v.add_argument("--steps", type=_positive_int, default=3, help="timed steps per model and round (default 3)")
    v.add_argument("--rounds", type=_positive_int, default=5,
                   help="interleaved rounds of the model without and with the plan (default 5); the overhead is the "
                        "median over them")
    v.set_defaults(func=cmd_verify)
    b = sub.add_parser("build-native", help="compile the native pack_downcast op now (else: on first use)")
    b.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    b.set_defaults(func=cmd_build_native)
    c = sub.add_parser("calibrate", help="show this machine's host costs (measured once and cached); "
                       "--remeasure measures them and the CPU op timings again")
    c.add_argument("--remeasure", action="store_true",
                   help="measure again now (after a calibration on a busy or drifting machine); forgets the CPU op timings too")
    c.add_argument("--keep-op-timings", action="store_true", help="with --remeasure: keep the CPU op timings")
    c.set_defaults(func=cmd_calibrate)

    args = parser.parse_args(argv)
    # autosac's own warnings in one line; PyTorch's internal ones are not the user's concern
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\..*")
    warnings.formatwarning = lambda msg, *a, **k: f"{msg}\n"
    try:
        return args.func(args)
    except (UserError, MissingExtraError, ValueError, TypeError, TraceError, SolveTimeoutError, StatsFormatError,
            OSError) as e:
        name = "error" if isinstance(e, (UserError, MissingExtraError)) else type(e).__name__
        print(f"autosac: {name}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
