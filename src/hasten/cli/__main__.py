"""``python -m hasten.cli ...`` is the same as the ``hasten`` command."""

import sys

from hasten.cli import main

sys.exit(main())
