"""``python -m spin.cli`` = the ``spin`` command."""

import sys

from . import main

sys.exit(main())
