"""The package's layout (issue 34): one folder per concern, imports running one way
(the same layers as the import-linter contracts in pyproject.toml, checked here
without import-linter), and the old module paths still working."""

import ast
import importlib
import pickle
import subprocess
import sys
from pathlib import Path

import autosac
from autosac import _moved

PKG = Path(autosac.__file__).parent
LAYERS = [["core"], ["applier", "models", "schedule", "solver", "trace", "zero3"], ["compile"], ["api"],
          ["tools", "trainers"], ["cli"], ["__main__"]]  # __main__: python -m autosac, over the command
RANK = {f: i for i, fs in enumerate(LAYERS) for f in fs}


def _graph() -> dict[str, set[str]]:
    """Module -> the autosac modules it imports, at the top or inside a function."""
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    edges = {}
    for m, p in mods.items():
        out = edges[m] = set()
        for node in ast.walk(ast.parse(p.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            for n in names:
                while n and n not in mods:
                    n = n.rpartition(".")[0]
                if n.startswith("autosac") and n != m:
                    out.add(n)
    return edges


def _folder(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_imports_run_down_the_layers_and_never_to_the_root():
    wrong = []
    for a, bs in _graph().items():
        if a in ("autosac", "autosac._moved"):
            continue
        for b in bs:
            fa, fb = _folder(a), _folder(b)
            if b in ("autosac", "autosac._moved") or (fa != fb and RANK[fb] >= RANK[fa]):
                wrong.append(f"{a} -> {b}")
    assert not wrong, wrong


def test_no_import_cycles():
    edges = _graph()
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for n in edges[m]:
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2
    for m in edges:
        if m not in state:
            visit(m, [m])


def test_every_folder_is_layered_and_the_root_is_small():
    folders = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(RANK) - {"api", "__main__"}
    assert len(list(PKG.glob("*.py"))) <= 12


def test_old_module_paths_are_the_new_modules():
    for old, new in _moved.OLD.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    assert callable(autosac.measure) and callable(autosac.search)  # the functions, not the old modules
    assert autosac.trace.compiled_peak is autosac.compile.compiled_peak
    assert autosac.host.calibrate is autosac.tools.calibrate.calibrate
    assert autosac.ops.pack_downcast is autosac.zero3.ops.pack_downcast


def test_pickles_naming_old_modules_load():
    """torch.save of a model applied before the move names autosac.plan.Plan and autosac.applier._hook."""
    from autosac.applier.model import _HOOKS
    from autosac.core.plan import Plan

    old = pickle.dumps(Plan, protocol=0).replace(b"autosac.core.plan\n", b"autosac.plan\n")
    assert b"autosac.plan\n" in old and pickle.loads(old) is Plan
    hook = pickle.dumps(_HOOKS["enter"], protocol=0).replace(b"autosac.applier.model\n", b"autosac.applier\n")
    assert b"autosac.applier\n" in hook and pickle.loads(hook) is _HOOKS["enter"]


def test_python_m_autosac_cli_runs():
    out = subprocess.run([sys.executable, "-m", "autosac.cli", "--help"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "plan" in out.stdout, out.stderr[-2000:]
