"""BitDP as a DDP communication hook, usable from plain PyTorch DDP (BitDP Algorithm 1).

::

    state = BitDPState(bits=2).attach(model)          # learns which parameters to quantize
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(state, bitdp_hook)

For each DDP bucket the hook returns the mean gradient over ranks, in the bucket's dtype:

* weight matrices of linear layers (selection rule of Sec. 3.1.1, :mod:`.quantized_params`) are
  channel-quantized to 1 or 2 bits (Sec. 3.1.2, Eq. 5-9) and synchronized by the low-bit
  all-gather of :mod:`.collectives.gathered` (Sec. 3.2);
* every other gradient in the bucket (biases, norms, embeddings, ...) is averaged by one
  full-precision allreduce, launched at the same time — Algorithm 1's "AllReduce(g)/P" —
  in ``full_wire`` (``fp32`` by default; ``bf16`` as torch's ``bf16_compress_hook`` sends it).

**Splitting a bucket.** DDP flattens a bucket's gradients into one buffer, contiguously in
the order of ``bucket.parameters()``; ``bucket.gradients()`` are views into it (there is no
``offsets()`` in the GradBucket API of torch 2.13). Offsets are the running sum of the
parameters' sizes, cross-checked against the views' storage offsets. Each parameter is
looked up by identity (``id``) in the map :meth:`BitDPState.attach` built from the model's
modules — a Parameter object is what DDP hands us, so module types and names must be
learned beforehand. The resulting split (quantized matrices, merged full-precision runs) is
cached per bucket under ``(bucket.index(), bucket size)`` and re-derived whenever the
bucket's parameter list differs from the cached one (DDP rebuilds its buckets after
iteration 0, in gradient-ready order, so an index and size may come back with other contents).

**Warm-up.** The first ``start_iter`` (>= 2) iterations are a plain mean allreduce in
``warmup_wire``: ``bf16`` (the default of ``LowBitConfig.warmup_wire``) bit-identical to DDP
with torch's ``bf16_compress_hook``, ``fp32`` (this class's default) to DDP without a hook:
iteration 0 runs on DDP's provisional buckets, rebuilt after it (PowerSGD's reason for its
``start_powerSGD_iter > 1``), and the first steps are the most sensitive to gradient error,
so compression starts on the final buckets.

**Non-finite gradients.** Each rank sends, beside its scales, a flag saying whether its
bucket holds NaN/Inf (computed on the device: the hook launches its collectives and
returns without a host sync). Every rank reads every rank's flag from the gathered scales:
if any is raised, every rank fills the bucket's quantized matrices with NaN instead of
decoding them — the way an allreduce spreads a NaN — so AMP's GradScaler skips the step on
every rank, and a plain optimizer sees what plain DDP would give it. The full-precision
part is allreduced as usual. Costs 4 bytes per rank and bucket, no extra collective.

**Error feedback** (off by default; BitDP does not use it): each rank keeps, per quantized
parameter, the residual ``e = (g + e) - s ⊙ q`` of its own last encoding and adds it to the
next gradient before quantizing. Rank-local state; not touched by warm-up or flagged
steps.

**Forms** (``form``): ``allgather`` (the paper's: every rank's codes to every rank, the exact
mean of the dequantized gradients, :mod:`.collectives.gathered`), ``two_stage`` (codes
reduce-scattered at whole rows, each rank averages its chunk, re-encodes it with its own
server error feedback, all-gather: bytes flat in P, :mod:`.collectives.gathered_two_stage`),
or ``auto``: once per run, for the model's quantized matrices as one payload, by the α–β
cost model on ``link`` (:func:`~lowbit_strategy.pricing.flat.bitdp_form`: the
all-gather unless it is predicted at least twice as slow, so never at P <= 4). Once per run
rather than per bucket: DDP rebuilds its buckets after its first iteration, and again after
every restart, so a per-bucket choice could change across a resume. The two-stage form waits for its
first stage in the hook (a stream wait on NCCL, the transfer itself on gloo) before it
launches the second (in bucket order on every rank, never from a callback).

**Checkpoints.** :meth:`BitDPState.state_dict` holds the iteration count (so a resumed run
does not repeat the warm-up), this rank's residuals keyed by parameter name (ids do not
survive a restart) and, in the two-stage form, this rank's server errors (the rows of each
parameter it owns, by parameter name); :meth:`BitDPState.load_state_dict` restores them.
Both forms depend only on each parameter's own rows (the two-stage chunks are cut per
matrix), never on how DDP groups parameters into buckets, so a resume that restores this
state continues as the uninterrupted run did.
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook inspects the hook's
# annotations and accepts only the real objects dist.GradBucket / Future[Tensor], not strings.
import math

import torch
import torch.distributed as dist

from lowbit_strategy.algorithms.bitdp.state import BitDPState, BucketSplit
from lowbit_strategy.codecs.channel import channel_encode_many
from lowbit_strategy.codecs.reduce import nonfinite_flag
from lowbit_strategy.collectives import chain
from lowbit_strategy.collectives.exact import mean_allreduce_async, wire_dtype_of
from lowbit_strategy.collectives.gathered import PayloadLayout, gathered_mean_async, matrix_shape, pack_payload
from lowbit_strategy.collectives.gathered_two_stage import gathered_two_stage_start

__all__ = ["BitDPState", "BucketSplit", "bitdp_hook"]


def _encode(state: BitDPState, plan: BucketSplit, rows: list[torch.Tensor]):
    """``(codes, scales, residuals)`` of the bucket's quantized matrices (channel-major
    ``rows``), each (plus its residual, with error feedback) channel-encoded at ``state.bits``,
    equal widths at once (non-finite input: flagged, never decoded); ``residuals``: this step's
    new ones by parameter id, in the parameter's own layout (kept only if the step is applied)."""
    ms = []
    for (_, _, key), m in zip(plan.quantized, rows):
        r = state.residuals.get(key) if state.error_feedback else None  # in the parameter's layout
        ms.append(m if r is None else m.float() + (r.t() if key in plan.transposed else r).to(m.device))
    enc = channel_encode_many(ms, state.bits, decode=state.error_feedback, validate=False)
    residuals = {}
    for (_, _, key), m, (_, _, d) in zip(plan.quantized, ms, enc):
        if d is not None:
            e = m.float() - d.view(m.shape)
            residuals[key] = e.t().contiguous() if key in plan.transposed else e
    return [c for c, _, _ in enc], [s for _, s, _ in enc], residuals


def bitdp_hook(state: BitDPState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook running BitDP (Algorithm 1) on one bucket; returns a future
    resolving to the bucket buffer overwritten with the mean gradient over ranks.

    The returned future is chained (``then``) from the bucket's last collective, and reads
    the others only after their own ``wait()``: on NCCL that orders every read after its
    data. No host read: whether any rank's gradient was non-finite stays on the device."""
    if not state.params:
        raise RuntimeError(
            "BitDPState is not attached to a model: call state.attach(model) (or pass model=) "
            "before training, so BitDP knows which gradients are linear weights"
        )
    buf, group, traffic = bucket.buffer(), state.process_group, state.traffic
    plan = state.plan(bucket)  # also during warm-up: an unknown parameter fails at once
    warmup = state.iter < state.start_iter
    state.maybe_increase_iter(bucket)
    if warmup:
        return mean_allreduce_async(buf, group, "bitdp.warmup.allreduce", traffic, wire_dtype_of(state.warmup_wire))
    if not plan.quantized:
        return mean_allreduce_async(buf, group, "bitdp.full.allreduce", traffic, wire_dtype_of(state.full_wire))
    # this rank's NaN/Inf flag: device-side, sent beside the scales (no blocking agreement)
    nonfinite = nonfinite_flag(buf)
    mats = [buf[o : o + math.prod(s)].view(s) for o, s, _ in plan.quantized]
    # channel-major views: output features are rows (a Conv1D weight's columns)
    rows = [m.t() if key in plan.transposed else m for (_, _, key), m in zip(plan.quantized, mats)]
    codes, scales, residuals = _encode(state, plan, rows)
    layout = PayloadLayout.of([matrix_shape(m) for m in rows], state.bits)
    # Decode straight into the bucket when it is float32 and no matrix is transposed: the
    # local gradient is encoded already. Otherwise decode into a temporary and copy back.
    direct = buf.dtype == torch.float32 and not plan.transposed
    out = [m.view(-1) for m in mats] if direct else None
    two_stage = state.form_of() == "two_stage"
    if two_stage:  # stage 1 now; stage 2 after the full-precision launch, below
        err = state.server_error(plan, layout, buf.device)
        kw = dict(chunk_rows=state.chunk_rows, out=out, traffic=traffic, flag=nonfinite)
        handle = gathered_two_stage_start(codes, scales, layout, err, group, **kw)
    else:
        words, scl = pack_payload(codes, scales, layout)
        kw = dict(reduction=state.reduction, chunk_rows=state.chunk_rows, out=out, traffic=traffic, flag=nonfinite)
        f_q = gathered_mean_async(words, scl, layout, group, **kw)
    full = None
    if plan.full:  # Algorithm 1's AllReduce(g)/P in the bucket's dtype, or as torch's bf16_compress_hook
        fp = torch.cat([buf[o : o + n] for o, n in plan.full])
        wire = torch.bfloat16 if state.full_wire == "bf16" else fp.dtype
        full = (plan.full, fp, mean_allreduce_async(fp, group, "bitdp.full.allreduce", traffic, wire))
    if two_stage:  # waits for stage 1, runs this rank's server step, launches stage 2 (last)
        f_q = handle.gather()
    last = f_q if two_stage or full is None else full[2]  # the future of the last launch
    return chain.then(last, lambda _: _assemble(state, buf, rows, layout, residuals, f_q, full))


def _assemble(
    state: BitDPState, buf: torch.Tensor, rows, layout: PayloadLayout, residuals: dict, f_q, full
) -> torch.Tensor:
    """The bucket's mean gradient, written into ``buf``: the decoded quantized matrices and the
    full-precision runs ``full = (plan.full, their allreduced values, its future)``, each
    waited for here (one of them is the future this runs chained from).

    If any rank's gradient was non-finite every rank gets NaN in the quantized matrices (as
    an allreduce would spread it), so AMP's GradScaler skips the step everywhere, and this
    step's residuals are not kept: both by device-side masks, never a host read."""
    q, raised = f_q.wait()
    if isinstance(q, torch.Tensor):  # decoded into a float32 temporary: cast (and transpose) into the bucket
        for v, e, (r, c) in zip(rows, layout.elem_offsets, layout.shapes):
            v.copy_(q[e : e + r * c].view(v.shape))
    for v in rows:
        v.masked_fill_(raised, float("nan"))
    for key, e in residuals.items():
        old = state.residuals.get(key)
        state.residuals[key] = e.masked_fill_(raised, 0) if old is None else torch.where(raised, old.to(e.device), e)
    if full is not None:
        runs, fp, f_full = full
        f_full.wait()  # its own wait: its data is there
        start = 0
        for o, n in runs:
            buf[o : o + n].copy_(fp[start : start + n])
            start += n
    return buf
