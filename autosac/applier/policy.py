"""The selective-checkpoint policy of one decided module.

PyTorch asks the policy about every op call of the module's forward (once, in
the forward; the recompute replays the answers).  Calls are matched to the plan
by op name and occurrence, counted from the start of each forward call.

In the recompute, calls the plan marks dead (nothing discarded needs their
result; see :mod:`autosac.solver.replay`) are not computed: a dispatch mode
beneath PyTorch's cache hands back an empty tensor of the recorded shape.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autosac.plan import Decision

# ops PyTorch's SAC never shows a policy (its SAC_IGNORED_OPS)
_UNSEEN = {"detach"}


@dataclass
class ModulePolicy:
    """Plan-derived answers for one module, plus what it saw at run time."""

    fqn: str
    recompute: set[tuple[str, int]]
    save: set[tuple[str, int]]
    skip: set[tuple[str, int]]
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
        skip = {(str(op), int(occ)) for op, occ in d.skip_ops} - recompute - save
        return cls(d.fqn, recompute, save, skip, {str(k): int(v) for k, v in dict(d.op_counts).items()})

    def new_call(self) -> tuple:
        """For one forward call of the module: ``(context_fn, finished)`` --
        the checkpoint's context pair, and what to call after the forward."""
        seen: dict[str, int] = {}
        state = {"off": self.mismatched}
        # per op name, in forward order, one entry per call the recompute will
        # run: the output's (shape, stride, dtype, device) where it may be skipped
        replay: dict[str, deque] = defaultdict(deque)

        def policy(ctx, func, *args, **kwargs):
            name = func.overloadpacket.__name__
            occ = seen.get(name, 0)
            seen[name] = occ + 1
            if not state["off"] and occ >= self.op_counts.get(name, 0):
                state["off"] = True
                self._mismatch(f"an extra call of {name}")
            if state["off"]:
                return CheckpointPolicy.MUST_SAVE
            if (name, occ) in self.save:
                return CheckpointPolicy.MUST_SAVE
            # discarded calls, views, parameter casts and calls whose outputs
            # backward does not need: cheaper to re-run (or skip) than to hold
            replay[name].append(tree_map(_shape_of, ctx.op_output) if (name, occ) in self.skip else None)
            return CheckpointPolicy.PREFER_RECOMPUTE

        def context_fn():
            forward, recompute = create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation=True)
            return forward, _beneath(_SkipDeadCalls(replay, state), recompute)

        def finished() -> None:
            expected = {k: v for k, v in self.op_counts.items() if k not in _UNSEEN}
            if not state["off"] and seen != expected:
                state["off"] = True
                self._mismatch("a different op sequence")

        return context_fn, finished

    def _mismatch(self, what: str) -> None:
        self.mismatched = True
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"autosac: module '{self.fqn}' ran {what} than was traced (data-dependent control flow?); "
                "it is no longer checkpointed by the plan",
                stacklevel=4,
            )


def _shape_of(x):
    if isinstance(x, torch.Tensor):
        return _Shape(tuple(x.shape), tuple(x.stride()), x.dtype, x.device)
    return x


@dataclass(frozen=True)
class _Shape:
    size: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device


def _empty_like_shape(x):
    if isinstance(x, _Shape):
        return torch.empty_strided(x.size, x.stride, dtype=x.dtype, device=x.device)
    return x


class _SkipDeadCalls(TorchDispatchMode):
    """Runs beneath SAC's recompute mode, so it sees exactly the calls SAC
    re-runs, in forward order; hands back empty outputs for the dead ones.
    Never skips views, in-place or random ops, nor anything once the call's
    op sequence was found to differ from the plan's."""

    def __init__(self, replay: dict[str, deque], state: dict) -> None:
        super().__init__()
        self.replay = replay
        self.state = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        queue = self.replay.get(func.overloadpacket.__name__)
        shape = queue.popleft() if queue else None
        if (
            shape is None or self.state["off"] or func.is_view or func._schema.is_mutable
            or torch.Tag.nondeterministic_seeded in func.tags
        ):
            return func(*args, **kwargs)
        return tree_map(_empty_like_shape, shape)


@contextlib.contextmanager
def _beneath(below, above):
    """Enter ``below`` first, so ``above`` (entered last) sees each op first."""
    with below, above:
        yield
