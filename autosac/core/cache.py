"""Where autosac keeps what it computes once per machine (CPU op timings, the
native op's build): ``$AUTOSAC_CACHE_DIR``, by default ``~/.cache/autosac``
(under ``$XDG_CACHE_HOME`` where set); an empty value turns disk caching off.
:func:`file_lock` and :func:`machine_lock` let one process at a time do such work."""

from __future__ import annotations

import os
import socket
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path


def cache_root() -> Path | None:
    """The cache directory, or None when disk caching is off (``AUTOSAC_CACHE_DIR=""``)."""
    root = os.environ.get("AUTOSAC_CACHE_DIR")
    if root == "":
        return None
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "autosac")
    return Path(root)


class LockTimeout(Exception):
    """A lock file still held after the wait; ``holder`` is what its holder
    wrote into it (its pid and host), or "another process"."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


@contextmanager
def file_lock(path: Path, timeout_s: float, poll_s: float = 0.2):
    """Hold ``path`` locked (``flock``: released by the system when its holder
    ends, even killed), writing this process's pid and host into it; wait
    for a live holder at most ``timeout_s`` seconds.  Yields True once held,
    False where the system has no such locks (no ``fcntl``: not POSIX).

    Raises:
        LockTimeout: still held by another process after ``timeout_s``.
        OSError: the lock file cannot be opened (it is never followed as a link).
    """
    try:
        import fcntl
    except ImportError:
        yield False
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        start = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - start >= timeout_s:
                    raise LockTimeout(os.pread(fd, 200, 0).decode(errors="replace").strip()
                                      or "another process") from None
                time.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield True
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def machine_lock(name: str, timeout_s: float = 300.0):
    """Hold the lock ``name`` in the cache directory (:func:`file_lock`),
    shared by every process of this machine that uses that directory, for
    work measured once per machine (the host calibration: two processes
    measuring at once each measure the other's load, and each rank of a job
    would plan with figures of its own).  Yields True once held; False where
    it cannot be had (caching off, no ``fcntl``, the directory unmakeable, or
    still held by another process after ``timeout_s`` -- the caller then does
    the work itself, unlocked: never a hang).

    Example::

        >>> with machine_lock("host-costs") as held:
        ...     figures = read_again() or measure()
    """
    root = cache_root()
    with ExitStack() as stack:
        held = False
        if root is not None:
            try:
                root.mkdir(mode=0o700, parents=True, exist_ok=True)
                held = stack.enter_context(file_lock(root / f"{name}.lock", timeout_s))
            except (OSError, LockTimeout):
                held = False
        yield held
