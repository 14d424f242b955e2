"""Benchmarks: scripts that print figures, one study each (``python -m benchmarks.<module>`` from
the repository root). ``benchmarks/README.md`` is the index: what each study answers, its
command, what it writes and how long it runs; the shared parts (``netem``, ``procs``, ``leave``,
``baselines``) are listed there too."""
