"""Stage 1 of the pipeline: trace one training step into :class:`ModelStats`.

The code is in :mod:`autosac.trace.profiler`; this package re-exports it."""

from autosac.trace.profiler import profile

__all__ = ["profile"]
