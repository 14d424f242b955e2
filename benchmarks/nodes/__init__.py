"""Multi-node end to end on emulated nodes (``python -m benchmarks.nodes``): flat against
hierarchical (:mod:`.driver`), and sharded (``--sharded``: :mod:`.sharded`, one rank
:mod:`.sharded_worker`, the cost model's bytes :mod:`.sharded_cost`, projected to clusters
:mod:`.sharded_projection`)."""
