"""Import timm on a machine without a working torchvision.

timm's package imports torchvision at import time (its data pipeline and
``FrozenBatchNorm2d``), although the models these tests build never use it.
The torchvision wheel that matches the CPU torch here is a CUDA build that
fails to load, so when torchvision cannot be imported this helper registers
stand-in ``torchvision`` modules whose every name is a placeholder that raises
as soon as anything calls it.  Test code only; nothing in autosac depends on it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        members = cls.__dict__["_members"]
        if name not in members:
            members[name] = _Placeholder(f"{cls.__name__}.{name}", (), {"_members": {}})
        return members[name]

    def __call__(cls, *args, **kwargs):
        raise NotImplementedError("torchvision is not available in this test environment")

    def __getitem__(cls, item):
        return cls


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {"_members": {}})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def import_timm():
    """``import timm``, with stand-in torchvision modules when the real one does not load."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or a build that fails to load
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.meta_path.insert(0, _Finder())
    return importlib.import_module("timm")
