"""Python-level state a forward may change: saved so a checkpoint's replay
does not change it again, and so a fake-mode trace leaves the model as it was.

A replay re-runs the module's Python ``forward``.  Whatever that code does to
objects that outlive the call -- ``self.calls += 1``, a lazily cached
attribute, a buffer re-bound, a key/value cache object passed in and appended
to -- would happen twice.  :func:`capture` records, at the start of a forward
call, the attributes of every module in the checkpointed subtree and of the
objects reachable from its arguments (shallowly: attribute bindings and the
contents of lists and dicts they hold); the replay runs with that state
swapped in, and the state the forward left is put back afterwards, so the
replay sees what the forward saw and leaves no trace.

A forward that draws from Python's or NumPy's global generator or a
``torch.Generator`` of its own (the trace notes which do:
``ModuleStats.host_rng``) has their states captured too
(:class:`autosac.core.rng.HostRng`), so its replay draws what it drew.

Tensors mutated in place (batch norm's running stats) are a dispatch-level
matter, handled by :mod:`autosac.applier.region`.  The trace installs the
state it captured when it is done, so attributes a forward assigned under
fake mode (a lazily built cache, say) do not outlive the profile.
"""

from __future__ import annotations

import operator
import types
from collections import OrderedDict

import torch
from torch import nn

from autosac.core.rng import HostRng

_ATOMS = (
    type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype, torch.device,
    types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, type,
)
_MAX_OBJECTS = 100_000  # objects besides the modules themselves
_MODULE_TABLES = ("_parameters", "_modules")
_PLAIN_CONTAINERS = frozenset({list, dict, OrderedDict})


class State:
    """Saved attribute bindings of some objects, restorable in place."""

    def __init__(self, saved: list[tuple[object, object]], empty: list | None = None,
                 rng: HostRng | None = None) -> None:
        self._saved = saved  # (container, copy of its contents)
        # containers that were empty (most of a module's hook tables): nothing to copy
        self._empty = empty or []
        self._rng = rng  # the host generators' states, where captured

    def install(self) -> None:
        """Make every captured container hold exactly what it held at capture
        time (and the host generators, where captured, their states)."""
        if self._rng is not None:
            self._rng.install()
        for obj in self._empty:
            if obj:
                obj.clear()
        for obj, copy in self._saved:
            if isinstance(obj, list):
                obj[:] = copy
            else:
                target = obj if isinstance(obj, dict) else obj.__dict__
                # by identity, in C (values compared in order: a reordered dict is rewritten, as it should be)
                if target.keys() != copy.keys() or any(map(operator.is_not, target.values(), copy.values())):
                    target.clear()
                    target.update(copy)

    def items(self) -> int:
        """How much a checkpointed call handles at each capture, swap and put-back
        of this state: the captured containers and their entries (what
        ``HostCosts.state_item_us`` prices)."""
        return len(self._saved) + len(self._empty) + sum(len(copy) for _, copy in self._saved)

    def grew(self) -> bool:
        """Whether any captured object or table has gained entries since capture
        (a forward that built lazy state: a cache attribute, a registered buffer)."""
        if any(self._empty):
            return True
        for obj, copy in self._saved:
            now = obj if isinstance(obj, (list, dict)) else obj.__dict__
            if len(now) > len(copy) or (not isinstance(obj, list) and not now.keys() <= copy.keys()):
                return True
        return False

    def recapture(self) -> State:
        """The same containers' contents as they are now."""
        saved = [(obj, _contents(obj)) for obj, _ in self._saved]
        saved.extend((obj, _contents(obj)) for obj in self._empty if obj)
        rng = None if self._rng is None else HostRng.now(self._rng.generators())
        return State(saved, [obj for obj in self._empty if not obj], rng)


def capture(module: nn.Module, args: tuple, kwargs: dict, host_rng: bool = False) -> State:
    """Record the state of ``module``'s subtree and of the objects its arguments reach.

    Every module of the subtree is captured; other objects (reached from the
    arguments and from the modules' attributes) up to ``_MAX_OBJECTS``.
    ``host_rng``: capture Python's and NumPy's global generators too, and
    the ``torch.Generator`` objects found on the way (a forward that draws
    from them).

    Example::

        >>> before = capture(block, args, kwargs)
        >>> after = before.recapture(); before.install(); ...; after.install()
    """
    saved: list[tuple[object, object]] = []
    empty: list = []
    seen: set[int] = set()
    todo: list[object] = []
    for m in module.modules():
        if id(m) in seen:
            continue
        seen.add(id(m))
        saved.append((m, _contents(m)))
        # children are captured on their own; the parameter table is left alone
        # (FSDP2 re-binds unsharded parameters there around each use)
        todo.extend(v for k, v in m.__dict__.items() if k not in _MODULE_TABLES)
    todo.extend((*args, *kwargs.values()))
    todo.reverse()  # walk in order: the first objects found are the first captured
    others = 0
    generators: dict[int, torch.Generator] = {}
    while todo and others < _MAX_OBJECTS:
        obj = todo.pop()
        kind = _KINDS.get(type(obj)) or _kind_of(type(obj))
        if kind is _SKIP:
            if host_rng and type(obj) is torch.Generator:
                generators[id(obj)] = obj
            continue
        if kind is _PLAIN and not obj:  # (hook tables) the same container twice is harmless
            empty.append(obj)
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        others += 1
        if kind is _PLAIN or kind is _LISTDICT:
            saved.append((obj, _contents(obj)))
            items = list(obj if isinstance(obj, list) else obj.values())
        elif kind is _TUPLE:
            items = list(obj)
        elif isinstance(getattr(obj, "__dict__", None), dict):
            saved.append((obj, _contents(obj)))
            items = [] if kind is _MODULE else list(obj.__dict__.values())
        else:
            items = []
        todo.extend(reversed(items))
    return State(saved, empty, HostRng.now(generators.values()) if host_rng else None)


# What capture does with an object, decided once per type (a dict lookup per
# value instead of isinstance checks: capture runs at every checkpointed call).
_SKIP, _PLAIN, _LISTDICT, _TUPLE, _MODULE, _OBJECT = "skip", "plain", "listdict", "tuple", "module", "object"
_KINDS: dict[type, str] = {}


def _kind_of(kind: type) -> str:
    if kind in _PLAIN_CONTAINERS:
        found = _PLAIN
    elif issubclass(kind, _ATOMS) or _torch_internal_type(kind):
        found = _SKIP
    elif issubclass(kind, (list, dict)):
        found = _LISTDICT
    elif issubclass(kind, tuple):
        found = _TUPLE
    elif issubclass(kind, nn.Module):
        found = _MODULE
    elif (kind.__module__ or "").split(".")[0] == "autosac":
        found = _SKIP  # autosac's own objects on a module (the applier's policy, forward, hooks): nothing a forward changes
    else:
        found = _OBJECT
    _KINDS[kind] = found
    return found


def _torch_internal_type(kind: type) -> bool:
    """PyTorch's own bookkeeping objects (FSDP2's per-module state, hook
    handles, DTensor specs): not user state, and copying their attributes would
    keep alive what they release -- FSDP2's gathered parameters after a
    forward, say.  Modules are captured on their own.  (Asked once per type: :func:`_kind_of`.)"""
    return not issubclass(kind, nn.Module) and (kind.__module__ or "").split(".")[0] == "torch"


def _contents(obj):
    if isinstance(obj, list):
        return list(obj)
    return dict(obj if isinstance(obj, dict) else obj.__dict__)
