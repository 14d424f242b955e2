"""``python -m benchmarks.collectives``: :func:`benchmarks.collectives.driver.main`."""

import sys

from benchmarks.collectives.driver import main

sys.exit(main())
