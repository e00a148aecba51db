"""Warnings a user's own code is told of: attributed to the innermost frame of
the user's code, not to autosac's or torch's, so the line shown is theirs and
filters on torch's warnings leave autosac's alone."""

from __future__ import annotations

import os
import sys
import warnings

import torch

__all__ = ["warn_user"]

_INTERNAL = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # autosac/ (this file is in autosac/core/)
    os.path.dirname(os.path.abspath(torch.__file__)),
)


def warn_user(message: str) -> None:
    """Warn, attributed to the innermost frame of the user's own code: not
    autosac's or torch's, and not an installed library's where the user's script
    is further out (so filters on torch's warnings leave it alone)."""
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_INTERNAL):
            frames.append(frame)
        frame = frame.f_back
    if not frames:
        warnings.warn(message, UserWarning, stacklevel=2)
        return
    own = [f for f in frames if "-packages" + os.sep not in f.f_code.co_filename]
    frame = (own or frames)[0]
    warnings.warn_explicit(
        message, UserWarning, frame.f_code.co_filename, frame.f_lineno,
        module=frame.f_globals.get("__name__", "__main__"),
        registry=frame.f_globals.setdefault("__warningregistry__", {}),
    )
