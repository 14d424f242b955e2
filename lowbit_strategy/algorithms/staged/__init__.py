"""Two-stage optimizers with a compressed momentum: the parts 1-bit Adam / 1-bit LAMB and
TurboQuant-Adam share.

Both papers train in two stages. **Warm-up**: the plain optimizer on gradients averaged in
full precision (the DDP hook averages them exactly as DDP does). **Compression**: gradients
stay local; each rank forms its momentum from its own gradient, ``m_i = β1·m + (1-β1)·g_i``,
and a compressed collective returns the mean of the ``m_i`` (the same on every rank); the
optimizer then applies its update. What differs is the collective (error-compensated
1-bit signs; Hadamard + Lloyd–Max codes) and the update (frozen or live variance), which
the subclasses and their communicators supply.

**The DDP hook** (:class:`StagedSync`) does what the optimizer's stage needs. During
warm-up it averages each bucket in full precision exactly as DDP does, so the warm-up is
the plain optimizer on DDP's gradients, bit for bit. In the compression stage it keeps the
gradients local and, with the section's ``overlap`` (the default), tells the optimizer
which gradients are ready (:meth:`StagedOptimizer.grads_ready`): the optimizer forms this
rank's momentum of every fused buffer of its own layout that is complete and starts its
compressed collective while backward goes on; ``step()`` finishes those and synchronizes
the rest (everything, without ``overlap``: the same result bit for bit).

Shared here, one module each:

* :mod:`.optimizer` — :class:`StagedOptimizer`: the stage switch, the fixed bucket layout
  of the fused momentum buffers, the overlap entry from the DDP hook
  (:meth:`~StagedOptimizer.grads_ready`), the NaN/Inf rule (a step non-finite on any rank
  is skipped on every rank, state untouched);
* :mod:`.agreement` — what the ranks agree on (the NaN/Inf test, the verdict levels, through
  the shard spec) and the statistics of whole parameters under FSDP2 (the node's reductions
  of the shards'), the optimizer's :class:`~.agreement.RankAgreement` base;
* :mod:`.communicator` — :class:`BucketCommunicator`: one compressed collective per bucket,
  started from the hook or at ``step()``, the defer-one rule, and rank-local per-bucket
  state (error buffers, scales) committed only when the step is applied;
* :mod:`.sync` — :class:`StagedSync`: the algorithm-interface side (the hook: mean
  allreduce during warm-up, local gradients + overlap afterwards; attach; per-rank
  checkpoints);
* :mod:`.warmup_codes` — the warm-up in BitDP's 2-bit codes (``warmup_wire="int2"``);
* :mod:`.adam` — Adam's per-parameter arithmetic (``torch.optim.AdamW`` bit for bit, and
  the update with a given variance), which both families use.

Everything reads ``group["lr"]`` at every step, so LR schedulers work.
"""

from lowbit_strategy.algorithms.staged.communicator import BucketCommunicator, Job, Key
from lowbit_strategy.algorithms.staged.optimizer import StagedOptimizer
from lowbit_strategy.algorithms.staged.sync import (
    StagedSync,
    check_local_gradient_precision,
    rank0_state_without_errors,
)

__all__ = [
    "BucketCommunicator",
    "Job",
    "Key",
    "StagedOptimizer",
    "StagedSync",
    "check_local_gradient_precision",
    "rank0_state_without_errors",
]
