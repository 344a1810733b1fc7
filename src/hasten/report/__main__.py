"""``python -m hasten.report DIR``: the same as ``hasten profile-report DIR``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
