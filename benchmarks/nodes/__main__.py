"""``python -m benchmarks.nodes``: :func:`benchmarks.nodes.driver.main`."""

import sys

from benchmarks.nodes.driver import main

sys.exit(main())
