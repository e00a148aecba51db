"""Old module paths (before the package was grouped by concern) -> where the code is now.

``import autosac.plan``, ``from autosac.host import calibrate``, ``autosac.host.remeasure()``,
``monkeypatch.setattr("autosac.batch_search.profile", ...)`` and pickles that name an old
module (``torch.save`` of a model or a plan from before) find the same module objects
under their old names: an import hook maps each old name to the new module, loaded
once.  Nothing here is imported by the package's own code.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

OLD = {
    "autosac.allocations": "autosac.core.allocations",
    "autosac.batch_search": "autosac.tools.search",
    "autosac.batch_search_report": "autosac.tools.search_report",
    "autosac.budget": "autosac.core.budget",
    "autosac.cache": "autosac.core.cache",
    "autosac.compile_fit": "autosac.compile.fit",
    "autosac.curves": "autosac.core.curves",
    "autosac.dataflow": "autosac.core.dataflow",
    "autosac.devices": "autosac.core.devices",
    "autosac.errors": "autosac.core.errors",
    "autosac.fingerprint": "autosac.core.fingerprint",
    "autosac.host": "autosac.tools.calibrate",
    "autosac.hostsize": "autosac.core.hostsize",
    "autosac.inputs": "autosac.core.inputs",
    "autosac.integrations": "autosac.core.integrations",
    "autosac.loop": "autosac.core.loop",
    "autosac.marks": "autosac.core.marks",
    "autosac.measure": "autosac.tools.measure",
    "autosac.modelspec": "autosac.models.spec",
    "autosac.native": "autosac.zero3.native",
    "autosac.noise": "autosac.core.noise",
    "autosac.opkinds": "autosac.core.opkinds",
    "autosac.ops": "autosac.zero3.ops",
    "autosac.optim": "autosac.core.optim",
    "autosac.plan": "autosac.core.plan",
    "autosac.plot": "autosac.tools.plot",
    "autosac.pystate": "autosac.core.pystate",
    "autosac.report": "autosac.tools.report",
    "autosac.rng": "autosac.core.rng",
    "autosac.schema": "autosac.core.schema",
    "autosac.stats": "autosac.core.stats",
    "autosac.sweep": "autosac.tools.sweep",
    "autosac.trace.compiled": "autosac.compile.trace",
    "autosac.trace.inductor": "autosac.compile.inductor",
    "autosac.verify": "autosac.tools.verify",
    "autosac.version": "autosac.core.version",
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the new module itself (not a copy)."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec  # the import system set the alias's; the module keeps its own


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = OLD.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new), is_package=new in PACKAGES)


PACKAGES = set()


def install() -> None:
    """The hook, once; and every old name whose module is loaded already (cheap: the
    same object), so that importing one never rebinds a name of the package root
    (``autosac.measure`` is the function)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())  # first: it answers only for the old names
    for old, new in OLD.items():
        if new in sys.modules:
            sys.modules.setdefault(old, sys.modules[new])


def module(name: str):
    """``autosac.<old name>`` as an attribute of the root (PEP 562), or None."""
    new = OLD.get(f"autosac.{name}")
    return None if new is None else importlib.import_module(f"autosac.{name}")
