"""``python -m dsinfer.router ...``: the same as ``dsinfer router ...``."""

import sys

from dsinfer.entrypoints.cli import main

sys.exit(main(["router", *sys.argv[1:]]))
