"""`python -m kvpilot.cli COMMAND ...`: the `kvpilot` command without its console script."""

from __future__ import annotations

import sys

from kvpilot.cli import main

if __name__ == "__main__":
    sys.exit(main())
