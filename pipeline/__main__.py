"""`python -m pipeline` runs the `moestream` command."""

import sys

from pipeline.cli import main

sys.exit(main())
