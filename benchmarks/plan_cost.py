"""Planning cost per model shape, request size and block-id pattern: ``kvbridge bench planning``.

    .venv/bin/python benchmarks/plan_cost.py [--tokens 1024 8192 32768 131072] [--shapes ...]

Kept as the script the first planning benchmark was; every option of ``kvbridge bench`` works.
"""

from __future__ import annotations

import sys

from kvbridge.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "planning", *sys.argv[1:]]))
