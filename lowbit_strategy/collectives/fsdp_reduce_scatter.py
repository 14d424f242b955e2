"""A quantized reduce-scatter for FSDP2 (``FSDPModule.set_custom_reduce_scatter``): for an FSDP
group that spans nodes, where every reduce-scatter crosses the slow link.

What FSDP2 hands it (torch 2.13, ``_fsdp_collectives.foreach_reduce``): ``input_tensor`` is the
unit's padded gradients, 1-D, read as ``(W, c)``: row ``r`` is the chunk rank ``r`` keeps;
``output_tensor`` (``c`` elements) receives this rank's reduced chunk. The call passes no
``async_op`` and discards the return value, inside FSDP's reduce-scatter stream context: the
result must be written (or ordered on the current stream) when it returns, so every
collective here is waited on before. ``op`` is ``AVG`` (fp32/bf16 reduce dtypes), or ``SUM``
with FSDP dividing around it (fp16, ``set_force_sum_reduction_for_comms(True)``);
``PREMUL_SUM`` (``set_gradient_divide_factor``) is refused, naming the setting.

One hop (the group inside one node, or a flat topology): each row is quantized in blocks
(:mod:`lowbit_strategy.codecs.blockwise`: symmetric, one float32 scale per 256 elements,
stochastic rounding at 2 bits) and exchanged with ``all_to_all_single`` (codes, then scales);
every rank dequantizes the ``W`` rows it receives and sums them in float32 (``rank_sum``'s order),
its own row exact (it never crosses the wire). Bytes sent per rank:
``(W-1)·(code bytes + scale bytes)`` of one row.

Two hops when the group is the world and it spans ``N`` nodes of ``L`` ranks (ZeRO++'s qgZ,
"ZeRO++: Extremely Efficient Collective Communication for Giant Model Training",
arXiv:2306.10209, Sec. 4.3: hierarchical all-to-all):

1. inside the node, exact: local rank ``j`` gathers, from each peer of its node, the ``N``
   rows destined for ranks ``m·L + j`` (``m`` = every node), by an all-to-all in the reduce
   dtype, and sums them in float32: the node's partial sums of those ``N`` rows;
2. across nodes, quantized: the one-hop exchange above over the cross-node group ``j``
   (local rank ``j`` of every node, ``N`` ranks) on those ``N`` rows.

So a node's link carries ``L·(N-1)`` quantized rows of ``c`` elements, one payload per node,
instead of the ``L·L·(N-1)`` rows a flat all-to-all sends across nodes: ``L×`` fewer, on
top of the codec's ``32/b``. Intra-node bytes are recorded with scope ``node``.

Error feedback (``LowBitConfig.fsdp_error_feedback``, off by default): each rank adds what the
codes of its previous call missed to the rows it quantizes (as 1-bit Adam's error buffers do).
It costs a float32 buffer per unit of the rows this rank quantizes, kept across steps and in
every checkpoint (rank-local state): ``P·c`` elements for one hop, the size of the unsharded
unit, ``N·c`` (``1/L`` of it) for two hops; summed over units, the whole model's parameters in
fp32 per rank for one hop (4 bytes per parameter, on a rank that holds ``1/P`` of them) and
``1/L`` of that for two hops. And one more decode per call. Without it the error does not
accumulate either way: the rounding is unbiased at 2 bits (stochastic), and 8 and 4 bits
round to nearest, off by at most half a step, ``max|x| / (2Q)`` per block.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from lowbit_strategy import _moved
from lowbit_strategy.codecs import blockwise
from lowbit_strategy.codecs.reduce import rank_sum
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives import wire

try:  # torch >= 2.8: FSDP2's comm interface (the call signature is all FSDP relies on)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _Base
except ImportError:  # pragma: no cover - older torch: duck-typed, no set_custom_reduce_scatter anyway
    _Base = object  # type: ignore[assignment,misc]

__all__ = ["BITS", "Hops", "QuantizedReduceScatter", "UnitErrors", "reduce_scatter_bytes"]

#: LowBitConfig.fsdp_reduce_scatter -> code bits
BITS = {"int8": 8, "int4": 4, "int2": 2}


class Hops(NamedTuple):
    """The two-hop form's groups and shape (module docstring): ``intra``, this rank's node
    group (exact all-to-all of partial sums); ``inter``, its cross-node group (the quantized
    exchange); ``nodes`` N and ``ranks_per_node`` L, with ranks numbered node by node."""

    intra: Any
    inter: Any
    nodes: int
    ranks_per_node: int


def sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """Float32 sum of a ``(P, c)`` tensor's rows in :func:`~lowbit_strategy.codecs.reduce.rank_sum`'s
    fixed pairwise order (the same bits on every device, log2 P kernels). Callers pass rows
    they own: with one row the result is a view of it."""
    return rank_sum(rows.to(torch.float32))


def salt(unit: int, rank: int) -> int:
    """The dither salt of unit ``unit`` (its index in module order) on global rank ``rank``."""
    return (unit * 0x10001 + rank * 0x9E37) & 0xFFFFFFFF


def encode_rows(
    rows: torch.Tensor, me: int, bits: int, salt: int, error: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise codes and scales of ``rows`` (row ``me`` is this rank's own: sent, never read).
    ``error`` (float32, the rows' shape, or None): error feedback, updated in place: the rows
    quantized are ``rows + error`` and ``error`` becomes what their codes missed (0 in row
    ``me`` and in a block that was not finite, so a NaN step cannot poison later ones)."""
    if error is None:
        return blockwise.encode(rows, bits, salt=salt)
    x = rows.to(torch.float32) + error
    codes, scales = blockwise.encode(x, bits, salt=salt)
    missed = x - blockwise.decode(codes, scales, bits, rows.shape[1])
    missed[me] = 0
    error.copy_(torch.where(torch.isfinite(missed), missed, torch.zeros_like(missed)))
    return codes, scales


def exchange_sum(
    rows: torch.Tensor,
    group,
    op: str,
    traffic: wire.TrafficLog | None,
    bits: int | None = None,
    salt: int = 0,
    error: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row ``r`` of ``(P, c)`` ``rows`` goes to rank ``r`` of ``group``; returns the float32 sum,
    in rank_sum's order, of the rows this rank receives (its own row exact). ``bits`` None: the rows
    travel in their dtype; else blockwise codes and scales (``error``: :func:`encode_rows`)."""
    p, c = rows.shape
    me = g.rank(group)
    if bits is None:
        recv = torch.empty_like(rows)
        g.all_to_all_async(recv.view(-1), rows.contiguous().view(-1), group, op, traffic).wait()
        return sum_rows(recv)
    codes, scales = encode_rows(rows, me, bits, salt, error)
    codes_in, scales_in = torch.empty_like(codes), torch.empty_like(scales)
    fc = g.all_to_all_async(codes_in.view(-1), codes.view(-1), group, op + ".codes", traffic)
    fs = g.all_to_all_async(scales_in.view(-1), scales.view(-1), group, op + ".scales", traffic)
    fc.wait()
    fs.wait()
    got = blockwise.decode(codes_in, scales_in, bits, c)
    got[me] = rows[me]
    return sum_rows(got)


class QuantizedReduceScatter(_Base):
    """One FSDP unit's reduce-scatter (module docstring). ``bits``: 8, 4 or 2. ``hops``: None
    for one hop over FSDP's group, or a :class:`Hops` for the two-hop form (FSDP's group is
    then the world; a plain 4-tuple in that order is read as one). ``salt``: :func:`salt`'s value for this unit and
    rank. Bytes go to ``traffic``. ``error_feedback``: keep, per rank, what the codes of the
    rows it quantized missed and add it to the next call's rows (:attr:`error`, float32, made at
    the first call: ``(P, c)`` for one hop, ``(N, c)`` for two)."""

    def __init__(
        self,
        bits: int,
        *,
        hops: Hops | tuple[Any, Any, int, int] | None,
        salt: int,
        traffic: wire.TrafficLog,
        error_feedback: bool = False,
    ) -> None:
        self.bits, self.salt, self.traffic = bits, salt, traffic
        self.hops = None if hops is None else Hops(*hops)
        self.error_feedback = error_feedback
        self.error: torch.Tensor | None = None

    def _error(self, rows: torch.Tensor) -> torch.Tensor | None:
        if not self.error_feedback:
            return None
        if self.error is None or self.error.shape != rows.shape:
            self.error = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        elif self.error.device != rows.device:  # loaded from a checkpoint (CPU)
            self.error = self.error.to(rows.device)
        return self.error

    def state_dict(self) -> dict:
        """This rank's error-feedback buffer (CPU), or None."""
        return {"error": None if self.error is None else self.error.detach().cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        self.error = state.get("error")

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False) -> None:
        w = g.world_size(group)
        rows = input_tensor.view(w, -1)
        if self.hops is None:
            total = exchange_sum(rows, group, "fsdp_rs", self.traffic, self.bits, self.salt, self._error(rows))
        else:
            intra, inter, nodes, per_node = self.hops.intra, self.hops.inter, self.hops.nodes, self.hops.ranks_per_node
            c = rows.shape[1]
            # local peer j gets the rows of destinations m*L + j, m = 0..N-1
            to_peers = rows.view(nodes, per_node, c).transpose(0, 1).reshape(per_node, nodes * c)
            partial = exchange_sum(to_peers, intra, "fsdp_rs.node", self.traffic)
            sums = partial.view(nodes, c)
            total = exchange_sum(sums, inter, "fsdp_rs", self.traffic, self.bits, self.salt, self._error(sums))
        if _is(op, dist.ReduceOp.AVG):
            total.div_(w)
        elif not _is(op, dist.ReduceOp.SUM):
            raise ValueError(
                f"LowBitConfig.fsdp_reduce_scatter runs AVG or SUM reductions, FSDP asked for {op}: "
                "unset the unit's gradient divide factor (FSDPModule.set_gradient_divide_factor) or use "
                "fsdp_reduce_scatter='fp32'"
            )
        output_tensor.copy_(total)
        return None


class UnitErrors:
    """The error-feedback buffers of every unit's reduce-scatter, as one part of a sync's
    checkpointed state (``Sync.parts``): ``{"format": 1, "units": [...]}``, per unit in module
    order; a checkpoint of another number of units, or of a format this version does not read,
    is refused, naming both. (States written before the format key are format 1.)"""

    #: the state's layout version; a change to it adds a reader for the old one
    FORMAT = 1

    def __init__(self, comms: list[QuantizedReduceScatter]) -> None:
        self.comms = comms

    def state_dict(self) -> dict:
        return {"format": self.FORMAT, "units": [comm.state_dict() for comm in self.comms]}

    def load_state_dict(self, state: dict) -> None:
        version = state.get("format", 1)
        if version != self.FORMAT:
            raise ValueError(
                f"the checkpoint's fsdp_reduce_scatter error feedback has format {version!r}; this version reads "
                f"format {self.FORMAT}: resume with the lowbit-strategy version that wrote it, or set "
                "fsdp_error_feedback=False"
            )
        units = state.get("units", [])
        if len(units) != len(self.comms):
            raise ValueError(
                f"the checkpoint's fsdp_reduce_scatter error feedback holds {len(units)} units, the model has "
                f"{len(self.comms)}: resume the same model, or set fsdp_error_feedback=False"
            )
        for comm, unit in zip(self.comms, units):
            comm.load_state_dict(unit)


def _is(op: Any, kind: Any) -> bool:
    try:
        return bool(op == kind)
    except (TypeError, RuntimeError):  # a PREMUL_SUM _ReduceOp does not compare with the enum
        return False


def reduce_scatter_bytes(c: int, world: int, bits: int, element_size: int, nodes: int = 1) -> tuple[int, int]:
    """``(node bytes, network bytes)`` one rank sends for one call on a unit of ``c`` elements
    per rank: the formula the tests check the logged bytes against. ``nodes`` > 1: the
    two-hop form (``world / nodes`` ranks per node); 1: one hop, all counted as network."""
    if nodes == 1:
        code, scale = blockwise.row_bytes(c, bits)
        return 0, (world - 1) * (code + scale)
    per_node = world // nodes
    code, scale = blockwise.row_bytes(c, bits)
    return (per_node - 1) * nodes * c * element_size, (nodes - 1) * (code + scale)


#: the oracle moved to reference.py, beside the others
__getattr__ = _moved.attribute_aliases(
    __name__, {"reference": "lowbit_strategy.collectives.reference.fsdp_reduce_scatter_reference"}
)
