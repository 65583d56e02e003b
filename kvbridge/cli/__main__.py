"""``python -m kvbridge.cli``."""

import sys

from kvbridge.cli import main

sys.exit(main())
