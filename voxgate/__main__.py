"""`python -m voxgate`: the same as the `voxgate` command."""

import sys

from .cli import main

if __name__ == "__main__":  # not when a spawned engine worker re-imports the main module
    sys.exit(main())
