"""autosac.core.pystate: what a checkpointed call's state capture records and
puts back.  Capture decides where a table's values sit once per layout (its
keys and value types); these tests hold it to a plain walk of every value, and
check that a layout seen before does not hide a change."""

import types
from collections import OrderedDict

import pytest
import torch
from torch import nn

from autosac.core import pystate
from autosac.core.pystate import capture

_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype, torch.device, type,
          types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType)


def reference_walk(module, args, kwargs):
    """The capture's specification, one value at a time: every module's table;
    every list, dict and attribute table reachable from the modules' attributes
    and the arguments (not through other modules, nor a module's parameter and
    child tables); empty lists and dicts only noted.  Returns (ids of the
    captured objects, ids of the noted empty containers)."""
    saved, empty, seen = set(), set(), set()
    todo = []
    for m in module.modules():
        saved.add(id(m))
        seen.add(id(m))
        todo += [v for k, v in vars(m).items() if k not in ("_parameters", "_modules")]
    todo += [*args, *kwargs.values()]
    while todo:
        obj = todo.pop()
        if isinstance(obj, _ATOMS) or type(obj).__module__.split(".")[0] in ("torch", "autosac"):
            continue
        if type(obj) in (list, dict, OrderedDict) and not obj:
            empty.add(id(obj))
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, dict)):
            saved.add(id(obj))
            todo += list(obj.values() if isinstance(obj, dict) else obj)
        elif isinstance(obj, tuple):
            todo += list(obj)
        elif isinstance(getattr(obj, "__dict__", None), dict):
            saved.add(id(obj))
            if not isinstance(obj, nn.Module):
                todo += list(vars(obj).values())
    return saved, empty


class Config:
    def __init__(self):
        self.width, self.name, self.labels, self.unused = 8, "c", {0: "a", 1: "b"}, {}
        self.history = [1, [2, 3]]


class Slots:
    __slots__ = ("a",)

    def __init__(self):
        self.a = [1]


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config, self.lin, self.tags = config, nn.Linear(4, 4), {"seen", "x"}
        self.slots, self.cache, self.shape = Slots(), {}, (4, [5])
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x, extra=None):
        return self.lin(x) * self.scale


def _captured(state):
    return {id(obj) for obj, _ in state._saved}, {id(obj) for obj in state._empty}


def test_capture_matches_the_plain_walk_as_layouts_change():
    config = Config()
    blk = Block(config)
    args, kwargs = (torch.ones(2, 4),), {"extra": {"k": [1]}}
    assert _captured(capture(blk, args, kwargs)) == reference_walk(blk, args, kwargs)
    # the same layouts, now with a hook table and a cache in use, an attribute re-bound to another type
    handle = blk.lin.register_forward_hook(lambda *a: None)
    blk.cache["k"] = {"deep": []}
    config.width = {"now": "a dict"}
    assert _captured(capture(blk, args, kwargs)) == reference_walk(blk, args, kwargs)
    handle.remove()
    blk.cache.clear()
    assert _captured(capture(blk, args, kwargs)) == reference_walk(blk, args, kwargs)


def test_capture_matches_the_plain_walk_on_a_transformers_block():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    blk = transformers.GPT2LMHeadModel(cfg).transformer.h[0]
    args, kwargs = (torch.ones(1, 4, 32),), {"position_ids": torch.arange(4), "use_cache": False}
    for _ in range(2):  # the second with every layout seen before
        assert _captured(capture(blk, args, kwargs)) == reference_walk(blk, args, kwargs)


def test_install_puts_back_what_a_forward_changed_under_a_known_layout():
    blk = Block(Config())
    capture(blk, (), {})  # every layout now known
    before = capture(blk, (), {})
    scale, width = blk.scale, blk.config.width
    blk.lin.register_forward_pre_hook(lambda *a: None)  # an empty hook table filled
    blk.scale = torch.zeros(4)  # a buffer re-bound: same keys, same types, another object
    blk.config.width = 9
    blk.config.labels[2] = "c"
    after = before.recapture()
    assert before.grew() and not after.grew()
    before.install()
    assert blk.scale is scale and blk.config.width == width and 2 not in blk.config.labels
    assert not blk.lin._forward_pre_hooks
    after.install()
    assert blk.config.width == 9 and blk.config.labels[2] == "c" and len(blk.lin._forward_pre_hooks) == 1


def test_install_rewrites_a_table_whose_keys_are_equal_but_reordered():
    class Obj:
        pass

    o = Obj()
    o.a, o.b = 1, 2
    blk = Block(Config())
    blk.obj = o
    state = capture(blk, (), {})
    del o.a
    o.a = 1  # the same keys and values, now in another order
    o.c = 3
    state.install()
    assert list(vars(o)) == ["a", "b"] and (o.a, o.b) == (1, 2)


def test_layout_table_is_bounded():
    pystate._LAYOUTS.clear()
    for i in range(pystate._MAX_LAYOUTS + 5):
        obj = type(f"T{i}", (), {})()
        setattr(obj, f"k{i}", i)
        blk = Block(Config())
        blk.o = obj
        capture(blk, (), {})
    assert len(pystate._LAYOUTS) <= pystate._MAX_LAYOUTS


def test_a_modules_own_generator_is_found_under_a_known_layout():
    blk = Block(Config())
    blk.gen = torch.Generator().manual_seed(3)
    for _ in range(2):  # the second with the layout known
        state = capture(blk, (), {}, host_rng=True)
        assert state._rng.generators() == [blk.gen]


def test_swap_in_returns_what_to_put_back():
    blk = Block(Config())
    state = capture(blk, (), {})
    assert state.swap_in() is state  # nothing changed since capture: nothing copied, the state itself goes back
    blk.config.width = 9  # the forward changed a value
    blk.cache["k"] = 1  # ... and filled an empty table
    after = state.swap_in()
    assert after is not state and blk.config.width == 8 and not blk.cache
    blk.config.width = 10  # the replay changes it again: putting back restores the forward's result
    after.install()
    assert blk.config.width == 9 and blk.cache == {"k": 1}
    blk.tags_list = [1]
    state2 = capture(blk, (), {})
    blk.tags_list.append(2)  # a list's items, by identity
    assert state2.swap_in() is not state2 and blk.tags_list == [1]
