"""``python -m dsinfer.bench ...``: the same as ``dsinfer bench ...``."""

import sys

from dsinfer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
