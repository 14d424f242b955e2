"""``python -m benchmarks.codecs``: :func:`benchmarks.codecs.driver.main`."""

import sys

from benchmarks.codecs.driver import main

sys.exit(main())
