"""Stage 3 of the pipeline: make a Plan real on the model (:func:`apply`,
:func:`unapply`).

How, and what it guarantees: :mod:`autosac.applier.model` (this package
re-exports it); one checkpointed call at run time: :mod:`autosac.applier.region`."""

from autosac.applier.model import CheckpointedForward, _checkpointed_forward, _Hook, _hook, applied_plan, apply, unapply  # noqa: F401 - public names outside __all__; CheckpointedForward, _checkpointed_forward, _hook, _Hook: what pickles of models applied before the move name here

__all__ = ["apply", "unapply"]
