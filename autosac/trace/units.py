"""Which modules are FSDP2 units: checked at profile time, read by the solver."""

from __future__ import annotations

import re

from torch import nn


def refuse_sharded(model: nn.Module, world_size: int) -> None:
    """Raise ValueError, naming its units, for a model ``fully_shard`` already
    sharded: its parameters are DTensor shards that a fake-mode trace cannot
    gather.  Profile the unsharded model (on ``meta`` is enough) instead."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2: nothing can be sharded
        return
    units = [fqn for fqn, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not units:
        return
    inner = [u for u in units if u]
    shown = repr(inner) if len(inner) <= 6 else repr(inner[:6])[:-1] + ", ...]"
    raise ValueError(
        f"the model is already sharded by fully_shard ({len(units)} units): profile it before sharding "
        f"(on meta is enough), with world_size={world_size if world_size > 1 else 'N'} and shard_units={shown}"
    )


def resolve_shard_units(model: nn.Module, spec, world_size: int) -> list[str]:
    """The module names ``spec`` selects (names or patterns whose ``*`` and
    ``?`` stay within one dotted part: ``"layers.*"`` is each child of
    ``layers``; a list or a comma-separated string), in model order; [] for
    the default (one unit per block).

    Raises:
        ValueError: units without ``world_size > 1``; a name or pattern that
            selects no module; the root; a unit inside another.
    """
    if spec is None or spec == [] or spec == "":
        return []
    if world_size < 2:
        raise ValueError("shard_units are FSDP2 units: they need world_size > 1")
    patterns = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else [str(p) for p in spec]
    names = [fqn for fqn, _ in model.named_modules()]
    chosen: list[str] = []
    for pat in patterns:
        rx = re.compile(re.escape(pat).replace(r"\*", r"[^.]*").replace(r"\?", r"[^.]"))
        hits = [n for n in names if n and rx.fullmatch(n)]
        if not hits:
            if pat == "":
                raise ValueError("shard_units: the root is always a unit: name the modules inside it")
            raise ValueError(f"shard_units: {pat!r} names no module of {type(model).__name__}")
        chosen += [h for h in hits if h not in chosen]
    chosen.sort(key=names.index)
    for a in chosen:
        outer = next((b for b in chosen if a != b and a.startswith(b + ".")), None)
        if outer is not None:
            raise ValueError(f"shard_units: {a!r} lies inside {outer!r}: nested units are not modelled, "
                             "name the outer ones")
    return chosen
