"""`python -m bench ...` is the `tridist` command."""

import sys

from bench.cli import main

sys.exit(main())
