"""TurboQuant codec: Hadamard rotation + Lloyd–Max levels, a few bits per element.

"TurboQuant-Adam" compresses a tensor by rotating it (:mod:`.hadamard`), which makes its
coordinates close to Gaussian, dividing by a scale, and rounding each coordinate to the
nearest level of the ``2**bits``-level Lloyd–Max codebook for N(0, 1)
(:mod:`.lloyd_max`). Decoding looks the levels up, multiplies by the scale and rotates
back. Pure: no process group, no host synchronization on the hot path.

::

    encode: y = H·D·x  (blocks of `block`)   z = y / s   code = bucketize(z, midpoints)   pack
    decode: unpack     level[code] · s       x̂ = D·H·(level · s)   reshape, cast

Choices (the paper's formulas for these steps did not survive; documented here):

* **Scale.** One float32 scale per *scale group*: ``block`` consecutive elements of the
  rotated vector (the last group partial; ``ceil(n / block)`` scales). By default each
  group's scale is its RMS ``sqrt(mean(y²))`` computed from the data, so a fresh codec is
  accurate at once (the rotated coordinates are ~N(0, RMS²), which is what the codebook is
  for). ``encode(x, scale=s)`` uses a given scale instead — a number, a 0-d/1-element
  tensor (one scale for every group, stored once) or ``ceil(n / block)`` values — which is
  how an optimizer keeping an EMA of the scale per bucket (as in the paper) drives it.
  A group whose scale is 0 is encoded as if its scale were 1 and decodes to zeros.
* **Clamping.** Values beyond the codebook's range (``|z|`` past the outer levels, e.g.
  with a given scale that is too small) get the outer levels: nothing overflows.
* **Ties.** The code is the number of midpoints strictly below ``z``
  (``torch.bucketize(z, midpoints)``, ``right=False``): a value exactly on a midpoint
  between levels ``i`` and ``i + 1`` gets level ``i`` (the lower one).
* **Packing.** Codes are ``bits.pack`` lanes in uint8: 2, 4 and 8 bits are tight (4 codes,
  2 codes, 1 code per byte); 3 bits use 4-bit lanes and 5–7 bits 8-bit lanes.
* **Dtypes.** Arithmetic is float32 (as in :mod:`.hadamard`); ``decode`` returns ``x``'s
  shape and dtype. Non-finite inputs give unspecified codes and a non-finite scale.
* **Rotation off.** ``rotate=False`` skips the rotation (the Lloyd–Max quantizer on the raw
  values, with the same scale groups): an ablation, not the paper's codec.

* **RMS order.** A reduction's rounding depends on its order, which differs between torch
  on CPU, torch on CUDA and a Triton kernel. So the RMS of a full group is defined by an
  explicit order every backend reproduces bit for bit:

  1. ``s = y · y`` per element, rounded to float32 (no fused multiply-add anywhere);
  2. fold in halves ``log2(block)`` times: with ``W`` the current width (``block`` first),
     ``s[i] = s[i] + s[i + W/2]`` for ``i < W/2`` (float32, one rounding per addition;
     ``a + b = b + a`` exactly, so which half is written does not matter);
  3. ``rms = sqrt(s[0] · (1/block))``: the multiply is exact (a power of two, unless the
     product is subnormal: the same float32 multiply on every backend), the square root
     correctly rounded to float32 (torch: in float64 and rounded once, since torch's float32
     ``sqrt`` on CPU can be one ulp off; Triton: ``sqrt_rn``).

  Ties and NaN need no rule of their own: every step is one IEEE operation on defined
  operands (squares are >= 0, so no -0.0 reaches the sum; a NaN or Inf input gives a NaN or
  Inf scale on both backends). Why halves: in torch each level is one add of two contiguous
  halves, in place (vectorized, no new tensor); the adjacent-pair tree this replaced (``s[i]
  = s[2i] + s[2i + 1]``) read stride-2 views into a fresh tensor per level. Scales computed
  by the two rules differ in the last bits (both are float32 sums of the same squares).
  The partial last group uses ``vector_norm(y) / sqrt(len)`` (torch on every backend).

``backend``:

* ``"torch"``: torch operations (:mod:`.turboquant_torch`), on any device.
* ``"triton"``: fused encode and decode kernels (:mod:`.turboquant_triton`; one pass over
  memory each way instead of ~15), bit-exact against ``"torch"`` (same code bytes, same
  decoded bits); the tail past the last full block, and blocks above 8192 elements, run the
  torch code. Needs ``triton`` (``pip install "lowbit-strategy[triton]"``) and CUDA tensors,
  or CPU tensors with ``TRITON_INTERPRET=1`` set before the first Triton use (slow: tests).
* ``"auto"`` (default): ``"triton"`` for CUDA tensors when triton is installed, otherwise
  ``"torch"``. Decided per call from the tensor's device, so one codec serves CPU and GPU.
  Measured on an H100 (torch 2.11, Triton 3.6; ``python -m benchmarks.gpu_check``, part 2):
  at 2^26 float32 elements the Triton encode takes 0.46 ms (580 GB/s of input) against
  torch's 9.3 ms, the decode 0.26 ms against 4.9 ms.

The backends agree bit for bit on one device type, so ranks may mix them there (a payload
encoded by one decodes identically by the other).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit_strategy.codecs import turboquant_torch
from lowbit_strategy.codecs.bits import unpack
from lowbit_strategy.codecs.device_cache import grown, ready, remember, to_device
from lowbit_strategy.codecs.hadamard import DEFAULT_BLOCK, check_rotation_block, check_seed, hadamard_signs
from lowbit_strategy.codecs.lloyd_max import check_bits, lloyd_max_codebook

#: accepted values of ``backend``
BACKENDS = ("auto", "torch", "triton")

#: dtypes accepted as input
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: blocks above this many elements always use the torch code (the kernels hold a block in
#: registers); the same value as ``turboquant_triton.MAX_FUSED_BLOCK``
_MAX_FUSED_BLOCK = 8192


def triton_module():
    """:mod:`.turboquant_triton`, imported on first use (it imports triton, which is optional
    and slow to import)."""
    from lowbit_strategy.codecs import turboquant_triton

    return turboquant_triton


def _triton_available() -> bool:
    """Whether the Triton kernels can run on CUDA tensors: triton imports, and the kernels
    were not built for the CPU interpreter (``TRITON_INTERPRET=1``). Does not import
    triton when it is absent."""
    global _TRITON_OK
    if _TRITON_OK is None:
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            _TRITON_OK = False
        else:
            tt = triton_module()
            _TRITON_OK = tt.AVAILABLE and not tt.INTERPRETED
    return _TRITON_OK


_TRITON_OK: bool | None = None


def _lane_bits(bits: int) -> int:
    return 2 if bits == 2 else 4 if bits <= 4 else 8


@dataclass(frozen=True)
class TurboQuantPayload:
    """An encoded tensor.

    ``codes``: uint8, the packed level indices (``lane(lane_bits).words_for(numel)`` bytes);
    ``scales``: float32, ``ceil(numel / block)`` values or 1 (one shared scale);
    ``shape``/``dtype``/``numel``: of the original tensor; ``bits``/``block``: the codec's.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    numel: int
    bits: int
    block: int

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the codes and the scales."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4


class TurboQuantCodec:
    """``TurboQuantCodec(bits=4, seed=0, block=1024, backend="auto", rotate=True)``.

    ``bits``: 2..8; ``seed``: the rotation's sign seed (the same on every rank);
    ``block``: a power of two, the rotation block and the scale group; see the module
    docstring for the rules. ``encode(x, scale=None)`` → :class:`TurboQuantPayload`,
    ``decode(payload)`` → a tensor shaped and typed like ``x``.
    """

    def __init__(
        self,
        bits: int = 4,
        seed: int = 0,
        block: int = DEFAULT_BLOCK,
        backend: str = "auto",
        *,
        rotate: bool = True,
    ) -> None:
        check_bits("TurboQuantCodec", bits)
        check_seed(seed)  # an int in [0, 2**63 - 1]: checked here, not at the first encode
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.bits = bits
        self.seed = seed
        self.block = check_rotation_block(block)
        self.backend = backend
        self.rotate = bool(rotate)
        self.lane_bits = _lane_bits(bits)
        self._levels = lloyd_max_codebook(bits)
        self._midpoints = (self._levels[:-1] + self._levels[1:]) / 2
        self._device_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        #: per device, the rotation's sign stream (float ±1) and its packed bits (Triton):
        #: the signs of n elements are its first n (see :meth:`signs`)
        self._signs: dict[torch.device, torch.Tensor] = {}
        self._sign_bits: dict[torch.device, torch.Tensor] = {}
        #: per (device, n, m): the float signs of a call's tail; per (device, m, rows, "rows"): a row call's bits
        self._sign_tails: dict[tuple, torch.Tensor] = {}
        if backend == "triton":
            triton_module()._require()  # fail at construction, naming the fix

    def __repr__(self) -> str:
        return (
            f"TurboQuantCodec(bits={self.bits}, seed={self.seed}, block={self.block}, "
            f"backend={self.backend!r}, rotate={self.rotate})"
        )

    @property
    def levels(self) -> torch.Tensor:
        """The codebook (a copy): ``2**bits`` ascending float32 levels for N(0, 1)."""
        return self._levels.clone()

    # -- helpers ---------------------------------------------------------------------------

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._device_tables.get(device)
        if t is None:
            t = self._device_tables[device] = (to_device(self._levels, device), to_device(self._midpoints, device))
        return ready(t[0]), ready(t[1])

    def signs(self, n: int, device: torch.device) -> torch.Tensor:
        """The rotation's ±1 signs for ``n`` elements, as float32 on ``device``.

        The signs of ``n`` elements are the first ``n`` of one stream per seed
        (:func:`.hadamard.hadamard_signs` draws them in order), so the codec keeps one stream
        per device, as long as the longest tensor it has encoded (grown at least 2x at a
        time), and every bucket and every length is a slice of it: no drawing on the CPU and
        no copy to the GPU per bucket and step, however many buckets or sequence lengths."""
        return grown(self._signs, torch.device(device), n, lambda length: hadamard_signs(length, self.seed))[:n]

    def _groups(self, n: int) -> int:
        return -(-n // self.block)

    def _check_scale(self, scale, n: int, device: torch.device, groups: int | None = None) -> torch.Tensor:
        """``scale`` as a fresh float32 tensor of 1 or ``groups`` (default ``ceil(n / block)``) values."""
        groups = self._groups(n) if groups is None else groups
        if isinstance(scale, torch.Tensor):
            s = scale.detach().to(device=device, dtype=torch.float32).reshape(-1)
        elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
            s = torch.full((1,), float(scale), dtype=torch.float32, device=device)  # a fill: no host copy on CUDA
        else:
            raise TypeError(f"scale must be a number or a tensor, got {type(scale).__name__}")
        if s.numel() not in (1, groups):
            raise ValueError(f"scale must hold 1 or ceil(n / block) = {groups} values, got {s.numel()}")
        return s.clone()

    def _use_triton(self, device: torch.device) -> bool:
        """Whether this call runs the Triton kernels (see ``backend`` in the module docstring)."""
        if self.backend == "torch" or self.block > _MAX_FUSED_BLOCK:
            return False
        if self.backend == "auto":
            return device.type == "cuda" and _triton_available()
        tt = triton_module()
        tt.check_device(device)
        return True

    def _triton_signs(self, n: int, m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation's signs for ``n`` elements as the kernels read them (packed bits, see
        :func:`.turboquant_triton.sign_bits`: a prefix of this device's bit stream, the
        kernels read the first ``m``) and, as float ±1, those of elements ``m:`` that the
        torch code handles, unpacked on the device from the same bits (fewer than a block):
        no float signs of all ``n`` elements on the device."""
        device = torch.device(device)
        bits = grown(
            self._sign_bits, device, n, lambda length: triton_module().sign_bits(hadamard_signs(length, self.seed))
        )
        lo = m // 8

        def tail() -> torch.Tensor:  # bit 1: negative
            return unpack(bits[lo : -(-n // 8)], 1, n - 8 * lo)[m - 8 * lo :].to(torch.float32).mul_(-2.0).add_(1.0)

        # the same signs every call for (n, m): kept, not unpacked again (4 launches per codec call)
        return bits, remember(self._sign_tails, (device, n, m), tail)

    def _row_sign_bits(self, m: int, rows: int, device: torch.device) -> torch.Tensor:
        """The packed signs of ``rows`` payloads of ``m`` elements laid end to end (each row the
        stream's first ``m``): what the row kernels read, kept per ``(m, rows)``."""
        device = torch.device(device)
        return remember(
            self._sign_tails,
            (device, m, rows, "rows"),
            lambda: self._triton_signs(m, m, device)[0][: m // 8].repeat(rows),
        )

    def _encode_torch(self, v: torch.Tensor, signs, scale, *, owned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`.turboquant_torch.encode` with this codec's settings."""
        return turboquant_torch.encode(
            v,
            signs,
            scale,
            block=self.block,
            midpoints=self._tables(v.device)[1],
            bits=self.bits,
            lane_bits=self.lane_bits,
            owned=owned,
        )

    def _decode_torch(self, idx: torch.Tensor, scales: torch.Tensor, signs) -> torch.Tensor:
        """:func:`.turboquant_torch.decode` with this codec's settings."""
        return turboquant_torch.decode(idx, scales, signs, block=self.block, levels=self._tables(idx.device)[0])

    # -- API -------------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, x: torch.Tensor, scale=None) -> TurboQuantPayload:
        """Encode ``x`` (any shape, a floating dtype); ``scale``: ``None`` (the RMS of every
        rotated group), a number, or 1 or ``ceil(numel / block)`` values."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"TurboQuantCodec.encode: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in INPUT_DTYPES:
            raise TypeError(f"TurboQuantCodec.encode: x must be a floating-point tensor, got dtype {x.dtype}")
        n = x.numel()
        if n == 0:
            scales = torch.zeros(1 if scale is not None else 0, dtype=torch.float32, device=x.device)
            codes = torch.zeros(0, dtype=torch.uint8, device=x.device)
            return TurboQuantPayload(codes, scales, x.shape, x.dtype, 0, self.bits, self.block)
        given = None if scale is None else self._check_scale(scale, n, x.device)
        if self._use_triton(x.device):
            codes, scales = self._encode_triton(x, given)
        else:
            v = x.reshape(-1).to(torch.float32)
            signs = self.signs(n, x.device) if self.rotate else None
            codes, scales = self._encode_torch(v, signs, given, owned=v.data_ptr() != x.data_ptr())
        return TurboQuantPayload(codes, scales, x.shape, x.dtype, n, self.bits, self.block)

    def _encode_triton(self, x: torch.Tensor, given) -> tuple[torch.Tensor, torch.Tensor]:
        tt = triton_module()
        n, b, device = x.numel(), self.block, x.device
        v = x.reshape(-1)
        if v.dtype == torch.float64:
            v = v.to(torch.float32)
        v = v.contiguous()
        q = tt.fused_blocks(n, b, self.lane_bits)
        m, per_byte = q * b, 8 // self.lane_bits
        codes = torch.empty(-(-n // per_byte), dtype=torch.uint8, device=device)
        scales = given if given is not None else torch.empty(self._groups(n), dtype=torch.float32, device=device)
        sign_bits, rest_signs = self._triton_signs(n, m, device) if self.rotate else (None, None)
        tt.encode_blocks(
            v,
            q,
            b,
            sign_bits=sign_bits,
            scales=given,
            midpoints=self._tables(device)[1],
            bits=self.bits,
            lane_bits=self.lane_bits,
            codes_out=codes,
            scales_out=None if given is not None else scales,
        )
        if m < n:  # the rest (tail pieces; one odd block of 2): the torch code
            rest_scale = None if given is None else given if given.numel() == 1 else given[q:]
            rest = v[m:].to(torch.float32)
            rest_codes, rest_scales = self._encode_torch(rest, rest_signs, rest_scale, owned=rest.dtype != v.dtype)
            codes[m // per_byte :] = rest_codes
            if given is None:
                scales[q:] = rest_scales
        return codes, scales

    @torch.no_grad()
    def decode(self, payload: TurboQuantPayload) -> torch.Tensor:
        """The tensor ``payload`` stands for: ``x``'s shape and dtype, on the payload's device."""
        if not isinstance(payload, TurboQuantPayload):
            raise TypeError(f"payload must be a TurboQuantPayload, got {type(payload).__name__}")
        if payload.bits != self.bits or payload.block != self.block:
            raise ValueError(
                f"payload was encoded with bits={payload.bits}, block={payload.block}; "
                f"this codec has bits={self.bits}, block={self.block}"
            )
        n, device = payload.numel, payload.codes.device
        if n == 0:
            return torch.zeros(payload.shape, dtype=payload.dtype, device=device)
        scales = payload.scales.to(device).contiguous()
        if self._use_triton(device):
            return self._decode_triton(payload, scales)
        idx = unpack(payload.codes, self.lane_bits, n)
        y = self._decode_torch(idx, scales, self.signs(n, device) if self.rotate else None)
        return y.view(payload.shape).to(payload.dtype)

    def _decode_triton(self, payload: TurboQuantPayload, scales: torch.Tensor) -> torch.Tensor:
        tt = triton_module()
        n, b, device = payload.numel, self.block, payload.codes.device
        q = tt.fused_blocks(n, b, self.lane_bits)
        m, per_byte = q * b, 8 // self.lane_bits
        out = torch.empty(n, dtype=payload.dtype, device=device)
        sign_bits, rest_signs = self._triton_signs(n, m, device) if self.rotate else (None, None)
        tt.decode_blocks(
            payload.codes.contiguous(),
            q,
            b,
            sign_bits=sign_bits,
            scales=scales,
            levels=self._tables(device)[0],
            lane_bits=self.lane_bits,
            out=out,
        )
        if m < n:
            idx = unpack(payload.codes[m // per_byte :], self.lane_bits, n - m)
            rest_scales = scales if scales.numel() == 1 else scales[q:]
            out[m:] = self._decode_torch(idx, rest_scales, rest_signs)
        return out.view(payload.shape)

    def roundtrip(self, x: torch.Tensor, scale=None) -> torch.Tensor:
        """``decode(encode(x, scale))``."""
        return self.decode(self.encode(x, scale))
