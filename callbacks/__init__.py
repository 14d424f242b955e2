"""Lightning callbacks for lowbit-strategy (momentum sync, divergence, comm stats).

A separate top-level package: it depends on :mod:`lowbit_strategy`, never the reverse.
"""
