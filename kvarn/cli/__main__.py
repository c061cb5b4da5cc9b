"""`python -m kvarn.cli`: the `kvarn` command."""

import sys

from kvarn.cli.dispatch import main

sys.exit(main())
