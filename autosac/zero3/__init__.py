"""Downcast gathers for FSDP2 (ZeRO-3): gather float32 parameters already cast
to bfloat16 (or float16) where the step only ever uses them cast.

How and why, with an example: :mod:`autosac.zero3.gathers` (this package
re-exports it); the cast op: :mod:`autosac.zero3.ops`."""

from autosac.zero3.gathers import (
    DowncastGathered,
    DowncastShard,
    downcast_params,
    install_downcast_gather,
    with_downcast_gather,
)

__all__ = ["downcast_params", "with_downcast_gather", "install_downcast_gather", "DowncastShard", "DowncastGathered"]
