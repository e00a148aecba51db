"""The native fused op ``autosac::pack_downcast``: C++ (and CUDA where PyTorch
has it) in the repository's ``native/`` folder, compiled with
``torch.utils.cpp_extension`` on first use and kept in the cache directory
(:mod:`autosac.cache`), one build per source version and PyTorch version.

Where it cannot be built (no compiler, no ninja, sources not shipped), the
ops in :mod:`autosac.ops` fall back to PyTorch code with identical results,
after one warning.  ``AUTOSAC_NATIVE=0`` asks for the fallback.

Example::

    >>> from autosac import native
    >>> native.available()      # builds on first call (about 40 s), then loads the cached library
    True
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from pathlib import Path

import torch

from autosac.cache import cache_root

SOURCES = Path(__file__).resolve().parent.parent / "native"
_CPU = ("pack_downcast.cpp",)
_CUDA = ("pack_downcast_cuda_binding.cpp", "pack_downcast_cuda.cu")


class NativeBuildError(RuntimeError):
    """The native op could not be compiled or loaded (the message says why)."""


_state: dict = {"loaded": False, "reason": None, "warned": False}


def _with_cuda() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.version.cuda is not None and CUDA_HOME is not None


def _build_name(files: list[Path]) -> str:
    h = hashlib.sha256(torch.__version__.encode())
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return f"autosac_native_{h.hexdigest()[:12]}"


def build(verbose: bool = False) -> str:
    """Compile (or find already compiled) and load the native op; return where
    the build lives.

    Args:
        verbose: print the compiler's commands and output.

    Returns:
        The build directory.

    Raises:
        NativeBuildError: the sources are missing, or compiling or loading failed.

    Example::

        >>> autosac.native.build()      # what ``autosac build-native`` runs
    """
    if _state["loaded"]:
        return _state["where"]
    cuda = _with_cuda()
    names = _CPU + (_CUDA if cuda else ())
    files = [SOURCES / n for n in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise NativeBuildError(f"native sources not found: {', '.join(missing)} (install autosac from its repository)")
    from torch.utils import cpp_extension

    name = _build_name(files)
    root = cache_root()
    where = (root / "native" / name) if root is not None else Path(tempfile.mkdtemp(prefix="autosac-native-"))
    where.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(
            name=name, sources=[str(f) for f in files], extra_cflags=["-O3", "-fopenmp"],
            extra_cuda_cflags=["-O3"], build_directory=str(where), is_python_module=False, verbose=verbose,
        )
    except Exception as e:  # compiler missing or failing, ninja missing, a load error
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NativeBuildError(f"building the native op failed: {first}") from e
    _state.update(loaded=True, where=str(where), cuda=cuda)
    return str(where)


def available() -> bool:
    """Whether ``torch.ops.autosac.pack_downcast`` is the native op, building it
    on first call; False (after one warning per process) where it cannot be."""
    if _state["loaded"]:
        return True
    if _state["reason"] is None:
        if os.environ.get("AUTOSAC_NATIVE", "1") == "0":
            _state["reason"] = "AUTOSAC_NATIVE=0"
        else:
            try:
                build()
                return True
            except NativeBuildError as e:
                _state["reason"] = str(e)
    if not _state["warned"] and _state["reason"] != "AUTOSAC_NATIVE=0":
        _state["warned"] = True
        warnings.warn(
            f"autosac: the native pack_downcast op is not available ({_state['reason']}); using the PyTorch "
            "fallback (same results, slower). `autosac build-native` shows the compiler's output",
            UserWarning, stacklevel=3,
        )
    return False


def has_cuda_kernel() -> bool:
    """Whether the loaded native op has its CUDA kernel (built where PyTorch has CUDA)."""
    return bool(_state["loaded"] and _state.get("cuda"))
