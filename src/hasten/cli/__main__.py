"""``python -m hasten.cli ...`` is the same as the ``hasten`` command."""

import sys

from . import main

sys.exit(main())
