"""Op timings measured on this machine, kept so that profiling the same model
twice gives the same numbers -- and so the same plan.

``target="cpu"`` times each distinct op call (op, shapes, strides, dtypes) for
real, once: the first measurement is remembered for the process and written
to ``$AUTOSAC_CACHE_DIR`` (default ``~/.cache/autosac``) as
``cpu-timings-<machine>.json``, where later processes read it.  Set
``AUTOSAC_CACHE_DIR`` to an empty string to keep timings in memory only.
Timings depend on the thread count, which is part of the machine key.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
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

    def __init__(self) -> None:
        self.path = cache_path()
        key = str(self.path)
        if key not in TimingCache._loaded:
            TimingCache._loaded[key] = _read(self.path)
        self.table = TimingCache._loaded[key]
        self._dirty = False

    def get(self, key: str) -> float | None:
        return self.table.get(key)

    def put(self, key: str, ms: float) -> None:
        self.table[key] = ms
        self._dirty = True

    def save(self) -> None:
        """Write new timings (atomically; a failure to write only loses the cache)."""
        if not self._dirty or self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            merged = {**_read(self.path), **self.table}
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
                json.dump(merged, f)
            os.replace(f.name, self.path)
            self._dirty = False
        except OSError:
            pass


def _read(path: Path | None) -> dict[str, float]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}
