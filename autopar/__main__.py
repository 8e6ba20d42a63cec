"""``python -m autopar``: the ``autopar`` command (see :mod:`autopar.cli`)."""
import sys

from autopar.cli import main

if __name__ == "__main__":
    sys.exit(main())
