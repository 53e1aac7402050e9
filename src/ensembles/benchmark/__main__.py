"""``python -m ensembles.benchmark``: the ``ensembles-bench`` command."""

import sys

from ensembles.benchmark.cli import main

if __name__ == "__main__":
    sys.exit(main())
