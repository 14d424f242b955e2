"""Compressed collectives on flat 1-D buffers over any ProcessGroup.

Each function takes a tensor and a ``group`` (default: the default process group), reads
the world size from that group, runs its torch.distributed calls and records the bytes
this rank sent and received (:mod:`.wire`). They know nothing of optimizers. What a
collective costs (α–β models, the link probe, codec timings) is :mod:`lowbit_strategy.pricing`.
"""

from lowbit_strategy import _moved
from lowbit_strategy.collectives.exact import full_allreduce
from lowbit_strategy.collectives.majority import majority_vote
from lowbit_strategy.collectives.summed import lane_for, max_levels, summed_allreduce
from lowbit_strategy.collectives.wire import TrafficLog, TrafficRecord, recording

__all__ = [
    "majority_vote",
    "summed_allreduce",
    "full_allreduce",
    "lane_for",
    "max_levels",
    "TrafficLog",
    "TrafficRecord",
    "recording",
]

# BitDP low-bit all-gather + scales (Sec. 3.2); appended, see gathered.py.
from lowbit_strategy.collectives.gathered import (  # noqa: E402
    PayloadLayout,
    decode_reduce,
    gathered_mean,
    gathered_mean_async,
)
from lowbit_strategy.collectives.group import all_gather_async, all_reduce_sum_async  # noqa: E402

__all__ += [
    "PayloadLayout",
    "gathered_mean",
    "gathered_mean_async",
    "decode_reduce",
    "all_gather_async",
    "all_reduce_sum_async",
]

# Error-compensated 1-bit allreduce (1-bit LAMB, Algorithm 1); appended, see compensated.py.
from lowbit_strategy.collectives.compensated import (  # noqa: E402
    CompensatedAllreduce,
    compensated_allreduce,
    compensated_allreduce_start,
    compensated_error_buffers,
    server_chunk_length,
)
from lowbit_strategy.collectives.reference import compensated_allreduce_reference  # noqa: E402

__all__ += [
    "CompensatedAllreduce",
    "compensated_allreduce",
    "compensated_allreduce_start",
    "compensated_error_buffers",
    "server_chunk_length",
    "compensated_allreduce_reference",
]

# TurboQuant-Adam's two collectives (all-gather and two-stage); appended, see turboquant.py.
from lowbit_strategy.collectives.reference import turboquant_mean_reference  # noqa: E402
from lowbit_strategy.collectives.turboquant import (  # noqa: E402
    TurboQuantAllgather,
    TurboQuantTwoStage,
    turboquant_allgather_mean,
    turboquant_allgather_mean_start,
    turboquant_scale_groups,
    turboquant_server_chunk_length,
    turboquant_server_error,
    turboquant_two_stage_mean,
    turboquant_two_stage_mean_start,
)

__all__ += [
    "TurboQuantAllgather",
    "TurboQuantTwoStage",
    "turboquant_allgather_mean",
    "turboquant_allgather_mean_start",
    "turboquant_two_stage_mean",
    "turboquant_two_stage_mean_start",
    "turboquant_scale_groups",
    "turboquant_server_chunk_length",
    "turboquant_server_error",
    "turboquant_mean_reference",
]


#: names that moved or were renamed, still served here with a DeprecationWarning
__getattr__ = _moved.attribute_aliases(
    __name__,
    {
        "estimate": "lowbit_strategy.pricing.flat.estimate",
        "cheapest": "lowbit_strategy.pricing.flat.cheapest",
        "Estimate": "lowbit_strategy.pricing.flat.Estimate",
        "Layout": "lowbit_strategy.collectives.gathered.PayloadLayout",
    },
)
