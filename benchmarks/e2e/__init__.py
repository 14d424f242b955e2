"""End to end: the GPT example for a wall-clock budget on P ranks behind shaped links
(``python -m benchmarks.e2e``): the driver, one run (:mod:`.runs`, also the multi-node study's),
one rank (:mod:`.worker`, also the time-to-quality study's), the tables (:mod:`.report`)."""
