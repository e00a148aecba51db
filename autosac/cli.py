"""The ``autosac`` command: plan, sweep and verify from the shell.

User mistakes end in one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from autosac.budget import format_bytes, parse_budget
from autosac.errors import InfeasibleBudgetError, SolveTimeoutError, StatsFormatError, TraceError
from autosac.modelspec import UserError, build_from_spec

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2", help="built-in name (gpt2, llama-7b, ...), hf:NAME (hf:llama, hf:gpt2, hf:bert, hf:mistral, "
                        "hf:qwen2, hf:qwen3: a transformers config, no download) or package.module:factory")
    p.add_argument("--model-arg", action="append", default=[], metavar="K=V", help="config override, repeatable")
    p.add_argument("--batch", type=_positive_int, default=None)
    p.add_argument("--seq", type=_positive_int, default=None)
    p.add_argument("--target", default="h100", help="h100, h200, a100, l4, or cpu (timed locally)")
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
    p.add_argument("--solver", default="cbc", choices=["cbc", "highs"])
    p.add_argument("--time-limit", type=_positive_float, default=60.0, help="seconds for the solver")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value:g} is not positive")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def _profile(args):
    import torch

    import autosac

    if args.downcast_gather and (args.world_size < 2 or not args.autocast):
        raise ValueError("--downcast-gather needs --world-size > 1 and --autocast (bf16 or fp16)")
    model, inputs = build_from_spec(args.model, args.model_arg, args.batch, args.seq)
    dtypes = {k: getattr(torch, _DTYPES[v]) for k, v in (("param_dtype", args.param_dtype),
                                                          ("reduce_dtype", args.reduce_dtype),
                                                          ("autocast", args.autocast)) if v}
    stats = autosac.profile(model, inputs, optimizer=args.optimizer, target=args.target, world_size=args.world_size,
                            shard_units=args.shard_units, **dtypes)
    if args.downcast_gather:
        stats = autosac.zero3.with_downcast_gather(stats, dtypes["autocast"])
    return stats


def cmd_plan(args) -> int:
    import autosac

    parse_budget(args.budget, 1 << 60)  # reject a malformed budget before the profile runs
    stats = _profile(args)
    plan = autosac.solve(stats, args.budget, solver=args.solver, time_limit_s=args.time_limit,
                         reserve=args.reserve or 0)
    print(plan)
    if args.json:
        plan.save(args.json)
        print(f"\nplan written to {args.json}")
    return 0


def cmd_sweep(args) -> int:
    from autosac.report import sweep_table
    from autosac.solver import solve_stats
    from autosac.solver.problem import build_problem

    for item in args.budgets.split(","):
        parse_budget(item.strip(), 1 << 60)
    stats = _profile(args)
    problem = build_problem(stats)
    rows = []
    for item in args.budgets.split(","):
        budget = parse_budget(item.strip(), stats.peak_bytes)
        try:
            plan = solve_stats(stats, budget, solver=args.solver, time_limit_s=args.time_limit, problem=problem)
        except InfeasibleBudgetError as e:
            rows.append({"budget": budget, "error": f"infeasible (least peak {format_bytes(e.min_feasible_bytes)})"})
            continue
        rows.append({"budget": budget, "peak": plan.predicted_peak_bytes, "ms": plan.recompute_ms,
                     "overhead": plan.overhead, "modules": len(plan.decisions), "status": plan.solver["status"]})
    print(f"{stats.model} on {stats.target['name']}: baseline peak {format_bytes(stats.peak_bytes)}, "
          f"step {stats.step_ms:.2f} ms\n")
    print(sweep_table(rows))
    if args.plot:
        _plot(rows, args.plot, stats)
    return 0


def _plot(rows, path, stats) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    ok = [r for r in rows if not r.get("error")]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["peak"] / 2**30 for r in ok], [100 * r["overhead"] for r in ok], "o-")
    ax.set_xlabel("planned peak (GiB)")
    ax.set_ylabel("recompute overhead (% of step)")
    ax.set_title(f"{stats.model}: memory vs recompute")
    fig.tight_layout()
    fig.savefig(path)
    print(f"\nplot written to {path}")


def cmd_verify(args) -> int:
    from autosac.verify import verify_plan_file

    return verify_plan_file(args)


def cmd_build_native(args) -> int:
    from autosac import native

    try:
        where = native.build(verbose=args.verbose)
    except native.NativeBuildError as e:
        print(f"autosac: error: {e} (run with --verbose for the compiler's output)", file=sys.stderr)
        return 2
    kernels = "CPU and CUDA" if native.has_cuda_kernel() else "CPU"
    print(f"autosac: native pack_downcast built ({kernels}) in {where}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autosac", description="Fit a PyTorch training step into a memory budget.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the activation-checkpointing plan for a budget")
    _model_options(p)
    p.add_argument("--budget", required=True, help='"8GiB", "500MB", "60%%" or bytes')
    p.add_argument("--reserve", default=None, help="headroom to keep free, e.g. 2GiB")
    p.add_argument("--json", default=None, help="write the plan to this file")
    p.set_defaults(func=cmd_plan)
    s = sub.add_parser("sweep", help="plan for several budgets from one profile")
    _model_options(s)
    s.add_argument("--budgets", default="90%,80%,70%,60%,50%,40%,30%")
    s.add_argument("--plot", default=None, help="write a peak-vs-overhead plot (needs matplotlib)")
    s.set_defaults(func=cmd_sweep)
    v = sub.add_parser("verify", help="run a plan for real on this machine: predicted vs measured")
    v.add_argument("plan")
    _model_options(v)
    v.add_argument("--steps", type=int, default=3)
    v.set_defaults(func=cmd_verify)
    b = sub.add_parser("build-native", help="compile the native pack_downcast op now (else: on first use)")
    b.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    b.set_defaults(func=cmd_build_native)

    args = parser.parse_args(argv)
    # autosac's own warnings in one line; PyTorch's internal ones are not the user's concern
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\..*")
    warnings.formatwarning = lambda msg, *a, **k: f"{msg}\n"
    try:
        return args.func(args)
    except (UserError, ValueError, TypeError, TraceError, SolveTimeoutError, StatsFormatError, OSError) as e:
        name = type(e).__name__ if not isinstance(e, UserError) else "error"
        print(f"autosac: {name}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
