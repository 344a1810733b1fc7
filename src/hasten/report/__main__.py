"""``python -m hasten.report DIR``: the same as ``hasten profile-report DIR``."""

import sys

from hasten.report.cli import main

if __name__ == "__main__":
    sys.exit(main())
