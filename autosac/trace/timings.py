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
numbers.  (The host figures :mod:`autosac.tools.calibrate` keeps here may be negative
where :func:`autosac.core.host.signed_cache_key` says so, of any calibration version.)

On a busy machine (:mod:`autosac.core.noise`): an op timed while its samples did
not settle is kept :data:`autosac.core.noise.NOISY_LIFETIME_S` seconds (marked
``<key>#noisy_until``), then timed again; a cached timing far above what the CPU roofline predicts for
its FLOPs and bytes (:func:`is_outlier`: another process ran while it was
timed) is timed again once, and the lesser kept.  An op a profile times
for the first time is timed once more after its trace, the second timing
kept where it is below the first by more than :data:`CONFIRM_RATIO` (the
step then traced again: :meth:`autosac.trace.costs.CostModel.confirm_timings`).
A timing another process
took is confirmed once: the first process to use it after times the op again
and keeps the cached timing where the two agree within
:data:`CONFIRM_RATIO` (marked ``<key>#checked``: never timed again), the lesser
where they do not (confirmed in turn by the next process).  A VM's slow
moment inflates every sample of a timing alike, so a timing can settle high
and read clean (a 1 MiB ``bmm`` cached at 0.72 ms on this 2-core VM, 0.19-0.27
timed again, 0.31 in the step).  From the second profile of a model on, the
numbers change only where a timing comes out more than :data:`CONFIRM_RATIO`
below the cached one; each such change lowers it, so they settle (on this
noisy VM, within two or three processes).
``AUTOSAC_REMEASURE=1``
makes a process time every op it meets again; :meth:`TimingCache.forget`
(``autosac.tools.calibrate.remeasure()``) drops them all; inside
:func:`retimed` (the host calibration's micro-benchmark) each op met is timed
again and kept as measured.
"""

from __future__ import annotations

import json
import math
import os
import platform
import reprlib
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from autosac.core.cache import cache_root
from autosac.core.noise import NOISY_LIFETIME_S, remeasure_requested

# a cached op timing above OUTLIER_FACTOR x (its roofline time + OUTLIER_FLOOR_MS)
# is timed again: clean timings on a 2-core CPU were at most 24x their
# roofline, a timing another process's time slice fell into is milliseconds
OUTLIER_FACTOR = 50.0
OUTLIER_FLOOR_MS = 0.01
CONFIRM_RATIO = 1.5  # a timing taken again within this factor of the cached one confirms it
CHECKED = "#checked"  # suffix of the mark of a timing that was timed again (not checked twice)
NOISY = "#noisy_until"  # suffix of the mark of a noisy timing: when it expires (epoch seconds; 0: clean)


_RETIMING: list[set[str]] = []  # inside retimed(): the keys timed again so far


@contextmanager
def retimed():
    """Within it, each op call key met is timed again once, now, and kept in
    place of the cached timing (not the lesser of the two).  For figures made
    of measured steps less their ops' timings (:mod:`autosac.tools.calibrate`):
    a timing cached an hour before, on a VM whose speed drifts by tens of
    percent, set against a step measured now, reads the drift as host time."""
    _RETIMING.append(set())
    try:
        yield
    finally:
        _RETIMING.pop()


def retiming() -> bool:
    """Whether this runs inside :func:`retimed` (each op timed there is kept as measured)."""
    return bool(_RETIMING)


def is_outlier(ms: float, expected_ms: float) -> bool:
    """Whether a timing is far above what its op's FLOPs and bytes predict
    (``expected_ms``, the CPU roofline), further than any clean timing was."""
    return ms > OUTLIER_FACTOR * (expected_ms + OUTLIER_FLOOR_MS)


# settings of the C allocator that change what an op's fresh memory costs (glibc hands freed heap back
# and page-faults it in again by default; with these set it may not): timed apart, like thread counts
_ALLOCATOR_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                  "LD_PRELOAD")


def _allocator_key() -> str:
    """Empty under the C allocator's defaults, else a short digest of its settings."""
    import hashlib

    found = [f"{k}={os.environ[k]}" for k in _ALLOCATOR_ENV if os.environ.get(k)]
    return "" if not found else "-alloc" + hashlib.sha1(";".join(found).encode()).hexdigest()[:8]


def _machine_key() -> str:
    return (f"{platform.machine()}-{os.cpu_count()}cpu-{torch.get_num_threads()}threads-torch{torch.__version__}"
            f"{_allocator_key()}")


def cache_path() -> Path | None:
    """Where timings for this machine are kept, or None when disk caching is off."""
    root = cache_root()
    return None if root is None else root / f"cpu-timings-{_machine_key()}.json"


class TimingCache:
    """Milliseconds per op-call key, loaded once per process and path."""

    _loaded: dict[str, dict[str, float]] = {}
    _stale: set[str] = set()  # files that held something else than timings: rewritten at the next save
    _forgotten: set[str] = set()  # files whose entries on disk are dropped at the next save
    _own: dict[str, set[str]] = {}  # per file: the keys this process timed (the others came from disk)

    def __init__(self) -> None:
        self.path = cache_path()
        key = str(self.path)
        if key not in TimingCache._loaded:
            table, problem = _read(self.path)
            if remeasure_requested():  # AUTOSAC_REMEASURE: measured again by this process, then rewritten
                table, problem = {}, ""
            if problem:
                warnings.warn(f"autosac: {self.path} {problem}: timing again and rewriting it", stacklevel=3)
                TimingCache._stale.add(key)
            TimingCache._loaded[key] = table
            TimingCache._own[key] = set()  # loaded from disk: taken by other processes
        self.table = TimingCache._loaded[key]
        self.own = TimingCache._own.setdefault(key, set())
        self._dirty = False

    def get(self, key: str) -> float | None:
        """The timing kept for ``key``; None where there is none, or it was noisy and has expired."""
        until = self.table.get(key + NOISY)
        if until and not 0 <= until - time.time() <= NOISY_LIFETIME_S:  # expired (or a clock gone back)
            return None
        return self.table.get(key)

    def put(self, key: str, ms: float, noisy: bool | None = None) -> None:
        """Keep ``ms`` for ``key``; ``noisy``: for :data:`NOISY_LIFETIME_S`
        seconds.  A timing (``noisy`` not None) is marked either way, 0 where
        clean: a file rewritten holds the same keys."""
        self.table[key] = ms
        self.own.add(key)
        if noisy is not None:
            self.table[key + NOISY] = time.time() + NOISY_LIFETIME_S if noisy else 0.0
        self._dirty = True

    def timed(self, key: str, time_op, expected_ms: float) -> float:
        """The timing of ``key``: the cached one, or ``time_op()`` -> (ms,
        noisy) measured now and kept (:meth:`put`).  A cached timing not yet
        confirmed is timed again, once per process, where another process
        took it or :func:`is_outlier` flags it (noise only adds time): where
        the two agree within :data:`CONFIRM_RATIO` and the new one is clean,
        the cached one stands, marked checked -- never timed again; else the
        lesser is kept (an op slower than its roofline times alike twice;
        two timings inflated by other processes or a VM's slow moment seldom
        agree, and are timed again at the next process's use)."""
        if _RETIMING and key not in _RETIMING[-1]:  # timed again now, kept as measured
            _RETIMING[-1].add(key)
            fresh, noisy = time_op()
            self.put(key, fresh, bool(noisy))
            return fresh
        ms = self.get(key)
        if ms is not None and (self.get(key + CHECKED) or (key in self.own and not is_outlier(ms, expected_ms))):
            return ms
        fresh, noisy = time_op()
        if ms is None:
            self.put(key, fresh, bool(noisy))
            return fresh
        self.own.add(key)  # timed again by this process: not again in it
        if max(ms, fresh) <= CONFIRM_RATIO * min(ms, fresh):
            if not noisy:
                self.put(key + CHECKED, 1.0)
            return ms  # confirmed: the same number as before, so the same plan
        if fresh < ms:
            self.put(key, fresh, bool(noisy))
            return fresh
        return ms

    def lower(self, key: str, ms: float, noisy: bool) -> bool:
        """Keep ``ms``, a timing of ``key`` taken again, where it is below the
        kept one by more than :data:`CONFIRM_RATIO` (marked ``noisy`` or not;
        never checked: the next process confirms it as any other); whether it was kept."""
        kept = self.get(key)
        if kept is None or ms * CONFIRM_RATIO >= kept:
            return False
        self.put(key, ms, noisy)
        return True

    def refresh(self, prefix: str) -> None:
        """Take the entries under keys starting with ``prefix`` as they are on
        disk now: what another process wrote since this one loaded the file
        (the host figures another process measured while this one waited)."""
        if str(self.path) in TimingCache._forgotten:
            return
        self.table.update({k: v for k, v in _read(self.path)[0].items() if k.startswith(prefix)})

    def forget(self) -> None:
        """Drop every timing of this machine, in memory and (at :meth:`save`,
        done now) on disk: each is measured again where next needed."""
        self.table.clear()
        TimingCache._forgotten.add(str(self.path))
        self._dirty = True
        self.save()

    def save(self) -> None:
        """Write new timings (atomically; a failure to write only loses the cache)."""
        stale = str(self.path) in TimingCache._stale
        if not (self._dirty or stale) or self.path is None:
            return
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # private: the native build checks it
            before = {} if str(self.path) in TimingCache._forgotten else _read(self.path)[0]
            merged = {**before, **self.table}  # what other processes added meanwhile, unless forgotten
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
                json.dump(merged, f)
            os.replace(f.name, self.path)
            self._dirty = False
            TimingCache._stale.discard(str(self.path))
            TimingCache._forgotten.discard(str(self.path))
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
    from autosac.core.host import signed_cache_key

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value >= 0 or signed_cache_key(key)
