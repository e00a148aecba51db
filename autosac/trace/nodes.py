"""Which forward op made each autograd node: backward ops are attributed to
the module whose forward created the node they run in.

Autograd numbers its nodes in creation order, so the forward's nodes, mapped
as each op's outputs get theirs, form a sorted table: the node a backward op
runs in was made by the closest mapped node at or before it."""

from __future__ import annotations

import bisect

import torch

from autosac.trace.recording import Stack

_ACCUMULATE_GRAD_SEQ = 2**64 - 1


class NodeOrigins:
    """The forward's autograd nodes, each with the module stack and the forward
    event that made it; and whether the backward is inside a node's own
    computation now (:attr:`applying`)."""

    def __init__(self) -> None:
        self._keys: list[int] = []
        self._stacks: list[Stack] = []
        self._events: list[int] = []
        self.applying = 0  # depth of backward nodes computing now

    def add(self, node, stack: Stack, event: int) -> None:
        """Remember that ``node`` was made in ``stack`` by forward ``event``.
        Nodes are numbered in creation order: one no newer than the last mapped
        was passed on, not made, by the op."""
        seq = node._sequence_nr()
        if self._keys and seq <= self._keys[-1]:
            return
        self._watch_apply(node)
        self._keys.append(seq)
        self._stacks.append(stack)
        self._events.append(event)

    def _watch_apply(self, node) -> None:
        """Count when the backward runs inside a node's own computation, so that
        the engine's work between nodes (summing gradients) can be told apart."""

        def enter(grad_outputs):
            self.applying += 1

        def leave(grad_inputs, grad_outputs):
            self.applying -= 1

        node.register_prehook(enter)
        node.register_hook(leave)

    def of_running(self, param_stack: dict[int, Stack]) -> tuple[Stack, int]:
        """The module stack the running backward node was created in, and the
        forward event that created it (-1 for gradient accumulation, whose
        stack is its parameter's owner's in ``param_stack``: id(param) -> stack)."""
        node = torch._C._current_autograd_node()
        if node is None:
            return (), -1
        seq = node._sequence_nr()
        if seq == _ACCUMULATE_GRAD_SEQ:
            var = getattr(node, "variable", None)
            return (param_stack.get(id(var), ()) if var is not None else ()), -1
        # Nodes are numbered in creation order, so the closest mapped node at or
        # before this one was created by the same module's forward.
        i = bisect.bisect_right(self._keys, seq) - 1
        return (self._stacks[i], self._events[i]) if i >= 0 else ((), -1)
