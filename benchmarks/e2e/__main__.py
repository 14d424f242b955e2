"""``python -m benchmarks.e2e``: :func:`benchmarks.e2e.driver.main`."""

import sys

from benchmarks.e2e.driver import main

sys.exit(main())
