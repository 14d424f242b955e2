"""The sharded front end: FSDP2 inside each node, the algorithm's low-bit exchange across nodes.

::

    mesh = lowbit_strategy.node_mesh("cuda")               # ("replicate", "shard"): nodes x ranks per node
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])            # shard inside the node only
    fully_shard(model, mesh=mesh["shard"])
    opt = lowbit_strategy.OneBitAdam(model.parameters(), lr=1e-4, freeze_step=1000)
    sync = lowbit_strategy.attach_sharded(model, [opt], LowBitConfig(algorithm="onebit_adam"), mesh=mesh)
    ...                                                    # train as usual: loss.backward(); opt.step()

The hierarchical form's three stages, with the shards coming from FSDP2 (HSDP, with the
replicate all-reduce replaced by the algorithm's own collective):

1. inside the node, FSDP2's reduce-scatter averages the gradients: each rank holds the node's
   mean gradient of its shard (dim-0 rows of every parameter);
2. across nodes, the algorithm's collective runs over ``mesh["replicate"]`` (the ranks that
   hold the same shard on every node) on this rank's shards only — from FSDP's per-unit
   all-reduce hook when it averages gradients (BitDP's 1/2-bit rows; the staged optimizers'
   warm-up: the exact mean, as HSDP would); when it forms what it sends from the node's
   gradient (Lion Cub's update vectors, the compressed momenta), during backward too, once
   FSDP has assigned the unit's gradients (its post-accumulate-grad hooks,
   :class:`_UnitLaunch`), so the exchange hides behind the rest of backward as HSDP's
   all-reduce does and ``step()`` waits and applies (with the section's ``overlap=False``, or
   a front end that clips, it runs in ``step()``); the optimizer steps the shard, so its
   state, and every error buffer, is 1/L of the replicated form's;
3. FSDP2's all-gather of the parameters at the next forward replaces the node's all-gather.

The node is the worker: the result is the flat algorithm's over N workers that see their
node's mean gradient, in the sharded layout (each bucket of the optimizer's layout holds
local shards). The ranks of a node hold different shards, so a step's NaN/Inf verdict is
agreed once per step over every rank (:class:`~lowbit_strategy.collectives.shards.LocalShard`).

Why not FSDP2's native HSDP (a 2-D mesh given to ``fully_shard``): its replicate all-reduce
is a hard-coded ``all_reduce`` whose hook cannot replace it (``set_requires_all_reduce(False)``
also skips the hook and assigns no gradients). So the model is sharded over the node only,
and :func:`attach_sharded` refuses a 2-D or node-spanning mesh, naming the fix.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from lowbit_strategy import algorithms
from lowbit_strategy.algorithms.base import LowBitSetupError, Sync
from lowbit_strategy.collectives import fsdp_reduce_scatter, hierarchy
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives.shards import LocalShard
from lowbit_strategy.config import LowBitConfig
from lowbit_strategy.integrations.ddp import attach_optimizers, build_sync
from lowbit_strategy.layout import is_dtensor
from lowbit_strategy.pricing.sharded import padded_shard_numel

logger = logging.getLogger(__name__)

__all__ = ["attach_sharded", "node_mesh", "sharded_units", "sharding_mesh", "world_mesh"]

#: the dimension names of :func:`node_mesh`
DIMS = ("replicate", "shard")


def fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
    except ImportError:  # pragma: no cover - older torch
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def node_mesh(device_type: str = "cuda", config: LowBitConfig | Mapping[str, Any] | str | None = None):
    """A 2-D ``DeviceMesh`` with dims ``("replicate", "shard")``: one row per node (N), one
    column per rank of a node (L), from the node layout the launcher exported
    (``LOCAL_WORLD_SIZE``; ``LowBitConfig.ranks_per_node`` overrides it; nodes are contiguous
    rank blocks, checked on every rank together by
    :func:`~lowbit_strategy.collectives.hierarchy.resolve`). ``fully_shard`` the model over
    ``mesh["shard"]`` and hand the mesh to :func:`attach_sharded`. Collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    cfg = LowBitConfig.coerce(config)
    topo = hierarchy.resolve(cfg.replace(topology="flat"), None)  # the layout only: no groups of its own
    return init_device_mesh(device_type, (topo.nodes, topo.ranks_per_node), mesh_dim_names=DIMS)


def world_mesh(device_type: str = "cuda"):
    """A 2-D ``DeviceMesh`` with dims ``("replicate", "shard")`` of shape ``(1, P)``: one FSDP
    group over every rank (``LowBitConfig.fsdp_shard="world"``), for a model that does not fit
    in one node. Collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (1, dist.get_world_size()), mesh_dim_names=DIMS)


def sharding_mesh(device_type: str = "cuda", config: LowBitConfig | Mapping[str, Any] | str | None = None):
    """The mesh the front ends shard over, from ``LowBitConfig.fsdp_shard``: :func:`node_mesh`
    (``node``) or :func:`world_mesh` (``world``). ``fully_shard`` over ``mesh["shard"]``."""
    cfg = LowBitConfig.coerce(config)
    return world_mesh(device_type) if cfg.fsdp_shard == "world" else node_mesh(device_type, cfg)


def sharded_units(model: torch.nn.Module) -> list[tuple[torch.nn.Module, list[torch.Tensor]]]:
    """Every ``fully_shard``-ed module of ``model`` with the parameters it manages itself (its
    own, not those of a nested unit), in module order."""
    cls = fsdp_module_class()
    if cls is None:
        return []
    units = [m for m in model.modules() if isinstance(m, cls)]
    out: list[tuple[torch.nn.Module, list[torch.Tensor]]] = []
    for unit in units:
        nested = {id(p) for sub in unit.modules() if sub is not unit and isinstance(sub, cls) for p in sub.parameters()}
        out.append((unit, [p for p in unit.parameters() if id(p) not in nested]))
    return out


def _ranks(mesh) -> list[int]:
    return [int(r) for r in mesh.mesh.flatten().tolist()]


def _problem(model: torch.nn.Module, mesh) -> str | None:
    """Why ``model`` / ``mesh`` cannot run sharded here, with the fix; None when they can."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return (
            "attach_sharded takes a model sharded with torch.distributed.fsdp.fully_shard over mesh['shard'], "
            "not a DistributedDataParallel model; for a replicated model use lowbit_strategy.attach(ddp_model, ...)"
        )
    if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != DIMS:
        return f"mesh must be 2-D with dims {DIMS} (lowbit_strategy.node_mesh), got dims {mesh.mesh_dim_names}"
    units = sharded_units(model)
    fix = (
        "shard each block and then the root over the node: mesh = lowbit_strategy.node_mesh(device_type); "
        "fully_shard(block, mesh=mesh['shard']) for each block; fully_shard(model, mesh=mesh['shard'])"
    )
    if not units:
        return f"the model has no fully_shard-ed module: {fix}"
    if not all(hasattr(unit, "set_all_reduce_hook") for unit, _ in units):
        return f"this torch ({torch.__version__}) has no FSDPModule.set_all_reduce_hook: use torch >= 2.6"
    node = _ranks(mesh["shard"])
    plain = [n for n, p in model.named_parameters() if not is_dtensor(p)]
    if plain:
        return f"parameters {plain[:4]} are not sharded (plain tensors: no node reduce-scatter): {fix}"
    for name, p in model.named_parameters():
        pm = cast(Any, p).device_mesh  # a DTensor (checked above)
        if pm.ndim != 1:
            return (
                f"parameter {name!r} is sharded over a {pm.ndim}-D mesh: FSDP2's native HSDP hard-codes its "
                f"replicate all-reduce, which the low-bit exchange replaces; {fix}"
            )
        if _ranks(pm) != node:
            return (
                f"parameter {name!r} is sharded over ranks {_ranks(pm)}, not the mesh's FSDP group {node}: "
                f"shard over mesh['shard']: {fix}; or, for a model that does not fit in one node, shard over every "
                "rank (LowBitConfig.fsdp_shard='world', mesh = lowbit_strategy.world_mesh(device_type)) and "
                "quantize its reduce-scatter (fsdp_reduce_scatter='int4')"
            )
    return None


def _mismatch(cfg: LowBitConfig, mesh) -> str | None:
    """A mesh that contradicts ``LowBitConfig.fsdp_shard``, or None."""
    if cfg.fsdp_shard == "world" and mesh["replicate"].size() > 1:
        return (
            f"LowBitConfig.fsdp_shard='world' asks for one FSDP group over every rank, but the mesh has "
            f"{mesh['replicate'].size()} groups of {mesh['shard'].size()}: pass "
            "lowbit_strategy.sharding_mesh(device_type, config) (or a 1-D mesh over every rank), or fsdp_shard='node'"
        )
    return None


def _agreed_problem(problem: str | None) -> None:
    """Raise the same :class:`LowBitSetupError` on every rank when any rank found a problem."""
    world = dist.get_world_size()
    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, problem, group=g.cpu_group(None))
    bad = [(r, p) for r, p in enumerate(seen) if p is not None]
    if bad:
        ranks = [r for r, _ in bad]
        raise LowBitSetupError(f"attach_sharded (rank(s) {ranks[:8]}): {bad[0][1]}")


def _unit_hook(sync: Sync, params: list[torch.Tensor], launch: _UnitLaunch | None) -> Callable[[torch.Tensor], None]:
    """FSDP's all-reduce hook of one unit: ``reduce_output`` is the unit's flat padded
    gradient shard, the node's mean, after the reduce-scatter. When the algorithm averages
    now (:meth:`Sync.gradients_ready`: a warm-up, BitDP's rows) the cross-node mean is
    written into it in place, before FSDP makes the gradients from it; else it stays the
    node's, and ``launch`` (with overlap) starts the exchange once FSDP assigned them."""

    def hook(reduce_output: torch.Tensor) -> None:
        averaged = sync.gradients_ready(params, reduce_output)
        if averaged is not None:
            averaged.wait()  # FSDP reads the buffer when the hook returns
        elif launch is not None:
            launch.reduced(reduce_output)

    return hook


class _UnitLaunch:
    """Starts one unit's exchange during backward, once FSDP2 has assigned the unit's
    gradients, so that it hides behind the rest of backward as HSDP's all-reduce does.

    FSDP2 calls the all-reduce hook with the unit's flat shard, then divides, casts and views
    it out into each parameter's ``.grad`` and runs that parameter's post-accumulate-grad
    hooks (``foreach_reduce``, torch >= 2.5). The unit is complete when the parameters whose
    hooks ran cover the flat shard (:func:`padded_shard_numel` each): the same on every rank
    of the unit, and the same unit order on every node when every node's backward reaches
    the same units (as HSDP's own all-reduce needs); then :meth:`Sync.launch_ready` forms
    what the algorithm sends from ``p.grad``. A torch that runs no such hooks launches
    nothing here: the exchange stays at ``step()``. On CUDA both hooks run on FSDP's
    all-reduce stream, which FSDP's end of backward makes the compute stream wait for."""

    def __init__(self, sync: Sync, params: list[torch.Tensor], shards: int):
        self.sync, self.params = sync, params
        self.numel = {id(p): padded_shard_numel([tuple(p.shape)], shards) for p in params}
        self.flat: torch.Tensor | None = None
        self.covered = 0

    def reduced(self, flat: torch.Tensor) -> None:
        self.flat, self.covered = flat, 0

    def assigned(self, p: torch.Tensor) -> None:
        if self.flat is None:
            return
        self.covered += self.numel[id(p)]
        if self.covered >= self.flat.numel():
            flat, self.flat = self.flat, None
            self.sync.launch_ready(self.params, flat)

    @staticmethod
    def register(unit: torch.nn.Module, launch: _UnitLaunch | None) -> None:
        """Hook the unit's parameters to ``launch`` (None: no hooks), removing the hooks an
        earlier ``attach_sharded`` of the same model registered (a second ``fit``: inert once
        its all-reduce hook is replaced, but still called on every step)."""
        for handle in getattr(unit, "_lowbit_launch_hooks", ()):
            handle.remove()
        handles = []
        if launch is not None:
            handles = [p.register_post_accumulate_grad_hook(launch.assigned) for p in launch.params if p.requires_grad]
        unit._lowbit_launch_hooks = handles  # type: ignore[assignment]


def _quantize_reduce_scatters(units, cfg: LowBitConfig, mesh, sync: Sync, nodes: hierarchy.Topology) -> None:
    """Every unit's reduce-scatter becomes ``cfg.fsdp_reduce_scatter``'s
    (:mod:`lowbit_strategy.collectives.fsdp_reduce_scatter`): two hops when the FSDP group is
    the world and it spans nodes (``nodes``: the launcher's node layout as ``build_sync``
    resolved it, with its node and cross-node groups), else one. Its bytes go to
    ``sync.node_traffic``, each with its scope."""
    world, rank = dist.get_world_size(), dist.get_rank()
    hops = None
    if mesh["shard"].size() == world > 1 and nodes.hierarchical:
        hops = fsdp_reduce_scatter.Hops(nodes.intra, nodes.inter, nodes.nodes, nodes.ranks_per_node)
    bits = fsdp_reduce_scatter.BITS[cfg.fsdp_reduce_scatter]
    comms = []
    for i, (unit, _) in enumerate(units):
        comm = fsdp_reduce_scatter.QuantizedReduceScatter(
            bits,
            hops=hops,
            salt=fsdp_reduce_scatter.salt(i, rank),
            traffic=sync.node_traffic,
            error_feedback=cfg.fsdp_error_feedback,
        )
        unit.set_custom_reduce_scatter(comm)
        comms.append(comm)
    if cfg.fsdp_error_feedback:  # rank-local state: saved and restored with the algorithm's
        sync.parts["fsdp_reduce_scatter"] = fsdp_reduce_scatter.UnitErrors(comms)
    logger.info(
        "lowbit: FSDP reduce-scatter %s over %d rank(s)%s",
        cfg.fsdp_reduce_scatter,
        mesh["shard"].size(),
        f", two hops ({hops.nodes} nodes x {hops.ranks_per_node}: exact inside the node)" if hops else "",
    )


def attach_sharded(
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    config: LowBitConfig | Mapping[str, Any] | str | None = None,
    mesh=None,
    *,
    root: torch.nn.Module | None = None,
    **overrides: Any,
) -> Sync:
    """Run ``config.algorithm`` across nodes on a model ``fully_shard``-ed inside each node
    (module docstring). ``mesh``: :func:`node_mesh`'s (made here when None, on the parameters'
    device type). Checks the model and mesh (one error on every rank, naming the fix: a DDP
    model, a native-HSDP 2-D mesh, an FSDP group spanning nodes, unsharded parameters), runs
    the same configuration handshake and optimizer checks as :func:`~lowbit_strategy.attach`,
    registers each unit's all-reduce hook and wires the optimizers.

    Optimizer-level algorithms start their exchange during backward, from the gradients as
    FSDP assigns them (the section's ``overlap``, on by default): a gradient edited between
    backward and ``step()`` (``clip_grad_norm_``, manual scaling) is not what was sent. Pass
    ``overlap=False`` in the algorithm's section (or call ``sync.disable_overlap(reason)``
    before the first backward) and the exchange runs in ``step()`` from the edited gradients.

    ``root``: the FSDP root when it is a wrapper holding ``model`` with no parameters of its
    own (a front end's entry point whose forward runs the user's step, as Lightning's
    :class:`~lowbit_strategy.integrations.lightning_sharded.LowBitFSDPStrategy` makes): its
    units get the hooks, while parameter names (selection patterns, checkpoint state) stay
    ``model``'s, as with :func:`~lowbit_strategy.attach`."""
    cfg = LowBitConfig.coerce(config, **overrides)
    if root is None:
        root = model
    elif not any(m is model for m in root.modules()) or len(list(root.parameters())) != len(list(model.parameters())):
        raise LowBitSetupError("attach_sharded: root must hold model and no parameters besides model's")
    if mesh is None:
        device = next((p.device.type for p in model.parameters()), "cpu")
        mesh = sharding_mesh(device, cfg)
    elif mesh.ndim == 1 and mesh.size() == dist.get_world_size():
        mesh = world_mesh(mesh.device_type)  # one FSDP group over every rank, in this module's dims
    _agreed_problem(_mismatch(cfg, mesh) or _problem(root, mesh))
    algo = algorithms.get(cfg.algorithm)
    if not algo.sharded:
        raise LowBitSetupError(
            f"{cfg.algorithm} has no sharded form yet (attach_sharded runs "
            f"{', '.join(a.name for a in algorithms.REGISTRY.values() if a.sharded)}); "
            "use it with DDP (lowbit_strategy.attach) or pick one of those"
        )
    # the FSDP group is the node in the HSDP form; with one group over every rank (fsdp_shard="world")
    # the node layout is the launcher's or the config's alone
    node_hint = mesh["shard"].size() if mesh["replicate"].size() > 1 else None
    sync = build_sync(cfg, model, None, ranks_per_node=node_hint)
    # the DDP node stages (node mean, node all-gather) are FSDP's here: the topology only
    # describes, with the FSDP group as the algorithm's node (the world for fsdp_shard="world")
    topology = cast(hierarchy.Topology, sync.topology)  # (build_sync sets it)
    per_group, rank = mesh["shard"].size(), dist.get_rank()
    sync.topology = dataclasses.replace(
        topology,
        ranks_per_node=per_group,
        node=rank // per_group,
        local_rank=rank % per_group,
        hierarchical=False,
        intra=None,
        inter=None,
    )
    sync.spec = LocalShard(mesh["replicate"].get_group(), mesh["shard"].get_group())
    # what an optimizer-level algorithm sends is formed from p.grad, which FSDP assigns after
    # the all-reduce hook returns: launched from the post-accumulate-grad hooks (_UnitLaunch)
    sync.launch_after_assignment = True
    units = sharded_units(root)
    for unit, params in units:
        if params:
            launch = _UnitLaunch(sync, params, per_group) if sync.level == "optimizer" else None
            unit.set_all_reduce_hook(_unit_hook(sync, params, launch))  # type: ignore[operator]
            _UnitLaunch.register(unit, launch)
    if cfg.fsdp_reduce_scatter != "fp32":
        _quantize_reduce_scatters(units, cfg, mesh, sync, topology)
    attach_optimizers(sync, list(optimizers))
    logger.info(
        "lowbit: %s sharded: FSDP2 inside %d node(s) of %d rank(s), the low-bit exchange across nodes",
        cfg.algorithm,
        mesh["replicate"].size(),
        mesh["shard"].size(),
    )
    return sync
