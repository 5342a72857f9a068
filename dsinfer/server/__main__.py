"""``python -m dsinfer.server [MODEL] ...``: the same as ``dsinfer serve``."""

from dsinfer.server.cli import main

if __name__ == "__main__":
    main()
