"""One synchronization per algorithm on emulated links (``python -m benchmarks.collectives``):
the driver, one rank (:mod:`.worker`), the tables (:mod:`.report`); and bytes per sync against
P (``python -m benchmarks.collectives.bytes_vs_p``)."""
