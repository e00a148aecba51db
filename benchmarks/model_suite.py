"""The model suite's table: for every model the tests plan (transformers, timm,
diffusers, ordinary modules), at 70 %, 50 % and the least feasible budget:
predicted and measured peak, the budget, and whether one training step stayed
bitwise equal -- in both training loops (autosac.core.loop): ``held`` (``out =
model(x)`` kept through backward, the default) and ``dropped`` (the output
dies at the loss).

    python benchmarks/model_suite.py > benchmarks/results/model_suite.md

Runs the same checks as ``tests/test_real_models.py``, ``tests/test_model_zoo.py``,
``tests/test_ordinary_modules.py`` and ``tests/test_moe.py`` (and fails the same
way).  Mixture-of-experts rows are planned for balanced routing and measured
with the step forced to route so (``autosac.trace.routing.forced``); their
bitwise step routes as the data does.

    python benchmarks/model_suite.py mixtral-grouped_mm top2-capacity   # only these rows
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import test_model_zoo  # noqa: E402
import test_moe  # noqa: E402
import test_ordinary_modules as ordinary  # noqa: E402
import test_real_models as real  # noqa: E402
import torch  # noqa: E402
import zoo  # noqa: E402
from suite import check_model, seeded  # noqa: E402


def cases():
    for name, make, attn, cache in real.HF:
        yield name, seeded(make(attn, cache)), dict(
            loss_fn=lambda out: out.loss, expect_warning="use_cache=True" if cache else None)
    try:
        from timm_import import import_timm

        timm = import_timm()
        yield "timm-resnet10t", seeded(lambda: (timm.create_model("resnet10t", num_classes=10).train(),
                                                 torch.randn(16, 3, 96, 96))), {}
        yield "timm-mobilenetv3", seeded(lambda: (timm.create_model("mobilenetv3_small_050", num_classes=10).train(),
                                                   torch.randn(16, 3, 96, 96))), {}
        yield "timm-vit-tiny", seeded(lambda: (timm.create_model(
            "vit_tiny_patch16_224", num_classes=10, img_size=96, drop_path_rate=0.1, depth=4).train(),
            torch.randn(16, 3, 96, 96))), {}
    except ImportError:
        pass
    for name in [*zoo.ZOO, *zoo.WRAPPED]:
        build, loss_fn = zoo.for_check(name)
        cached = name.removeprefix("wrapped-") in test_model_zoo.CACHED
        yield name, build, dict(loss_fn=loss_fn, expect_warning="use_cache=True" if cached else None)
    for name, (build, tol) in ordinary.CASES.items():
        yield name, seeded(build), dict(tolerance=tol)
    yield "shared-block", seeded(lambda: (ordinary.SharedBlock(), torch.randn(1024, 16))), {}
    yield "nested-shared", seeded(lambda: (ordinary.NestedShared(), torch.randn(2048, 64))), {}
    for name, (make, loss_fn) in test_moe.MOE.items():
        yield name, seeded(make), dict(loss_fn=loss_fn, routing="balanced")


def main() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    only = set(sys.argv[1:])  # model names to run (default: all)
    print("| model | loop | budget | budget bytes | predicted | measured | error | bitwise | plan |")
    print("|---|---|---|---:|---:|---:|---:|---|---|")
    for name, build, kwargs in cases():
        if only and name not in only:
            continue
        for held in (True, False):
            loop = "held" if held else "dropped"
            for r in check_model(name, build, output_held=held, **kwargs):
                if r.predicted is None:
                    print(f"| {name} | {loop} | {r.budget} | {r.budget_bytes:,} | - | - | - | - | {r.note} |")
                    continue
                err = (r.predicted - r.measured) / r.measured
                print(f"| {name} | {loop} | {r.budget} | {r.budget_bytes:,} | {r.predicted:,} | {r.measured:,} "
                      f"| {err:+.2%} | {'yes' if r.bitwise else 'NO'} | {r.note} |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
