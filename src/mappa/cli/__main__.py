"""`python -m mappa.cli`."""

import sys

from mappa.cli import main

sys.exit(main())
