"""``python -m autosac``: the ``autosac`` command (the same as ``python -m autosac.cli``)."""

import sys

from autosac.cli.commands import main

sys.exit(main())
