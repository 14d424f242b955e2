"""``TurboQuantLinear``: an ``nn.Linear`` that keeps its input for backward as 4-bit codes.

"TurboQuant-Adam" (its TurboQuantLinear part) shrinks the activation memory of training:
a linear layer needs its input ``x`` only for the weight gradient ``dW = gᵀ·x``, so instead
of keeping ``x`` until backward it keeps the TurboQuant code of ``x`` (rotated, scaled,
rounded to a Lloyd–Max level, :class:`~lowbit_strategy.codecs.TurboQuantCodec`) and
decodes it when backward needs it. The paper reports no loss gap at 70M parameters with
activations and Adam's momentum both compressed.

What is exact and what is not:

* **forward**: ``F.linear(x, weight, bias)``, the very call ``nn.Linear`` makes (same
  kernel, same dtypes): bit-identical output.
* **input gradient** ``g·W``: uses the weight, never the saved input: same as
  ``nn.Linear``'s.
* **bias gradient**: the sum of ``g`` over the leading dimensions: exact.
* **weight gradient** ``gᵀ·x̂``: from the decoded input ``x̂``; its error is ``gᵀ·(x̂ - x)``,
  with ``‖x̂ - x‖² ≈ D·‖x‖²`` (``D`` the codebook's MSE for N(0, 1): 0.0095 at 4 bits).

What is saved for backward (through ``ctx.save_for_backward``, so it lives only in the
autograd graph and is freed with it, and ``saved_tensors_hooks`` see it): the packed codes
(``bits/8`` bytes per element), one float32 scale per block, and the weight if the input
needs a gradient (``nn.Linear`` saves it too). Nothing of a step is stored on the module:
a module called twice before backward, under activation checkpointing, or by two threads,
keeps each call's codes in that call's graph. Under ``torch.no_grad()`` (or when neither
the input, the weight nor the bias needs a gradient) the layer is a plain ``F.linear`` and
saves nothing; with a frozen weight it does not keep the input at all.

**Rotation blocks.** The codec flattens the tensor and rotates and scales blocks of
``block`` consecutive elements, which in a row-major ``(..., in_features)`` input run
along the feature dimension. The default ``block`` is the largest power of two that
divides ``in_features``, capped at 1024 (the codec's default), so every block lies inside
one token's feature vector: each token gets its own scale(s), and an outlier token (large
activations at a few positions are common in transformers) cannot coarsen its neighbours'
codes; the result for a token does not depend on the rest of the batch. When that power of
two is below 64 (e.g. ``in_features`` odd), per-token blocks would cost too much in scales
(4 bytes per block) and mix too little, so the default falls back to blocks of 1024 over
the flattened input, which then span several tokens. ``block=`` overrides the rule.

Bytes kept per element, fp32 input: ``bits/8 + 4/block``: 4 bits, block 64 → 0.5625
(7.1× less than fp32), block 1024 → 0.504 (7.9×); for a bf16 input half of that ratio.

**Autocast.** Under ``torch.autocast`` ``nn.Linear`` runs in the autocast dtype (bf16 or
fp16 for ``linear`` on CPU and CUDA). The module does the same casts itself (input,
weight and bias to the autocast dtype, outside the autograd function, so their gradients
flow back to the fp32 parameters as they do for ``nn.Linear``) and runs the function with
autocast off: the output, its dtype and the gradients' dtypes match ``nn.Linear``'s; the
codes are of the bf16 input (the codec computes in float32 and decodes to the input's
dtype).

**Codec sharing.** Modules with equal ``(bits, block, seed)`` share one codec (one per
process), because the codec caches its rotation's signs per tensor length (one float32 per
element of each of the last 8 lengths it saw): shared, that is about one fp32 activation
per distinct input size in the whole model, not one per layer.
"""

from __future__ import annotations

import contextlib
import functools
from typing import overload

import torch
import torch.nn.functional as F
from torch import nn

from lowbit_strategy.codecs.hadamard import DEFAULT_BLOCK, MAX_SEED, check_rotation_block
from lowbit_strategy.codecs.lloyd_max import check_bits
from lowbit_strategy.codecs.turboquant import TurboQuantCodec, TurboQuantPayload
from lowbit_strategy.validation import check_int

#: smallest per-token block the default rule accepts (below it: blocks of DEFAULT_BLOCK)
MIN_ROW_BLOCK = 64

__all__ = ["TurboQuantLinear", "default_block", "shared_codec"]


def default_block(in_features: int) -> int:
    """The default rotation block for inputs of ``in_features`` features (module doc)."""
    p = in_features & -in_features if in_features > 0 else DEFAULT_BLOCK  # largest power of two dividing it
    p = min(p, DEFAULT_BLOCK)
    return p if p >= MIN_ROW_BLOCK else DEFAULT_BLOCK


@functools.cache
def check_layer_settings(who: str, bits: int, block: int | None, seed: int) -> None:
    """``bits``, ``block`` and ``seed`` as :class:`TurboQuantLinear` takes them, checked where
    they enter (a model without linear layers would never build one to check them)."""
    check_bits(who, bits, what=" (4 is the paper's)")
    if block is not None:
        try:
            check_rotation_block(block)
        except ValueError as e:
            raise ValueError(f"{who}: {e}; or pass block=None for the default rule") from None
    check_int(who, "seed", seed, 0, MAX_SEED)


def shared_codec(bits: int, block: int, seed: int) -> TurboQuantCodec:
    """The process's one codec for ``(bits, block, seed)`` (see "Codec sharing")."""
    return TurboQuantCodec(bits=bits, seed=seed, block=block)


# -- saved-tensor accounting (see lowbit_strategy.nn.memory) ---------------------------------
# The active SavedTensorMeters (usually none): each is told about every input compressed
# while it runs. The meter, not the module, holds what it is told, until it stops.
RECORDERS: list = []


def _record(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> None:
    for rec in RECORDERS:
        rec.add_compressed(codes, scales, x)


def _no_autocast(device_type: str):
    """Autocast off for ``device_type`` (backward may run inside an autocast region), or
    nothing for a device autocast does not know."""
    return torch.autocast(device_type, enabled=False) if device_type in ("cpu", "cuda") else contextlib.nullcontext()


@overload
def _autocast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...
@overload
def _autocast(t: None, dtype: torch.dtype) -> None: ...
def _autocast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Autocast's cast of one argument: floating tensors but float64 go to ``dtype``."""
    if t is None or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)


class _TurboQuantLinearFn(torch.autograd.Function):
    """``F.linear`` whose backward computes the weight gradient from the input's codes."""

    @staticmethod
    def forward(ctx, x, weight, bias, codec: TurboQuantCodec):
        out = F.linear(x, weight, bias)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.codec = codec
        ctx.in_shape = x.shape
        ctx.has_bias = bias is not None
        ctx.need_x = need_x
        if need_w:
            payload = codec.encode(x)
            ctx.meta = (payload.shape, payload.dtype, payload.numel)
            saved = [payload.codes, payload.scales]
            if RECORDERS:
                _record(payload.codes, payload.scales, x)
        else:
            ctx.meta = None
            saved = []
        if need_x:
            saved.append(weight)
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        codec: TurboQuantCodec = ctx.codec
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        with _no_autocast(grad_out.device.type):
            if ctx.need_x:
                weight = saved[-1]
                grad_x = g.mm(weight.to(g.dtype)).view(ctx.in_shape)
            if ctx.meta is not None:
                shape, dtype, numel = ctx.meta
                payload = TurboQuantPayload(saved[0], saved[1], shape, dtype, numel, codec.bits, codec.block)
                x_hat = codec.decode(payload).reshape(-1, shape[-1])
                grad_w = g.t().mm(x_hat.to(g.dtype))
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = g.sum(0)
        return grad_x, grad_w, grad_b, None


class TurboQuantLinear(nn.Linear):
    """``TurboQuantLinear(in_features, out_features, bias=True, bits=4, block=None, seed=0,
    device=None, dtype=None)``: ``nn.Linear`` whose input is kept for backward as TurboQuant
    codes (see the module doc for what is exact).

    A subclass of ``nn.Linear``: the same parameters (``weight``, ``bias``), state-dict keys
    and initialization, so checkpoints move freely between the two and code that looks for
    ``nn.Linear`` (parameter selection, weight decay groups) still finds it. ``bits``: 2..8
    (the codec's); ``block``: the rotation/scale block, a power of two, ``None`` for
    :func:`default_block`; ``seed``: the rotation's sign seed. :meth:`from_linear` converts
    an existing layer, keeping its Parameter objects.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        bits: int = 4,
        block: int | None = None,
        seed: int = 0,
        device=None,
        dtype=None,
    ) -> None:
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            why = " (its input is compressed for backward; use nn.Linear for an empty layer)"
            check_int("TurboQuantLinear", name, value, 1, what=why)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._configure(bits, block, seed)

    def _configure(self, bits: int, block: int | None, seed: int) -> None:
        check_layer_settings("TurboQuantLinear", bits, block, seed)
        self.bits, self.seed = bits, seed
        self.block = default_block(self.in_features) if block is None else block

    @property
    def codec(self) -> TurboQuantCodec:
        """The (process-shared) codec of this layer."""
        return shared_codec(self.bits, self.block, self.seed)

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int = 4, block: int | None = None, seed: int = 0) -> TurboQuantLinear:
        """A ``TurboQuantLinear`` computing what ``linear`` computes, with the *same*
        ``weight``/``bias`` Parameter objects (an optimizer built on ``linear``'s parameters,
        tied weights and DDP's parameter list stay valid) and the same hooks, buffers and
        training flag (a shallow copy of its attributes).

        ``linear`` must be exactly an ``nn.Linear``: a subclass may compute more than
        ``F.linear`` in its forward (or, like ``MultiheadAttention.out_proj``, never have it
        called), and a parametrized layer's weight is recomputed on every access."""
        if type(linear) is not nn.Linear:
            raise TypeError(
                f"TurboQuantLinear.from_linear: linear must be a torch.nn.Linear (not a subclass, whose forward "
                f"may do more than F.linear), got {type(linear).__name__}; "
                "convert such layers yourself or leave them out"
            )
        new = cls.__new__(cls)
        # shallow copy: the same Parameter objects, copied containers (so adding a hook or a
        # parameter to one module later does not change the other)
        new.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in linear.__dict__.items()})
        new._configure(bits, block, seed)
        return new

    def to_linear(self) -> nn.Linear:
        """The plain ``nn.Linear`` with the same Parameter objects (the inverse of
        :meth:`from_linear`)."""
        new = nn.Linear.__new__(nn.Linear)
        state = {
            k: (v.copy() if isinstance(v, dict) else v)
            for k, v in self.__dict__.items()
            if k not in ("bits", "block", "seed")
        }
        new.__dict__.update(state)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w: torch.Tensor = self.weight
        b: torch.Tensor | None = self.bias
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)
        )
        if not needs_grad:
            return F.linear(x, w, b)  # nothing to keep for a backward that will not come
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            # what autocast does to F.linear (a lower-precision op on CPU and CUDA), done here
            # so the function itself runs with autocast off and sees the dtypes it computes in
            dt = torch.get_autocast_dtype(device_type)
            x, w, b = _autocast(x, dt), _autocast(w, dt), _autocast(b, dt)
            with _no_autocast(device_type):
                return _TurboQuantLinearFn.apply(x, w, b, self.codec)
        return _TurboQuantLinearFn.apply(x, w, b, self.codec)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits={self.bits}, block={self.block}"
