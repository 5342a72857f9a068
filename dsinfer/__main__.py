"""``python -m dsinfer ...``: the same as the ``dsinfer`` command."""

import sys

from dsinfer.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
