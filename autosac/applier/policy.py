"""The selective-checkpoint policy of one decided module.

PyTorch asks the policy about every op call of the module's forward (once, in
the forward; the recompute replays the answers).  Calls are matched to the plan
by op name and occurrence, counted from the start of each forward call.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from torch.utils.checkpoint import CheckpointPolicy

from autosac.plan import Decision

# ops PyTorch's SAC never shows a policy (its SAC_IGNORED_OPS)
_UNSEEN = {"detach"}


@dataclass
class ModulePolicy:
    """Plan-derived answers for one module, plus what it saw at run time."""

    fqn: str
    recompute: set[tuple[str, int]]
    save: set[tuple[str, int]]
    op_counts: dict[str, int]
    mismatched: bool = False
    _warned: bool = field(default=False, repr=False)

    @classmethod
    def from_decision(cls, d: Decision) -> ModulePolicy:
        """Raises TypeError/ValueError on malformed (hand-edited) op entries."""
        recompute = set()
        for op in d.ops:
            recompute.add((str(op.op), int(op.occurrence)))
            recompute.update((str(w[0]), int(w[1])) for w in op.writers)
        save = {(str(op), int(occ)) for op, occ in d.save_ops} - recompute
        return cls(d.fqn, recompute, save, {str(k): int(v) for k, v in dict(d.op_counts).items()})

    def new_call(self):
        """A fresh policy function for one forward call of the module."""
        seen: dict[str, int] = {}
        state = {"off": self.mismatched}

        def policy(ctx, func, *args, **kwargs):
            name = func.overloadpacket.__name__
            occ = seen.get(name, 0)
            seen[name] = occ + 1
            if not state["off"] and occ >= self.op_counts.get(name, 0):
                state["off"] = True
                self._mismatch(f"an extra call of {name}")
            if state["off"]:
                return CheckpointPolicy.MUST_SAVE
            if (name, occ) in self.recompute:
                return CheckpointPolicy.PREFER_RECOMPUTE
            if (name, occ) in self.save:
                return CheckpointPolicy.MUST_SAVE
            # views, parameter casts and ops whose outputs backward does not need:
            # cheaper to re-run than to hold
            return CheckpointPolicy.PREFER_RECOMPUTE

        def finished() -> None:
            expected = {k: v for k, v in self.op_counts.items() if k not in _UNSEEN}
            if not state["off"] and seen != expected:
                self._mismatch("a different op sequence")

        return policy, finished

    def _mismatch(self, what: str) -> None:
        self.mismatched = True
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"autosac: module '{self.fqn}' ran {what} than was traced (data-dependent control flow?); "
                "it is no longer checkpointed by the plan",
                stacklevel=4,
            )

