"""`python -m pipeline.cli`: the `moestream` command without its console script."""

import sys

from pipeline.cli import main

sys.exit(main())
