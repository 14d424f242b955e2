"""``python -m lowbit_strategy.plan``: the ``lowbit-plan`` command (:mod:`.cli`)."""

from lowbit_strategy.plan.cli import main

raise SystemExit(main())
