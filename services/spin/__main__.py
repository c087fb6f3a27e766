"""``python -m spin`` = the ``spin`` command."""

import sys

from .cli import main

sys.exit(main())
