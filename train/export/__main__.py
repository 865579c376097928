"""`python -m specdistill.train.export ...` is `specdistill export ...`."""

import sys

from specdistill.errors import run_guarded
from specdistill.train.export_cli import main

if __name__ == "__main__":
    sys.exit(run_guarded(main, sys.argv[1:]))
