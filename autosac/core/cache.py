"""Where autosac keeps what it computes once per machine (CPU op timings, the
native op's build): ``$AUTOSAC_CACHE_DIR``, by default ``~/.cache/autosac``
(under ``$XDG_CACHE_HOME`` where set); an empty value turns disk caching off."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path | None:
    """The cache directory, or None when disk caching is off (``AUTOSAC_CACHE_DIR=""``)."""
    root = os.environ.get("AUTOSAC_CACHE_DIR")
    if root == "":
        return None
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "autosac")
    return Path(root)
