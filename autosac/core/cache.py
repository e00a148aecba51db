"""Where autosac keeps what it computes once per machine (CPU op timings, the
native op's build): ``$AUTOSAC_CACHE_DIR``, by default ``~/.cache/autosac``
(under ``$XDG_CACHE_HOME`` where set); an empty value turns disk caching off.
:func:`machine_lock` lets one process at a time do such work."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path | None:
    """The cache directory, or None when disk caching is off (``AUTOSAC_CACHE_DIR=""``)."""
    root = os.environ.get("AUTOSAC_CACHE_DIR")
    if root == "":
        return None
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "autosac")
    return Path(root)


@contextmanager
def machine_lock(name: str, timeout_s: float = 300.0, poll_s: float = 0.2):
    """Hold an exclusive lock, shared by every process of this machine that
    uses this cache directory, for work measured once per machine (the host
    calibration: two processes measuring at once each measure the other's
    load, and each rank of a job would plan with figures of its own).  Yields
    True once held; False where it cannot be had (caching off, no ``fcntl``,
    the directory unwritable, or still held by another process after
    ``timeout_s`` -- the caller then does the work itself, unlocked: never a
    hang).  The lock goes with its holder's process, however that ends.

    Example::

        >>> with machine_lock("host-costs") as held:
        ...     figures = read_again() or measure()
    """
    root = cache_root()
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        fcntl = None
    handle = None
    if root is not None and fcntl is not None:
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            handle = open(root / f"{name}.lock", "a+")  # noqa: SIM115 - held past this block
        except OSError:
            handle = None
    held = False
    try:
        deadline = time.monotonic() + timeout_s
        while handle is not None and not held:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
            except OSError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(poll_s)
        yield held
    finally:
        if handle is not None:
            if held:
                fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()
