"""``python -m graph_exec.cli`` — same as the ``graph-exec`` console script."""

import sys

from graph_exec.cli import main

sys.exit(main())
