"""The outer sync's exchange: the mean of the workers' pseudo-gradients, compressed.

One :class:`Exchange` per fragment. Its input is this worker's pseudo-gradient Δ of the
whole fragment (float32, global − local weights); under the run's
:class:`~lowbit_strategy.collectives.shards.ShardSpec` this rank sends its part of it (the
whole of it in the flat and the sharded forms, shard j of the node's identical Δ for local
rank j in the hierarchical form) over the spec's group of workers, and the spec restores
the whole mean (the node's all-gather). Every compression is an existing codec and
collective, not a copy:

* ``fp32`` — DDP's exact mean (:func:`~lowbit_strategy.collectives.exact.mean_allreduce_async`);
* ``bf16`` — the sum of bf16 values, as DDP's ``bf16_compress_hook`` sends it (rounded to
  bf16, divided by P, summed in bf16);
* ``int8`` / ``int4`` / ``int2`` — :mod:`~lowbit_strategy.codecs.blockwise` codes of blocks
  of 256 with one float32 scale, all-gathered; every rank decodes every row and sums them in
  :func:`~lowbit_strategy.codecs.reduce.rank_sum`'s fixed order (the same bits everywhere);
  2 bits round stochastically with a dither salted by (fragment, round, rank);
* ``sign`` — the error-compensated 1-bit allreduce of 1-bit Adam
  (:mod:`~lowbit_strategy.collectives.compensated`, 1-bit LAMB Algorithm 1), scales per
  block of 32,768;
* ``turboquant`` — TurboQuant's 4-bit all-gather mean
  (:mod:`~lowbit_strategy.collectives.turboquant.allgather`);
* ``bitdp`` — BitDP's 2-bit channel codes (Eq. 7-9) over rows of 256 elements, all-gathered
  (:func:`~lowbit_strategy.collectives.gathered.gathered_mean_async`).

Error feedback (``error_feedback``): the worker adds last round's error ``e`` to Δ, sends
``u = Δ + e`` compressed and keeps ``e ← u − decode(encode(u))`` (the compensated allreduce
keeps its worker and server errors itself; without error feedback it gets zero buffers
every round). The all-gather forms are one collective each: launched when the round ends,
waited for ``delay`` steps later. ``sign`` is two-phase: :meth:`Landing.advance` (called
after every inner step in between) launches its second phase.
"""

from __future__ import annotations

import torch

from lowbit_strategy.codecs import blockwise
from lowbit_strategy.codecs.channel import channel_decode, channel_encode
from lowbit_strategy.codecs.reduce import divide, nonfinite_flag, rank_sum
from lowbit_strategy.codecs.turboquant import TurboQuantCodec
from lowbit_strategy.collectives import exact, gathered
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives.compensated import compensated_allreduce_start, server_chunk_length
from lowbit_strategy.collectives.shards import ShardSpec
from lowbit_strategy.collectives.turboquant.allgather import turboquant_allgather_mean_start
from lowbit_strategy.collectives.wire import TrafficLog

__all__ = ["ALIGN", "Exchange", "Landing", "SIGN_BLOCK", "BITDP_ROW", "payload_bytes", "salt"]

#: the parts' unit: a multiple of every codec's block (256), so blocks never straddle parts
ALIGN = 1024
#: elements per 1-bit scale of ``sign`` (1-bit Adam's default ``scale_block``)
SIGN_BLOCK = 32768
#: BitDP's channel rows: the pseudo-gradient part viewed as rows of this many elements
BITDP_ROW = 256
#: the ``turboquant`` codec: 4 bits, the rotation's seed fixed (the same on every rank)
TURBOQUANT_BITS = 4
_BLOCKWISE = {"int8": 8, "int4": 4, "int2": 2}


def salt(fragment: int, round_: int, rank: int) -> int:
    """The 2-bit dither's salt of one worker's codes in one round of one fragment."""
    return (fragment * 0x10001 + round_ * 0x2545F491 + rank * 0x9E37) & 0xFFFFFFFF


def payload_bytes(compression: str, m: int, workers: int) -> int:
    """Bytes one worker sends across nodes to exchange an ``m``-element part, by the wire's
    formulas (:mod:`~lowbit_strategy.collectives.wire`): what :class:`Exchange` records."""
    from lowbit_strategy.collectives import wire

    p = workers
    if p == 1:
        return 0
    if compression == "fp32":
        return wire.allreduce_bytes(4 * m, p)
    if compression == "bf16":
        return wire.allreduce_bytes(2 * m, p)
    if compression in _BLOCKWISE:
        codes, scales = blockwise.row_bytes(m, _BLOCKWISE[compression])
        return wire.all_gather_bytes(codes, p) + wire.all_gather_bytes(scales, p)
    if compression == "sign":
        c = server_chunk_length(m, p) // 8  # bytes of one chunk's signs
        nb = -(-8 * c // SIGN_BLOCK)
        return 2 * wire.all_to_all_bytes(c, p) + 2 * wire.all_to_all_bytes(4 * nb, p)
    if compression == "turboquant":
        codec = TurboQuantCodec(bits=TURBOQUANT_BITS)  # packed level indices, one scale per block
        codes = -(-m * codec.lane_bits // 8)
        return wire.all_gather_bytes(codes, p) + wire.all_gather_bytes(4 * -(-m // codec.block), p)
    if compression == "bitdp":
        rows = -(-m // BITDP_ROW)
        return wire.all_gather_bytes(rows * BITDP_ROW * 2 // 8, p) + wire.all_gather_bytes(4 * rows, p)
    raise ValueError(f"unknown compression {compression!r}")


class Landing:
    """One exchange in flight: :meth:`advance` launches a later phase (two-phase codecs),
    :meth:`wait` returns the whole fragment's mean pseudo-gradient (float32, ``n`` elements)
    and whether any worker's was non-finite (the same verdict on every rank)."""

    def __init__(self, exchange: Exchange, pending):
        self._exchange, self._pending = exchange, pending  # its wait() returns this rank's part of the mean
        self._advanced = False

    def advance(self) -> None:
        if not self._advanced and hasattr(self._pending, "gather"):
            self._pending = self._pending.gather()
        self._advanced = True

    def wait(self) -> tuple[torch.Tensor, bool, float]:
        """``(mean, any worker non-finite, the mean's L2 norm)``: one host read for both figures."""
        self.advance()
        part = self._pending.wait()
        ex = self._exchange
        flag = nonfinite_flag(part)
        full, bad = ex.spec.restore_async(part, ex.n, ex.traffic, flag, ALIGN).wait()
        assert bad is not None  # (a flag given comes back)
        verdict, norm = torch.stack([bad.to(torch.float32), full.norm().to(torch.float32)]).tolist()
        return full, ex.spec.agree(bool(verdict)), norm


class Exchange:
    """One fragment's compressed mean over ``spec`` (module docstring); holds its error buffers."""

    def __init__(
        self,
        compression: str,
        error_feedback: bool,
        n: int,
        spec: ShardSpec,
        device: torch.device,
        traffic: TrafficLog,
        fragment: int = 0,
    ):
        self.compression, self.error_feedback, self.n, self.spec = compression, error_feedback, n, spec
        self.traffic, self.fragment = traffic, fragment
        self.lo, self.hi = spec.part(n, ALIGN)
        self.m = max(self.hi - self.lo, 1)  # an empty part still takes part (one zero element)
        self.workers = spec.world_size
        self.device = device
        self.worker_error: torch.Tensor | None = None
        self.server_error: torch.Tensor | None = None
        self._codec = TurboQuantCodec(bits=TURBOQUANT_BITS) if compression == "turboquant" else None
        self.reset_errors()

    def reset_errors(self) -> None:
        """Zero error buffers (a new run, or a restart at another number of workers)."""
        sign, dev = self.compression == "sign", self.device
        self.worker_error = (
            torch.zeros(self.m, dtype=torch.float32, device=dev) if self.error_feedback or sign else None
        )
        self.server_error = (
            torch.zeros(server_chunk_length(self.m, self.workers), dtype=torch.float32, device=dev) if sign else None
        )

    # ---- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict:
        take = lambda t: None if t is None else t.detach().cpu().clone()  # noqa: E731
        return {"worker_error": take(self.worker_error), "server_error": take(self.server_error)}

    def load_state_dict(self, state: dict) -> None:
        for name in ("worker_error", "server_error"):
            mine, saved = getattr(self, name), state.get(name)
            if mine is not None and saved is not None:
                if saved.shape != mine.shape:
                    raise ValueError(
                        f"DiLoCo {name} of fragment {self.fragment}: {tuple(saved.shape)} saved, "
                        f"{tuple(mine.shape)} here"
                    )
                mine.copy_(saved)

    # ---- the exchange -----------------------------------------------------------------
    def start(self, delta: torch.Tensor, round_: int) -> Landing:
        """Launch the mean of this worker's ``delta`` (float32, ``n`` elements)."""
        x = delta[self.lo : self.hi] if self.hi > self.lo else delta.new_zeros(1)
        x = x.to(self.device, torch.float32).contiguous()
        if self.workers == 1:  # one worker: nothing crosses, the mean is its own (uncompressed)
            return Landing(self, g.Pending((), x.clone))
        group, p, comp = self.spec.group, self.workers, self.compression
        if comp == "fp32":
            buf = x.clone()
            fut = exact.mean_allreduce_async(buf, group, "diloco.fp32", self.traffic)
            return Landing(self, g.Pending(fut, lambda: buf))
        if comp == "sign":
            if not self.error_feedback:  # the collective needs buffers: fresh ones, nothing carried
                self.reset_errors()
            assert self.worker_error is not None and self.server_error is not None
            pending = compensated_allreduce_start(
                x, self.worker_error, self.server_error, group, traffic=self.traffic, block=SIGN_BLOCK
            )
            return Landing(self, pending)
        if comp == "turboquant":
            assert self._codec is not None
            gathered_tq = turboquant_allgather_mean_start(
                x,
                self._codec,
                group,
                worker_error=self.worker_error if self.error_feedback else None,
                traffic=self.traffic,
            )
            return Landing(self, gathered_tq)
        u = x + self.worker_error if self.error_feedback and self.worker_error is not None else x
        if comp == "bf16":
            w = u.to(torch.bfloat16)
            self._keep_error(u, w.float())
            w.div_(p)
            fut = g.all_reduce_sum_async(w, group, "diloco.bf16", self.traffic)
            return Landing(self, g.Pending(fut, w.float))
        if comp in _BLOCKWISE:
            bits = _BLOCKWISE[comp]
            codes, scales = blockwise.encode(u.view(1, -1), bits, salt=salt(self.fragment, round_, g.rank(group)))
            self._keep_error(u, blockwise.decode(codes, scales, bits, self.m)[0])
            all_codes = torch.empty(p * codes.numel(), dtype=codes.dtype, device=codes.device)
            all_scales = torch.empty(p * scales.numel(), dtype=scales.dtype, device=scales.device)
            fc = g.all_gather_async(all_codes, codes.view(-1), group, "diloco.codes", self.traffic)
            fs = g.all_gather_async(all_scales, scales.view(-1), group, "diloco.scales", self.traffic)

            def decode():
                rows = blockwise.decode(all_codes.view(p, -1), all_scales.view(p, -1), bits, self.m)
                return divide(rank_sum(rows), p)

            return Landing(self, g.Pending((fc, fs), decode))
        if comp == "bitdp":
            rows = -(-self.m // BITDP_ROW)
            mat = torch.zeros(rows * BITDP_ROW, dtype=torch.float32, device=u.device)
            mat[: self.m] = u
            mat = mat.view(rows, BITDP_ROW)
            if self.error_feedback:
                c, s = channel_encode(mat, 2, validate=False)
                self._keep_error(u, channel_decode(c, s, 2).reshape(-1)[: self.m])
            layout, words, scl = gathered.encode([mat], 2)
            fut = gathered.gathered_mean_async(words, scl, layout, group, traffic=self.traffic)
            return Landing(self, g.Pending(fut, lambda: fut.value().reshape(-1)[: self.m]))
        raise ValueError(f"unknown compression {comp!r}")

    def _keep_error(self, u: torch.Tensor, sent: torch.Tensor) -> None:
        """``e ← u − sent`` where finite (a non-finite round must not poison later ones)."""
        if self.error_feedback and self.worker_error is not None:
            missed = u - sent
            self.worker_error.copy_(torch.where(torch.isfinite(missed), missed, torch.zeros_like(missed)))
