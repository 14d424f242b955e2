"""``python -m benchmarks.ttq``: :func:`benchmarks.ttq.driver.main`."""

import sys

from benchmarks.ttq.driver import main

sys.exit(main())
