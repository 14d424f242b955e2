"""What a collective costs: α–β models, exact bytes across nodes, the link probe and codec timings.

Beside :mod:`lowbit_strategy.collectives` (which moves the data), this package prices it: the
``auto`` decisions (Lion Cub's mode, TurboQuant's and BitDP's forms) and ``lowbit-plan`` read it.

- :mod:`.flat`: the α–β model of one flat collective (Lion Cub Table 1), :func:`estimate`,
  :func:`cheapest`, BitDP's forms, :func:`rounds` (the latency rounds every model counts);
- :mod:`.nodes`: exact bytes per bucket, flat and hierarchical, what crosses a node's link,
  a bucket's time on a :class:`Cluster`;
- :mod:`.sharded`: the sharded layout (FSDP2 inside the node, one collective per local rank
  across nodes) and HSDP;
- :mod:`.world`: one FSDP group over every rank (parameter all-gathers, the reduce-scatter);
- :mod:`.link_probe`: the link's α and bandwidth, measured and agreed by every rank;
- :mod:`.calibration`: codec timings every rank agrees on.

These modules lived in ``lowbit_strategy.collectives`` (``cost_model``, ``cost_model_nodes``,
``cost_model_sharded``, ``cost_model_world``, ``link_probe``, ``calibration``) before 0.3; those
paths still import, with a ``DeprecationWarning``.
"""

from lowbit_strategy.pricing.flat import Estimate, cheapest, estimate, rounds
from lowbit_strategy.pricing.nodes import Cluster

__all__ = ["Cluster", "Estimate", "cheapest", "estimate", "rounds"]
