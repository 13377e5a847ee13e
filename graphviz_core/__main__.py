"""`python -m graphviz_core` is the `graphviz-core` command."""

import sys

from graphviz_core.cli import main

sys.exit(main())
