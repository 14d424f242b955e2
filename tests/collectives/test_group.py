"""``collectives.group.cpu_group``: the group that moves CPU tensors (setup agreements,
checkpoints) is the given one whenever gloo serves its CPU tensors, including per-device
backends (``cpu:gloo,cuda:nccl``, what torch picks by default on a GPU machine, and the
one-GPU check's ``cpu:gloo,cuda:gloo``), and a gloo group of its ranks otherwise."""
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import torch.distributed as dist
    from lowbit_strategy.collectives import group as g

    for backend, same in (("gloo", True), ("cpu:gloo,cuda:gloo", True), ("cuda:gloo", False)):
        dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())
        got = g.cpu_group()
        assert (got is dist.group.WORLD) == same, (backend, dist.get_backend(got))
        assert dist.get_backend(got) == ("gloo" if not same else backend), (backend, dist.get_backend(got))
        dist.destroy_process_group()
        g._CPU_GROUPS.clear()
    print("ok")
    """
)


@pytest.mark.slow
def test_cpu_group_reuses_a_group_whose_cpu_backend_is_gloo():
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
