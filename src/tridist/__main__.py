"""`python -m tridist ...` is the `tridist` command."""

import sys

from tridist.bench.cli import main

sys.exit(main())
