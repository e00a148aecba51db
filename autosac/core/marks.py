"""Attribute names autosac sets on a user's model, in one place for every stage
that looks for them (the trace refuses a model that carries an applied plan)."""

APPLIED = "_autosac_state"  # on the root module: {"plan": Plan, ...} while a plan is applied
POLICY = "_autosac_policy"  # on each checkpointed module: its RegionPolicy
CACHE_WARNED = "_autosac_cache_warned"  # on a transformers model inside a planned model: use_cache warned about


def has_applied_plan(model) -> bool:
    """Whether :func:`autosac.apply` put a plan on ``model`` (and it was not undone)."""
    return APPLIED in getattr(model, "__dict__", {})
