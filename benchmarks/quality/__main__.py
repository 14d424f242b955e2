"""``python -m benchmarks.quality``: :func:`benchmarks.quality.driver.main`."""

import sys

from benchmarks.quality.driver import main

sys.exit(main())
