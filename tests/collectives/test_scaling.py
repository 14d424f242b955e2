"""Byte accounting at scale: every algorithm's collective at P = 2, 4, 8, 16 real gloo ranks
(16 processes on however many cores), flat and in the hierarchical form with L = 2, 4, 8
ranks per node, records exactly the bytes :mod:`lowbit_strategy.pricing.nodes`
predicts: each rank's cross-node bytes (so each node's, their sum) and its intra-node bytes.

One launch of 16 processes serves every P: the flat runs use the subgroup of ranks 0..P-1;
the hierarchical layouts of P < 16 are built on it as :func:`hierarchy.resolve` builds them on
the world (node groups marked node-local, local rank j's cross-node group), those of P = 16
come from ``resolve`` itself (``topology="hierarchical", ranks_per_node=L``). One node
(N = 1) is run where the code under test decides what one node does: Lion Cub's directions
and BitDP's hook (the staged optimizers bypass their communicator at one worker). Small
buckets of two sizes: 3001 elements (partial bytes, blocks, rows) and 130 (empty shards at
L = 4, 8, which still send one element)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowbit_strategy import LowBitConfig
from lowbit_strategy.pricing import nodes as cm
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives import hierarchy, wire
from lowbit_strategy.collectives.gathered import matrix_shape
from tests.distributed import run_ranks

pytestmark = pytest.mark.slow

WORLD, WORLDS, PER_NODE, SIZES, BLOCK = 16, (2, 4, 8, 16), (2, 4, 8), (3001, 130), 64
LION_MODES = {"1bit": {}, "sign": {}, "lp8": {"mode": "lp", "bits": 8}, "fp32": {}}


def _layouts():
    """``(P, L)`` in the order every rank makes their groups; L None: flat."""
    for p in WORLDS:
        yield p, None
        yield from ((p, per_node) for per_node in PER_NODE if p % per_node == 0)


def _topology(p, per_node, flat_group, rank):
    """The hierarchical layout of ranks 0..P-1 in nodes of ``per_node`` (every rank makes
    every group, in the same order); None for ranks outside it."""
    if p == WORLD:
        return hierarchy.resolve(LowBitConfig(topology="hierarchical", ranks_per_node=per_node), None)
    nodes = p // per_node
    intra = [dist.new_group(list(range(k * per_node, (k + 1) * per_node))) for k in range(nodes)]
    inter = [dist.new_group(list(range(j, p, per_node))) for j in range(per_node)]
    for grp in intra:
        g.mark_node_local(grp)
    if rank >= p:
        return None
    node, j = rank // per_node, rank % per_node
    return hierarchy.Topology(flat_group, p, per_node, node, j, True, intra[node], inter[j])


def _vector(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def lion_section(mode, n, group, topo):
    from lowbit_strategy.algorithms.lion_cub.communicator import LionCommunicator

    extra = LION_MODES[mode] or {"mode": mode}
    cfg = LowBitConfig(algorithm="lion", warmup_steps=0, bucket_size_mb=1.0, **extra)
    comm = LionCommunicator(cfg, group=group, topology=topo)
    c = _vector(n, 1 + (topo.node if topo else g.rank(group)))
    if comm.world_size == 1:  # one node: directions() sends nothing compressed
        comm.directions([c], step=1)
    else:  # the overlap path: the non-finite flag rides along
        comm.launch([c], [c], step=1, nonfinite=torch.tensor(False))
        comm.collect()


def _staged(name, n, group, topo):
    from lowbit_strategy.algorithms.onebit.communicator import OneBitCommunicator
    from lowbit_strategy.algorithms.turboquant.communicator import TurboQuantCommunicator

    if name == "compensated":
        comm = OneBitCommunicator(group=group, bucket_size_mb=1.0, block=BLOCK, topology=topo)
    else:
        form = name.removeprefix("turboquant_")
        comm = TurboQuantCommunicator(group=group, bucket_size_mb=1.0, block=BLOCK, form=form, topology=topo)
    comm.synchronize([((0,), [_vector(n, 7 + (topo.node if topo else g.rank(group)))])])
    comm.commit()


class _Bucket:
    """The part of ``dist.GradBucket`` BitDP's hooks read: one bucket of every parameter."""

    def __init__(self, params, buf):
        self._params, self._buf = params, buf

    def buffer(self):
        return self._buf

    def parameters(self):
        return self._params

    def gradients(self):
        out, at = [], 0
        for p in self._params:
            out.append(self._buf[at : at + p.numel()].view(p.shape))
            at += p.numel()
        return out

    def index(self):
        return 0

    def is_last(self):
        return False


def _bitdp(form, n, group, topo, rank):
    """BitDP's hook on one bucket of a small MLP's gradients (``n`` picks its width);
    returns ``(channel matrix shapes, full-precision elements)`` of the bucket."""
    from lowbit_strategy.algorithms.bitdp.algorithm import BitDPSync

    torch.manual_seed(0)
    width = 40 if n > 1000 else 9
    module = nn.Sequential(nn.Linear(48, width), nn.ReLU(), nn.Linear(width, 24), nn.Linear(24, 10))
    sync = BitDPSync(LowBitConfig(algorithm="bitdp", form=form), module, group)
    sync.topology = topo
    sync.state.iter = sync.state.start_iter  # past the warm-up
    params = list(module.parameters())
    bucket = _Bucket(params, _vector(sum(p.numel() for p in params), rank))
    sync.comm_hook(sync.hook_state, bucket).wait()
    plan = sync.state.plan(bucket)
    shapes = [matrix_shape(params[[id(q) for q in params].index(key)]) for _, _, key in plan.quantized]
    return shapes, sum(k for _, k in plan.full)


def _expected(case, n, p, per_node, bitdp):
    """``(cross-node bytes, intra-node bytes)`` of this rank (local rank j) by the cost model."""
    name, form = case
    if per_node is None:
        sends = (
            cm.bitdp_sends(form, *bitdp, p)
            if name == "bitdp"
            else cm.bucket_sends(form, n, p, flagged=name == "lion", block=BLOCK)
        )
        return sends.total, 0
    nodes = p // per_node
    if name == "bitdp":
        return cm.bitdp_hierarchical_sends(form, *bitdp, nodes, per_node)
    align = BLOCK if name == "staged" else 64
    return cm.hierarchical_sends(form, n, nodes, per_node, align=align, flagged=name == "lion", block=BLOCK)


CASES = (
    [("lion", m) for m in LION_MODES]
    + [("staged", s) for s in ("compensated", "turboquant_allgather", "turboquant_two_stage")]
    + [("bitdp", "allgather"), ("bitdp", "two_stage")]
)


def _run_case(case, n, p, per_node, group, topo, rank):
    name, form = case
    bitdp = None
    with wire.recording() as log:
        if name == "lion":
            if topo is not None:
                topo.node_mean_(_vector(n, rank), None)  # (the DDP hook's, on the gradients)
            lion_section(form, n, group, topo)
        elif name == "staged":
            if topo is not None:
                topo.node_mean_(_vector(n, rank), None)
            _staged(form, n, group, topo)
        else:
            bitdp = _bitdp(form, n, group, topo, rank)
    expected = _expected(case, n, p, per_node, bitdp)
    if isinstance(expected, cm.NodeSends):
        j = rank % per_node
        expected = (expected.network[j].total, expected.node)
    got = (log.bytes_sent, log.node_bytes_sent)
    assert got == expected, f"{case} n={n} P={p} L={per_node} rank {rank}: recorded {got}, cost model {expected}"


def _check(rank, world_size):
    torch.set_num_threads(1)
    flat = {p: dist.new_group(list(range(p))) for p in WORLDS}
    for p, per_node in _layouts():
        topo = None if per_node is None else _topology(p, per_node, flat[p], rank)
        if rank >= p:
            continue
        if topo is not None and p == WORLD:
            assert (topo.nodes, topo.local_rank, topo.node) == (p // per_node, rank % per_node, rank // per_node)
        for case in CASES:
            if case[0] == "staged" and per_node == p:
                continue  # one node: the staged optimizers do not call their communicator
            for n in SIZES:
                _run_case(case, n, p, per_node, flat[p], topo, rank)
    dist.barrier()


def test_recorded_bytes_match_the_cost_model_at_p_up_to_16():
    run_ranks(WORLD, _check)
