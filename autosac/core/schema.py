"""Type-checking the JSON that :class:`autosac.Plan` and :class:`autosac.ModelStats`
load, against their dataclasses' own annotations: a hand-edited or corrupted
file fails when it is loaded, in one line naming the field, not later in a
print, a solve or a forward.

Every ``int`` field must hold an int (not a bool, not 3.0), every ``float``
field a finite number, ``str`` a string, ``bool`` a bool; lists and dicts are
checked element by element, nested dataclasses field by field, and the
contents of plain ``dict``/``list`` fields must be JSON data whose numbers
are finite.
"""

from __future__ import annotations

import json
import math
import numbers
import reprlib
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from functools import cache

from autosac.core.errors import StatsFormatError

_SCALARS = {int: "an int", float: "a finite number", str: "a string", bool: "true or false"}
_short = reprlib.Repr()
_short.maxstring = _short.maxother = 40
_short.maxlevel = 2


def parse(text, what: str) -> object:
    """``text`` as JSON, or one line saying why it is not (``what``: "a plan")."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
        raise StatsFormatError(f"not {what} JSON document: {e}") from None
    except RecursionError:
        raise StatsFormatError(f"not {what} JSON document: nested too deeply") from None


def build(cls, data, where: str, strict: bool = True):
    """An instance of dataclass ``cls`` from JSON ``data``, every field checked
    against its annotation (``strict``: no keys beyond its fields)."""
    if not isinstance(data, dict):
        raise _error(where, "an object", data)
    known = _hints(cls)
    if strict and (extra := sorted(set(data) - set(known))):
        raise StatsFormatError(f"{where} has no field {extra[0]!r}")
    kwargs = {}
    for f in fields(cls):
        if f.name in data:
            kwargs[f.name] = convert(data[f.name], known[f.name], _join(where, f.name))
        elif f.default is MISSING and f.default_factory is MISSING:
            raise StatsFormatError(f"{_join(where, f.name)} is missing")
    return cls(**kwargs)


def check(obj, where: str = "") -> None:
    """Check a dataclass instance made in memory the way :func:`build` checks JSON."""
    hints = _hints(type(obj))
    for f in fields(obj):
        convert(getattr(obj, f.name), hints[f.name], _join(where, f.name))


def convert(value, hint, where: str):
    """``value`` checked against type ``hint`` (dicts become the dataclasses it names)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        return convert(value, next(a for a in args if a is not type(None)), where)
    if is_dataclass(hint):
        if isinstance(value, hint):
            check(value, where)
            return value
        return build(hint, value, where)
    if hint in _SCALARS:
        return _scalar(value, hint, where)
    if (origin or hint) is list:
        if not isinstance(value, list):
            raise _error(where, "a list", value)
        if not args:
            _json_data(value, where)
            return value
        return _list(value, args[0], where)
    if (origin or hint) is dict:
        if not isinstance(value, dict):
            raise _error(where, "an object", value)
        for k in value:
            if not isinstance(k, str):
                raise _error(where, "an object with string keys", k)
        if not args:
            _json_data(value, where)
            return value
        return {k: convert(v, args[1], f"{where}[{k!r}]") for k, v in value.items()}
    raise TypeError(f"autosac.core.schema: no check for {hint!r} ({where})")  # a new annotation: teach this module


def _list(value: list, hint, where: str) -> list:
    if hint in _SCALARS:  # the long columns (a timeline's): checked in bulk, the first bad one named
        if all(_ok(x, hint) for x in value):
            return [float(x) for x in value] if hint is float else value
        i = next(i for i, x in enumerate(value) if not _ok(x, hint))
        raise _error(f"{where}[{i}]", _SCALARS[hint], value[i])
    return [convert(x, hint, f"{where}[{i}]") for i, x in enumerate(value)]


def _ok(x, hint) -> bool:
    if hint is float:
        return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
    if hint is int:  # numbers.Integral: numpy's ints too, in a plan made in memory
        return isinstance(x, numbers.Integral) and not isinstance(x, bool)
    return isinstance(x, hint)


def _scalar(value, hint, where: str):
    if not _ok(value, hint):
        raise _error(where, _SCALARS[hint], value)
    return float(value) if hint is float else value


def _json_data(value, where: str) -> None:
    """Plain JSON data under ``value``, its numbers finite (iteratively: any depth)."""
    todo = [(where, value)]
    while todo:
        at, x = todo.pop()
        if isinstance(x, dict):
            todo.extend((f"{at}[{k!r}]", v) for k, v in x.items())
        elif isinstance(x, list):
            todo.extend((f"{at}[{i}]", v) for i, v in enumerate(x))
        elif isinstance(x, float) and not math.isfinite(x):
            raise _error(at, "a finite number", x)
        elif x is not None and not isinstance(x, (str, int, float)):
            raise _error(at, "JSON data", x)


@cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def short(value) -> str:
    """``repr(value)``, cut short for a one-line message."""
    return _short.repr(value)


def _error(where: str, expected: str, got) -> StatsFormatError:
    return StatsFormatError(f"{where} must be {expected}, got {short(got)}")


def check_common(obj) -> None:
    """What a plan and a profile share: the inputs and the loop they were made for."""
    from autosac.core.loop import ZERO_GRAD

    check_signature(obj.input_shapes, "input_shapes")
    if obj.world_size < 1:
        raise _error("world_size", "an int >= 1", obj.world_size)
    if obj.grad_accumulation < 1:
        raise _error("grad_accumulation", "an int >= 1", obj.grad_accumulation)
    if obj.batches_ahead < 0:
        raise _error("batches_ahead", "an int >= 0", obj.batches_ahead)
    if obj.zero_grad not in ZERO_GRAD:
        raise _error("zero_grad", " or ".join(map(repr, ZERO_GRAD)), obj.zero_grad)
    if obj.autocast and not _is_dtype(obj.autocast):
        raise _error("autocast", "'' or a torch dtype's name ('bfloat16')", obj.autocast)


def check_signature(sig: list, where: str) -> None:
    """``[[where, shape, dtype], ...]`` as :func:`autosac.core.inputs.input_signature` makes it."""
    for i, entry in enumerate(sig):
        at = f"{where}[{i}]"
        if len(entry) != 3:
            raise _error(at, "[where, shape, dtype]", entry)
        name, shape, dtype = entry
        if not isinstance(name, str):
            raise _error(f"{at}[0]", "a string", name)
        if not isinstance(shape, list) or not all(_ok(n, int) and n >= 0 for n in shape):
            raise _error(f"{at}[1]", "a list of sizes (ints >= 0)", shape)
        if not _is_dtype(dtype):
            raise _error(f"{at}[2]", "a torch dtype's name ('float32')", dtype)


def _is_dtype(name) -> bool:
    import torch

    return isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype)
