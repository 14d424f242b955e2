"""The quantized FSDP reduce-scatter (``LowBitConfig.fsdp_reduce_scatter``) at 2 emulated nodes
x 2 ranks on gloo: bit for bit against its single-process oracle (one hop and two hops, every
width, AVG and SUM, bf16 input), under the NCCL-semantics emulation; its error within the
codec's bound of the exact reduce-scatter on heavy-tailed gradients; the bytes each rank sends
equal to the formula; and inside FSDP2 (``attach_sharded``), each rank's gradient shard equal
to the oracle applied to every rank's gradient laid out as FSDP lays it out."""
from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

import lowbit_strategy
from lowbit_strategy import LowBitConfig
from lowbit_strategy.codecs import blockwise as bw
from lowbit_strategy.collectives import fsdp_reduce_scatter as qrs
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives import wire
from lowbit_strategy.collectives.reference import fsdp_reduce_scatter_reference
from tests.distributed import run_ranks
from tests.training import loss, model

PER_NODE, WORLD, C = 2, 4, 600


def _inputs(dtype=torch.float32, seed=0) -> list[torch.Tensor]:
    """Every rank's FSDP input (W rows of C), heavy-tailed (Student t, 2 degrees of freedom)."""
    out = []
    for r in range(WORLD):
        torch.manual_seed(seed * 100 + r)
        t = torch.distributions.StudentT(torch.tensor(2.0)).sample((WORLD * C,))
        out.append(t.to(dtype))
    return out


def _groups():
    intra = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    inter = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    for grp in intra:
        g.mark_node_local(grp)
    return intra, inter


def _check_direct(rank, world_size):
    from lowbit_strategy.collectives import emulation

    assert emulation.ACTIVE  # NCCL's completion semantics: a result read before its wait() is poison
    intra, inter = _groups()
    node, local = divmod(rank, PER_NODE)
    hops = qrs.Hops(intra[node], inter[local], world_size // PER_NODE, PER_NODE)
    for bits in (8, 4, 2):
        for two_hop in (False, True):
            for dtype, average in ((torch.float32, True), (torch.float32, False), (torch.bfloat16, True)):
                xs = _inputs(dtype, seed=bits)
                log = wire.TrafficLog()
                comm = qrs.QuantizedReduceScatter(
                    bits, hops=hops if two_hop else None, salt=qrs.salt(3, rank), traffic=log
                )
                out = torch.empty(C, dtype=dtype)
                op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
                assert comm(output_tensor=out, input_tensor=xs[rank].clone(), group=None, op=op) is None
                nodes = world_size // PER_NODE if two_hop else 1
                want = fsdp_reduce_scatter_reference(xs, bits, nodes, average, unit=3)[rank].to(dtype)
                case = f"bits={bits} two_hop={two_hop} {dtype} avg={average}"
                assert torch.equal(out, want), case
                node_bytes, net_bytes = qrs.reduce_scatter_bytes(C, world_size, bits, xs[0].element_size(), nodes)
                assert (log.node_bytes_sent, log.bytes_sent) == (node_bytes, net_bytes), case
    # error feedback: three calls, the buffers carried (and a NaN in the second leaves them finite)
    for two_hop in (False, True):
        nodes = world_size // PER_NODE if two_hop else 1
        comm = qrs.QuantizedReduceScatter(
            4, hops=hops if two_hop else None, salt=qrs.salt(1, rank), traffic=wire.TrafficLog(), error_feedback=True
        )
        errors = [torch.zeros(nodes if two_hop else world_size, C) for _ in range(world_size)]
        for call in range(3):
            xs = _inputs(seed=10 + call)
            if call == 1:
                xs[1][5] = float("nan")  # rank 1's row for rank 0
            out = torch.empty(C)
            comm(out, xs[rank].clone(), None, dist.ReduceOp.AVG)
            want = fsdp_reduce_scatter_reference(xs, 4, nodes, True, unit=1, errors=errors)[rank]
            assert torch.equal(out, want) or (call == 1 and torch.equal(out.isnan(), want.isnan())), (two_hop, call)
            assert torch.equal(comm.error, errors[rank]) and comm.error.isfinite().all(), (two_hop, call)
        assert comm.error.abs().sum() > 0
        # resume: a fresh reduce-scatter loaded from the state continues bit for bit
        fresh = qrs.QuantizedReduceScatter(  # hops as a plain 4-tuple: read as a Hops
            4, hops=tuple(hops) if two_hop else None, salt=qrs.salt(1, rank), traffic=wire.TrafficLog(),
            error_feedback=True,
        )
        saved = qrs.UnitErrors([comm]).state_dict()
        assert saved["format"] == qrs.UnitErrors.FORMAT == 1
        with pytest.raises(ValueError, match="has format 2; this version reads format 1"):
            qrs.UnitErrors([fresh]).load_state_dict({**saved, "format": 2})
        qrs.UnitErrors([fresh]).load_state_dict({"units": saved["units"]})  # written before the format key
        assert torch.equal(fresh.error, comm.error)
        qrs.UnitErrors([fresh]).load_state_dict(saved)
        a, b = torch.empty(C), torch.empty(C)
        comm(a, _inputs(seed=20)[rank].clone(), None, dist.ReduceOp.AVG)
        fresh(b, _inputs(seed=20)[rank].clone(), None, dist.ReduceOp.AVG)
        assert torch.equal(a, b) and torch.equal(comm.error, fresh.error)
        with pytest.raises(ValueError, match="holds 1 units, the model has 2"):
            qrs.UnitErrors([fresh, fresh]).load_state_dict(saved)
    # the bytes across nodes, per node: two hops send L x fewer rows than one
    one = qrs.reduce_scatter_bytes(C, world_size, 4, 4, 1)[1]
    two = qrs.reduce_scatter_bytes(C, world_size, 4, 4, 2)[1]
    code, scale = bw.row_bytes(C, 4)
    assert one == 3 * (code + scale) and two == code + scale
    with pytest.raises(ValueError, match="gradient divide factor"):
        qrs.QuantizedReduceScatter(4, hops=None, salt=0, traffic=wire.TrafficLog())(
            torch.empty(C), _inputs()[rank], None, dist.ReduceOp.MAX
        )


@contextmanager
def _emulating():
    before = os.environ.get("LOWBIT_EMULATE_NCCL")
    os.environ["LOWBIT_EMULATE_NCCL"] = "1"  # read by the spawned ranks
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LOWBIT_EMULATE_NCCL")
        else:
            os.environ["LOWBIT_EMULATE_NCCL"] = before


@pytest.mark.slow
def test_one_and_two_hops_equal_their_oracle_bit_for_bit_under_nccl_semantics_with_the_formula_bytes():
    with _emulating():
        run_ranks(WORLD, _check_direct)


def test_error_stays_within_the_codec_bound_of_the_exact_reduce_scatter():
    """Single process: the oracle against the exact mean on heavy-tailed rows. Each quantized
    contribution is off by at most half a step of its block (one step at 2 bits, stochastic),
    so a rank's result is within the sum of those steps / W; int8 is also close in norm."""
    xs = _inputs()
    exact = torch.stack([x.view(WORLD, C) for x in xs]).double().sum(0) / WORLD  # row r: rank r's result
    for bits in (8, 4, 2):
        for nodes in (1, 2):
            got = fsdp_reduce_scatter_reference(xs, bits, nodes, True)
            for r in range(WORLD):
                if nodes == 1:  # every other rank's row for r crossed, quantized
                    sent = [xs[s].view(WORLD, C)[r] for s in range(WORLD) if s != r]
                else:  # the other node's partial sum for r crossed
                    per = PER_NODE
                    other = 1 - r // per
                    sent = [sum(xs[other * per + k].view(WORLD, C)[r].double() for k in range(per))]
                steps = sum(
                    (torch.nn.functional.pad(s.double().abs(), (0, bw.blocks(C) * bw.BLOCK - C))
                     .view(-1, bw.BLOCK).amax(1) / bw.LEVELS[bits]).repeat_interleave(bw.BLOCK)[:C]
                    for s in sent
                )
                bound = steps * (1.0 if bits == 2 else 0.5) / WORLD + 1e-5 * exact[r].abs().max()
                err = (got[r].double() - exact[r]).abs()
                assert (err <= bound).all(), (bits, nodes, r, (err - bound).max())
            rel = torch.stack([(got[r].double() - exact[r]).norm() / exact[r].norm() for r in range(WORLD)])
            if bits == 8:
                assert rel.max() < 0.05, rel  # t(2) tails: one outlier sets a block's step
            assert rel.max() < {8: 1, 4: 1, 2: 2}[bits], rel  # sanity: never wild


def test_error_feedback_cancels_the_rounding_bias_over_calls():
    """The same heavy-tailed gradients every call: int4's nearest rounding makes the same error
    each time, so the mean of the results keeps it; with error feedback the results' mean
    approaches the exact mean (the error carried is at most a step per element)."""
    xs = _inputs(seed=3)
    exact = torch.stack([x.view(WORLD, C) for x in xs]).double().sum(0) / WORLD
    for nodes in (1, 2):
        plain = fsdp_reduce_scatter_reference(xs, 4, nodes, True)
        errors = [torch.zeros(nodes if nodes > 1 else WORLD, C) for _ in range(WORLD)]
        calls = 50
        mean = [torch.zeros(C, dtype=torch.float64) for _ in range(WORLD)]
        for _ in range(calls):
            for r, out in enumerate(fsdp_reduce_scatter_reference(xs, 4, nodes, True, errors=errors)):
                mean[r] += out.double() / calls
        for r in range(WORLD):
            without = (plain[r].double() - exact[r]).abs().mean()
            with_ef = (mean[r] - exact[r]).abs().mean()
            assert with_ef < 0.1 * without, (nodes, r, with_ef.item(), without.item())


def _fsdp_inputs(replicas_grads: list[list[torch.Tensor]], world: int) -> list[torch.Tensor]:
    """Each rank's reduce-scatter input for a unit of parameters, as FSDP2 lays it out: every
    parameter's gradient padded to ceil(d0/W)·W rows, row r the concatenation of every
    parameter's r-th chunk."""
    out = []
    for grads in replicas_grads:
        rows = []
        for r in range(world):
            parts = []
            for gr in grads:
                c0 = -(-gr.shape[0] // world)
                padded = torch.zeros((c0 * world, *gr.shape[1:]))
                padded[: gr.shape[0]] = gr
                parts.append(padded[r * c0 : (r + 1) * c0].reshape(-1))
            rows.append(torch.cat(parts))
        out.append(torch.cat(rows))
    return out


def _check_inside_fsdp(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    for shard, bits, steps, feedback in (("world", "int4", 3, False), ("node", "int8", 2, False), ("world", "int2", 3, True)):
        cfg = LowBitConfig(algorithm="lion", ranks_per_node=PER_NODE, fsdp_shard=shard, fsdp_reduce_scatter=bits,
                           fsdp_error_feedback=feedback)
        errors = {unit: [torch.zeros(2, 0)] * world_size for unit in (1, 2, 3)}  # made at the first call
        mesh = lowbit_strategy.sharding_mesh("cpu", cfg)
        given = mesh
        if shard == "world" and not feedback:  # a 1-D mesh over every rank: attach_sharded takes it too
            given = init_device_mesh("cpu", (world_size,))
        net = model()
        for i in (0, 2, 4):
            fully_shard(net[i], mesh=given["shard"] if given.ndim == 2 else given)
        fully_shard(net, mesh=given["shard"] if given.ndim == 2 else given)
        opt = lowbit_strategy.Lion(net.parameters(), lr=1e-2)
        sync = lowbit_strategy.attach_sharded(net, [opt], cfg, mesh=given)
        group = mesh["shard"].size()
        members = list(range(world_size)) if shard == "world" else [r for r in range(world_size) if r // group == rank // group]
        for step in range(1, steps + 1):
            opt.zero_grad()
            loss(net, rank, step).backward()
            # the oracle: every member's gradient from a replica with the same weights
            full = [p.full_tensor().detach() for p in net.parameters()]
            grads = []
            for r in members:
                replica = model()
                with torch.no_grad():
                    for p, f in zip(replica.parameters(), full):
                        p.copy_(f)
                loss(replica, r, step).backward()
                grads.append([p.grad for p in replica.parameters()])
            params = list(net.parameters())
            first = 0
            for unit, m in enumerate((0, 2, 4), start=1):  # sharded_units: the root (no parameters) is unit 0
                n = len(list(net[m].parameters()))
                unit_grads = [gs[first : first + n] for gs in grads]
                nodes = world_size // PER_NODE if shard == "world" else 1
                inputs = _fsdp_inputs(unit_grads, group)
                if feedback and step == 1:
                    rows = nodes if nodes > 1 else group
                    errors[unit] = [torch.zeros(rows, inputs[0].numel() // group) for _ in members]
                ef = errors[unit] if feedback else None
                want = fsdp_reduce_scatter_reference(inputs, int(bits[3:]), nodes, True, unit, members, errors=ef)
                mine = want[members.index(rank)]
                offset = 0
                for p in params[first : first + n]:
                    c0 = -(-p.shape[0] // group)
                    numel_row = int(torch.tensor(p.shape[1:]).prod().item()) if p.dim() > 1 else 1
                    local = p.grad.to_local()
                    chunk = mine[offset : offset + c0 * numel_row].view(c0, *p.shape[1:])[: local.shape[0]]
                    assert torch.equal(local, chunk), (shard, step, unit, tuple(p.shape))
                    offset += c0 * numel_row
                first += n
            opt.step()
        # bytes: the reduce-scatter's formula per unit and step (the algorithm sends nothing at N = 1)
        unit_c = [sum(-(-p.shape[0] // group) * (p.numel() // p.shape[0]) for p in net[m].parameters()) for m in (0, 2, 4)]
        nodes = world_size // PER_NODE if shard == "world" else 1
        want_node = want_net = 0
        for c in unit_c:
            a, b = qrs.reduce_scatter_bytes(c, group, int(bits[3:]), 4, nodes)
            want_node, want_net = want_node + steps * a, want_net + steps * b
        if feedback:  # the buffers the sync checkpoints are the oracle's
            saved = sync.state_dict()["parts"]["fsdp_reduce_scatter"]["units"]
            assert saved[0]["error"] is None  # the root unit holds no parameters: never called
            for unit in (1, 2, 3):
                assert torch.equal(saved[unit]["error"], errors[unit][rank]), unit
        else:
            assert "parts" not in sync.state_dict()
        logs = sync.traffic_logs()
        if shard == "world":
            assert sum(log.node_bytes_sent for log in logs) == want_node
            assert sum(log.bytes_sent for log in logs) == want_net
        else:  # one hop inside the node: its bytes are the whole network count of the reduce-scatter
            assert sync.node_traffic.bytes_sent == want_net
        sync.detach()


@pytest.mark.slow
def test_inside_fsdp2_each_gradient_shard_equals_the_oracle_and_bytes_the_formula():
    run_ranks(WORLD, _check_inside_fsdp)
