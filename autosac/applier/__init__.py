"""Stage 3 of the pipeline: make a Plan real on the model.

Each decided module's forward runs under ``torch.utils.checkpoint`` (non-reentrant)
with a selective-checkpoint policy that recomputes exactly the planned op calls;
RNG state is preserved, so recomputed dropout draws the same mask, and
recomputation never updates buffers or Python state twice
(:mod:`autosac.applier.region`).  The checkpoint runs what the module ran
before: a ``forward`` set on the instance (accelerate's ``add_hook_to_module``)
is wrapped, not bypassed, and :func:`unapply` puts that same object back.
Around the whole model, a saved-tensor hook keeps parameter casts from being
saved, and a run with other input shapes than the plan's is warned about.

Everything apply puts on a model pickles (``torch.save(model)``) and deep-copies:
the checkpointed forward is a ``functools.partial`` of a module-level function,
and the model's hooks are :class:`_Hook` objects that pickle by name.

The code is in :mod:`autosac.applier.model`; this package re-exports it."""

from autosac.applier.model import CheckpointedForward, _checkpointed_forward, _Hook, _hook, applied_plan, apply, unapply  # noqa: F401 - public names outside __all__; CheckpointedForward, _checkpointed_forward, _hook, _Hook: what pickles of models applied before the move name here

__all__ = ["apply", "unapply"]
