"""`python -m specdistill <verb> ...` is `specdistill <verb> ...`."""

import sys

from specdistill.cli import main

sys.exit(main())
