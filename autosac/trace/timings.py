"""Op timings measured on this machine, kept so that profiling the same model
twice gives the same numbers -- and so the same plan.

``target="cpu"`` times each distinct op call (op, shapes, strides, dtypes) for
real, once: the first measurement is remembered for the process and written
to ``$AUTOSAC_CACHE_DIR`` (default ``~/.cache/autosac``) as
``cpu-timings-<machine>.json``, where later processes read it.  Set
``AUTOSAC_CACHE_DIR`` to an empty string to keep timings in memory only.
Timings depend on the thread count, which is part of the machine key.

An entry that is not a finite number >= 0 (a hand edit, a disk error) is
dropped when the file is read, with one warning naming the file: its op is
timed again and the file rewritten.  So is a file that is not a JSON object of
numbers.  (The host figures :mod:`autosac.host` keeps here may be negative
where :data:`autosac.host.SIGNED_CACHE_KEYS` says so.)
"""

from __future__ import annotations

import json
import math
import os
import platform
import reprlib
import tempfile
import warnings
from pathlib import Path

import torch

from autosac.cache import cache_root


def _machine_key() -> str:
    return f"{platform.machine()}-{os.cpu_count()}cpu-{torch.get_num_threads()}threads-torch{torch.__version__}"


def cache_path() -> Path | None:
    """Where timings for this machine are kept, or None when disk caching is off."""
    root = cache_root()
    return None if root is None else root / f"cpu-timings-{_machine_key()}.json"


class TimingCache:
    """Milliseconds per op-call key, loaded once per process and path."""

    _loaded: dict[str, dict[str, float]] = {}
    _stale: set[str] = set()  # files that held something else than timings: rewritten at the next save

    def __init__(self) -> None:
        self.path = cache_path()
        key = str(self.path)
        if key not in TimingCache._loaded:
            table, problem = _read(self.path)
            if problem:
                warnings.warn(f"autosac: {self.path} {problem}: timing again and rewriting it", stacklevel=3)
                TimingCache._stale.add(key)
            TimingCache._loaded[key] = table
        self.table = TimingCache._loaded[key]
        self._dirty = False

    def get(self, key: str) -> float | None:
        return self.table.get(key)

    def put(self, key: str, ms: float) -> None:
        self.table[key] = ms
        self._dirty = True

    def save(self) -> None:
        """Write new timings (atomically; a failure to write only loses the cache)."""
        stale = str(self.path) in TimingCache._stale
        if not (self._dirty or stale) or self.path is None:
            return
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # private: the native build checks it
            merged = {**_read(self.path)[0], **self.table}  # what other processes added meanwhile
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
                json.dump(merged, f)
            os.replace(f.name, self.path)
            self._dirty = False
            TimingCache._stale.discard(str(self.path))
        except OSError:
            pass


def _read(path: Path | None) -> tuple[dict[str, float], str]:
    """The valid entries of the file at ``path`` and, where it held anything
    else, what (for the warning); a missing file is an empty cache."""
    if path is None:
        return {}, ""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, ""
    except (OSError, ValueError, RecursionError) as e:
        return {}, f"is not a timing cache ({type(e).__name__})"
    if not isinstance(data, dict):
        return {}, f"is not a timing cache (a JSON {type(data).__name__}, not an object)"
    table = {k: float(v) for k, v in data.items() if _valid(k, v)}
    bad = [k for k in data if k not in table]
    if not bad:
        return table, ""
    first = f"{reprlib.repr(bad[0])}: {reprlib.repr(data[bad[0]])}"
    return table, f"holds {len(bad)} entries that are not finite numbers >= 0 ({first}{', ...' if len(bad) > 1 else ''})"


def _valid(key: str, value) -> bool:
    from autosac.host import SIGNED_CACHE_KEYS

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value >= 0 or key in SIGNED_CACHE_KEYS
