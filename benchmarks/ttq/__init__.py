"""Time to quality, the benchmark of record (``python -m benchmarks.ttq``): the driver, one rank
(:mod:`.worker`), the arithmetic (:mod:`.analysis`), the tables and plot (:mod:`.report`)."""
