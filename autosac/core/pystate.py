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
        if any(self._empty):  # (a C-level pass: most calls find them all still empty)
            for obj in self._empty:
                if obj:
                    obj.clear()
        for obj, copy in self._saved:
            if _holds(obj, copy):
                continue
            if isinstance(obj, list):
                obj[:] = copy
            else:
                target = obj if isinstance(obj, dict) else obj.__dict__
                target.clear()
                target.update(copy)

    def swap_in(self) -> State:
        """Make every captured object hold this state again; returns the state
        to install afterwards (what they held).  Where nothing changed since
        capture (most calls: a forward that leaves its modules as they were)
        that is this state itself, and nothing is copied."""
        if self._rng is None and self._unchanged():
            return self
        after = self.recapture()
        self.install()
        return after

    def _unchanged(self) -> bool:
        """Whether every captured container holds what it held at capture."""
        return not any(self._empty) and all(_holds(obj, copy) for obj, copy in self._saved)

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
        empty = self._empty
        if any(empty):
            saved.extend((obj, _contents(obj)) for obj in empty if obj)
            empty = [obj for obj in empty if not obj]
        rng = None if self._rng is None else HostRng.now(self._rng.generators())
        return State(saved, empty, rng)


def _holds(obj, copy) -> bool:
    """Whether ``obj`` (a list, a dict, an object's attribute table) holds
    ``copy``'s items, keys and values by identity, in order, in C (a
    reordered table does not: it is rewritten, as it should be)."""
    now = obj if isinstance(obj, (list, dict)) else obj.__dict__
    if len(now) != len(copy) or any(map(operator.is_not, now, copy)):
        return False  # (a list's items, a table's keys)
    return isinstance(obj, list) or not any(map(operator.is_not, now.values(), copy.values()))


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
    stack = [module]
    while stack:  # module.modules(), pre-order, without its generators' cost
        m = stack.pop()
        if m is None or id(m) in seen:
            continue
        seen.add(id(m))
        saved.append((m, _contents(m)))
        _table_values(m.__dict__, todo, empty, module=True)
        stack.extend(reversed(m._modules.values()))
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
        elif isinstance(table := getattr(obj, "__dict__", None), dict):
            saved.append((obj, table.copy()))
            if kind is not _MODULE:
                _table_values(table, todo, empty, module=False)
            continue
        else:
            items = []
        todo.extend(reversed(items))
    return State(saved, empty, HostRng.now(generators.values()) if host_rng else None)


def _table_values(table: dict, todo: list, empty: list, module: bool) -> None:
    """An object's attribute values for :func:`capture` to walk next, onto
    ``todo``; its empty plain containers (most of a module's hook tables)
    straight onto ``empty`` and its atoms (flags, numbers, strings) left out,
    as the walk would treat them.  A ``module``'s children are captured on
    their own and its parameter table is left alone (FSDP2 re-binds unsharded
    parameters there around each use).  Which values are which is decided once
    per layout (keys and value types), so a call costs a few C-level passes
    rather than a Python step per value."""
    values = tuple(table.values())
    key = (module, tuple(table), tuple(map(type, values)))
    layout = _LAYOUTS.get(key)
    if layout is None:
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.clear()
        layout = _LAYOUTS[key] = _Layout(*key)
    plain = layout.plain(values)
    if any(plain):  # a hook table in use, a filled list: walked as any container
        empty.extend(p for p in plain if not p)
        walked = [p for p in plain if p] + list(layout.rest(values))
    else:
        empty.extend(plain)
        walked = layout.rest(values)
    # in order: a module's are reversed with the rest of capture's list, an object's are next
    todo.extend(walked if module else reversed(walked))


class _Layout:
    """Where an attribute table's plain containers and its other non-atom values sit."""

    def __init__(self, module: bool, keys: tuple, kinds: tuple) -> None:
        plain, rest = [], []
        for i, (k, t) in enumerate(zip(keys, kinds)):
            kind = _KINDS.get(t) or _kind_of(t)
            if (module and k in _MODULE_TABLES) or (kind is _SKIP and t is not torch.Generator):
                continue
            (plain if kind is _PLAIN else rest).append(i)
        self.plain, self.rest = _getter(plain), _getter(rest)


def _getter(positions: list):
    """A C-level picker of ``positions`` from a tuple, always returning a tuple."""
    if not positions:
        return lambda values: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda values: (values[i],)
    return operator.itemgetter(*positions)


_LAYOUTS: dict[tuple, _Layout] = {}
_MAX_LAYOUTS = 4096


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
    elif not any("__dict__" in vars(k) for k in kind.__mro__):
        found = _SKIP  # instances have no attribute table (a set, a deque, slots): nothing capture could copy
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
