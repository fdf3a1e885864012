"""`python -m extproc.sim`: see `extproc.sim.cli`."""

import sys

from extproc.sim.cli import main

sys.exit(main())
