"""``python -m autosac.cli``: the autosac command."""

import sys

from autosac.cli.commands import main

sys.exit(main())
