"""The ``autosac`` command: plan, sweep and verify from the shell.

User mistakes end in one line on stderr and exit status 2, never a traceback.

The code is in :mod:`autosac.cli.commands`; this package re-exports it."""

from autosac.cli.commands import (
    batch_sizes,
    cmd_build_native,
    cmd_calibrate,
    cmd_plan,
    cmd_search,
    cmd_sweep,
    cmd_verify,
    main,
)

__all__ = ["batch_sizes", "cmd_build_native", "cmd_calibrate", "cmd_plan", "cmd_search", "cmd_sweep", "cmd_verify", "main"]
