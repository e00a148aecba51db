"""The native fused op ``autosac::pack_downcast``: C++ (and CUDA where PyTorch
has it) in the repository's ``native/`` folder, compiled with
``torch.utils.cpp_extension`` on first use and kept in the cache directory
(:mod:`autosac.core.cache`), one build per source version and PyTorch version.

Where it cannot be built (no compiler, no ninja, sources not shipped), the
ops in :mod:`autosac.ops` fall back to PyTorch code with identical results,
after one warning.  ``AUTOSAC_NATIVE=0`` asks for the fallback.

A cached build is loaded only from directories this user owns and no other
user can write (the cache directory and the folders above it), and only when
the library's SHA-256 matches the manifest written when it was built; an
unchecked ``.so`` would run its code in this process.  One process builds at a
time: the others wait on a lock (``AUTOSAC_NATIVE_LOCK_TIMEOUT`` seconds, 900
by default), which the system releases when its holder ends, killed or not.

Example::

    >>> from autosac import native
    >>> native.available()      # builds on first call (about 40 s), then loads the cached library
    True
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import tempfile
import warnings
from pathlib import Path

import torch

from autosac.core.cache import LockTimeout, cache_root, file_lock

SOURCES = Path(__file__).resolve().parents[2] / "native"  # the repository's native/, beside autosac/
_CPU = ("pack_downcast.cpp",)
_CUDA = ("pack_downcast_cuda_binding.cpp", "pack_downcast_cuda.cu")
MANIFEST = "manifest.json"
_FIX = "set AUTOSAC_CACHE_DIR to a directory only you can write"


class NativeBuildError(RuntimeError):
    """The native op could not be compiled or loaded (the message says why)."""


_state: dict = {"loaded": False, "reason": None, "warned": False}


def _with_cuda() -> bool:
    """Whether to build the CUDA kernel: PyTorch and the toolkit have CUDA,
    and there is a GPU to build for or ``TORCH_CUDA_ARCH_LIST`` names the
    architectures (with neither, PyTorch's extension builder fails: a CUDA
    build of torch on a machine without a GPU gets the C++ op alone)."""
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None or CUDA_HOME is None:
        return False
    return bool(os.environ.get("TORCH_CUDA_ARCH_LIST")) or torch.cuda.is_available()


def _source_digest(files: list[Path]) -> str:
    h = hashlib.sha256(torch.__version__.encode())
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _writable_by_others(st: os.stat_result) -> str | None:
    if st.st_mode & stat.S_IWOTH:
        return "world-writable"
    return "group-writable" if st.st_mode & stat.S_IWGRP else None


def _private_problem(path: Path) -> str | None:
    """Why ``path`` is not a directory or file only this user can change, or None."""
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    bad = _writable_by_others(st)
    return f"it is {bad}" if bad else None


def _ancestor_problem(path: Path) -> str | None:
    """Why a folder above the cache lets another user replace what lies below it, or None."""
    st = path.stat()
    if st.st_uid not in (0, os.geteuid()):
        return f"{path} is owned by uid {st.st_uid}"
    bad = _writable_by_others(st)
    if bad and not st.st_mode & stat.S_ISVTX:  # a sticky folder (/tmp) lets no one else rename our entry
        return f"{path} is {bad}"
    return None


def _private_dir(root: Path) -> Path:
    """``root/native``, made (mode 0o700) where missing and checked: it, the
    cache directory and every folder above must be writable by no other user."""
    root = Path(os.path.abspath(root))
    for p in [*reversed(root.parents), root, root / "native"]:
        if not p.exists():
            try:
                os.mkdir(p, 0o700)
            except FileExistsError:
                pass
            except OSError as e:
                raise NativeBuildError(f"cannot make the native build cache {p}: {e.strerror}; {_FIX}") from None
    real = root.resolve()
    for p in reversed(real.parents):
        why = _ancestor_problem(p)
        if why:
            raise NativeBuildError(f"not using the native build cache {root}: {why}, so others could replace it; {_FIX}")
    for p in (real, real / "native"):
        why = _private_problem(p)
        if why:
            fix = f"chmod go-w {p}, or " if "writable" in why else ""
            raise NativeBuildError(f"not using the native build cache {p}: {why}; {fix}{_FIX}")
    return real / "native"


def _check_manifest(where: Path, digest: str) -> Path:
    """The library the manifest in ``where`` vouches for (raises ValueError or OSError)."""
    manifest = where / MANIFEST
    why = _private_problem(manifest)
    if why:
        raise ValueError(f"its {MANIFEST}: {why}")
    entry = json.loads(manifest.read_text())
    if not isinstance(entry, dict) or entry.get("sources") != digest:
        raise ValueError(f"its {MANIFEST} is for other sources")
    lib = where / str(entry.get("library"))
    if lib.parent != where:
        raise ValueError(f"its {MANIFEST} names a library elsewhere")
    why = _private_problem(lib)
    if why:
        raise ValueError(f"{lib.name}: {why}")
    if _sha256(lib) != entry.get("sha256"):
        raise ValueError(f"{lib.name} does not match the SHA-256 recorded when it was built")
    return lib


def _verified(where: Path, digest: str) -> Path | None:
    """The library in ``where`` when its manifest vouches for it; None (after a
    warning when something there did not check out) when it must be built again."""
    if not where.exists():
        return None
    why = _private_problem(where)
    if why:
        raise NativeBuildError(f"not loading the native build at {where}: {why}; delete it, or {_FIX}")
    if not (where / MANIFEST).exists():
        return None  # a build that did not finish (killed), or made before manifests
    try:
        return _check_manifest(where, digest)
    except (ValueError, OSError) as e:
        warnings.warn(f"autosac: not loading the native build at {where}: {e}; building it again",
                      UserWarning, stacklevel=2)
        return None


def _lock_timeout() -> float:
    raw = os.environ.get("AUTOSAC_NATIVE_LOCK_TIMEOUT", "900")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise NativeBuildError(f"AUTOSAC_NATIVE_LOCK_TIMEOUT must be a number of seconds, got {raw!r}")
    return value


@contextlib.contextmanager
def _build_lock(path: Path):
    """Hold ``path`` locked (:func:`autosac.core.cache.file_lock`; on Windows
    cpp_extension's own lock file is all there is); wait for a live holder at
    most AUTOSAC_NATIVE_LOCK_TIMEOUT s."""
    try:
        with file_lock(path, _lock_timeout()):
            yield
    except LockTimeout as e:
        raise NativeBuildError(
            f"waited {_lock_timeout():g} s for {e.holder} to finish building the native op (lock {path}); "
            "end that process, delete the lock if it is not running, or raise AUTOSAC_NATIVE_LOCK_TIMEOUT"
        ) from None


def _compile(name: str, files: list[Path], where: Path, verbose: bool) -> Path:
    """Compile into ``where`` and load the library (``cpp_extension.load`` does both)."""
    from torch.utils import cpp_extension

    try:
        lib = cpp_extension.load(
            name=name, sources=[str(f) for f in files], extra_cflags=["-O3", "-fopenmp"],
            extra_cuda_cflags=["-O3"], build_directory=str(where), is_python_module=False, verbose=verbose,
        )
    except Exception as e:  # compiler missing or failing, ninja missing, a load error
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NativeBuildError(f"building the native op failed: {first}") from e
    return Path(lib)


def _build_afresh(where: Path, name: str, digest: str, files: list[Path], cuda: bool, verbose: bool) -> None:
    """Under the lock: empty ``where`` (a killed build's leftovers, ``cpp_extension``'s
    stale ``lock`` file among them), build and load, then record the library's hash."""
    if where.exists():
        shutil.rmtree(where)
    os.mkdir(where, 0o700)
    lib = _compile(name, files, where, verbose)
    os.chmod(lib, lib.stat().st_mode & ~0o022)  # whatever the umask, writable by this user only
    entry = {"library": lib.name, "sha256": _sha256(lib), "sources": digest, "cuda": cuda,
             "torch": torch.__version__}
    tmp = where / f".{MANIFEST}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(entry, f)
    os.replace(tmp, where / MANIFEST)


def _load(lib: Path) -> None:
    try:
        torch.ops.load_library(str(lib))
    except Exception as e:
        raise NativeBuildError(f"loading the native build {lib} failed: {str(e).strip().splitlines()[0]}") from e


def _build_cached(root: Path, name: str, digest: str, files: list[Path], cuda: bool, verbose: bool) -> Path:
    base = _private_dir(root)
    where = base / name
    found = _verified(where, digest)
    if found is None:
        with _build_lock(base / f"{name}.lock"):
            found = _verified(where, digest)  # built by the process we waited for
            if found is None:
                _build_afresh(where, name, digest, files, cuda, verbose)
                return where
    _load(found)
    return where


def build(verbose: bool = False) -> str:
    """Compile (or find already compiled) and load the native op; return where
    the build lives.

    Args:
        verbose: print the compiler's commands and output.

    Returns:
        The build directory.

    Raises:
        NativeBuildError: the sources are missing, compiling or loading failed,
            the cache is writable by other users, or another build held the
            lock past ``AUTOSAC_NATIVE_LOCK_TIMEOUT``.

    Example::

        >>> autosac.zero3.native.build()      # what ``autosac build-native`` runs
    """
    if _state["loaded"]:
        return _state["where"]
    cuda = _with_cuda()
    names = _CPU + (_CUDA if cuda else ())
    files = [SOURCES / n for n in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise NativeBuildError(f"native sources not found: {', '.join(missing)} (install autosac from its repository)")
    digest = _source_digest(files)
    name = f"autosac_native_{digest[:12]}"
    root = cache_root()
    if root is None:  # no disk cache: a fresh private folder, built in this process only
        where = Path(tempfile.mkdtemp(prefix="autosac-native-"))
        _compile(name, files, where, verbose)
    else:
        try:
            where = _build_cached(root, name, digest, files, cuda, verbose)
        except OSError as e:  # the cache folder unreadable, full, ...
            raise NativeBuildError(f"the native build cache {root}: {e}; {_FIX}") from e
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
