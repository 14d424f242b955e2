"""How a benchmark worker rank (or a test's torchrun app) ends: ``leave(main())``.

The default process group is destroyed only after ``main()`` has returned, so its DDP model
is gone by then. Were DDP's reducer the group's last owner, freeing it would join gloo's
worker threads while holding the GIL (torch binds the reducer without releasing it), and a
worker still freeing the final barrier's work needs the GIL to drop its tensors: a deadlock,
seen about 1 run in 8 at 4 ranks on 2 cores (pytorch/pytorch#56297 describes the class).
Then the rank leaves without interpreter finalization, where a gloo process that ran
collectives now and then aborts after everything has finished (pytorch/pytorch#190489).
"""

from __future__ import annotations

import gc
import os
import sys

import torch.distributed as dist


def leave(code: int) -> None:
    """Barrier, destroy the default group (every rank), flush, and exit with ``code``."""
    gc.collect()  # anything of main()'s still held by a reference cycle, freed while the group lives
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
