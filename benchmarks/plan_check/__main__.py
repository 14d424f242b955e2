"""``python -m benchmarks.plan_check``: :func:`benchmarks.plan_check.driver.main`."""

import sys

from benchmarks.plan_check.driver import main

sys.exit(main())
