"""``python -m server``: same as ``fuel-serve``."""

import sys

from server.cli import main

sys.exit(main())
