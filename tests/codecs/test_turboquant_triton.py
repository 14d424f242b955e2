"""The Triton backend of the TurboQuant codec against the torch backend, bit for bit.

On CPU the kernels run in Triton's interpreter: ``TRITON_INTERPRET=1`` is set when this
module is imported, before it imports :mod:`lowbit_strategy.codecs.turboquant_triton` (the
mode is fixed when the kernels are decorated), and stays set in this test process. Inputs are small, the
interpreter being slow. On a machine with CUDA, :func:`test_cuda_bit_exact` also compiles
the kernels for the GPU in a subprocess and compares there.

triton is part of the ``dev`` extra, so CI has it and these tests must run: without triton
they *fail*, unless ``LOWBIT_ALLOW_NO_TRITON=1`` is set (then they skip), for platforms with
no triton wheel.
"""
import math
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit_strategy.codecs import TurboQuantCodec, lloyd_max_codebook, unpack
from lowbit_strategy.codecs.hadamard import blocked_fwht, hadamard_signs
from lowbit_strategy.codecs.turboquant_rows import decode_rows, encode_rows
from tests.codecs.triton_checks import assert_ok_on_cuda, compiled_figures, import_interpreted, need_triton, same_bits

tt = import_interpreted("turboquant_triton")


@pytest.fixture(autouse=True)
def _need_triton():
    need_triton(tt)


def both(bits: int, block: int, **kw) -> tuple[TurboQuantCodec, TurboQuantCodec]:
    return (
        TurboQuantCodec(bits=bits, block=block, seed=5, backend="torch", **kw),
        TurboQuantCodec(bits=bits, block=block, seed=5, backend="triton", **kw),
    )


def assert_same(ref: TurboQuantCodec, fused: TurboQuantCodec, x: torch.Tensor, scale=None) -> None:
    p, q = ref.encode(x, scale), fused.encode(x, scale)
    assert torch.equal(q.codes, p.codes), "codes differ"
    assert same_bits(q.scales, p.scales), "scales differ"
    assert (q.shape, q.dtype, q.numel) == (p.shape, p.dtype, p.numel)
    d = ref.decode(p)
    assert same_bits(fused.decode(p), d), "decoded values differ"
    assert same_bits(fused.decode(q), d)


def sample(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 3).to(dtype)


# (block, n): whole blocks; tails (power-of-two pieces); blocks of 2 with an odd count
# (2-bit lanes: the last whole block goes to the torch code); an inexact 1/sqrt(512)
CASES = [(64, 1024), (64, 1000), (256, 700), (2, 7), (4, 30), (512, 1536)]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("block,n", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit_exact_against_torch(bits, block, n, dtype):
    ref, fused = both(bits, block)
    x = sample(n, dtype, seed=bits * 100 + n)
    groups = -(-n // block)
    per_block = torch.rand(groups, generator=torch.Generator().manual_seed(n)) * 3 + 0.05
    for scale in (None, 0.7, per_block):
        assert_same(ref, fused, x, scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
@pytest.mark.parametrize("bits", [4, 5])
def test_other_dtypes(dtype, bits):
    ref, fused = both(bits, 128)
    x = sample(1000, dtype, seed=3).view(10, 100)
    assert_same(ref, fused, x)
    assert_same(ref, fused, x.t())  # not contiguous


def test_zero_blocks_and_zero_scales():
    ref, fused = both(4, 64)
    x = sample(300, torch.float32, seed=1)
    x[64:192] = 0.0  # two whole zero blocks: scale 0, decoded zeros
    assert_same(ref, fused, x)
    p = fused.encode(x)
    assert torch.equal(p.scales[1:3], torch.zeros(2))
    assert torch.equal(fused.decode(p)[64:192], torch.zeros(128))
    assert_same(ref, fused, x, scale=0.0)
    assert_same(ref, fused, torch.zeros(256))
    s = torch.tensor([1.0, 0.0, 2.0, 0.0, 1.5])
    assert_same(ref, fused, x, scale=s)


def test_without_rotation_ties_and_clamping():
    ref, fused = both(2, 4, rotate=False)
    lv = lloyd_max_codebook(2)
    mids = (lv[:-1] + lv[1:]) / 2
    x = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 9.0)), torch.tensor([100.0, -100.0, 0.0])])
    assert_same(ref, fused, x, scale=1.0)
    # a midpoint itself gets the lower level, just above it the upper one
    codes = unpack(fused.encode(x, scale=1.0).codes, 2, x.numel()).tolist()
    assert codes[:6] == [0, 1, 2, 1, 2, 3]
    assert codes[6:8] == [3, 0]
    assert_same(ref, fused, x, scale=1e-3)
    for bits in (3, 8):
        r, f = both(bits, 64, rotate=False)
        assert_same(r, f, sample(200, torch.float32, seed=bits))


def test_large_values_and_huge_scales():
    ref, fused = both(4, 64)
    x = sample(512, torch.float32, seed=9) * 1e15  # squares near 1e32: no overflow (non-finite is unspecified)
    assert_same(ref, fused, x)
    assert_same(ref, fused, sample(512, torch.float32, seed=9), scale=1e-30)
    assert_same(ref, fused, sample(512, torch.float32, seed=9), scale=1e30)


def test_rms_rule_is_the_documented_tree():
    """The scale of a full block: squares folded in halves (s[i] += s[i + W/2]), level by
    level, in float32, then the correctly rounded float32 of sqrt(s[0] / block); both
    backends, written out element by element here."""
    block = 64
    ref, fused = both(4, block)
    x = sample(3 * block, torch.float32, seed=4)
    got = fused.encode(x).scales
    assert torch.equal(got, ref.encode(x).scales)
    y = blocked_fwht(x * fused.signs(x.numel(), x.device), block)
    for b in range(3):
        level = [torch.tensor(v, dtype=torch.float32) ** 2 for v in y[b * block : (b + 1) * block].tolist()]
        while len(level) > 1:
            half = len(level) // 2
            level = [level[i] + level[i + half] for i in range(half)]
        want = torch.tensor(math.sqrt(level[0].item() / block), dtype=torch.float32)
        assert got[b].item() == want.item()


@settings(max_examples=25)
@given(
    n=st.integers(1, 2500),
    log2_block=st.integers(1, 9),
    bits=st.integers(2, 7),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    rotate=st.booleans(),
    shared=st.sampled_from([None, 0.5, "per-block"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_shapes_bit_exact(n, log2_block, bits, dtype, rotate, shared, seed):
    block = 1 << log2_block
    ref, fused = both(bits, block, rotate=rotate)
    x = sample(n, dtype, seed)
    scale = shared
    if shared == "per-block":
        scale = torch.rand(-(-n // block), generator=torch.Generator().manual_seed(seed)) + 0.01
    assert_same(ref, fused, x, scale)


def test_sign_bits_layout():
    signs = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0])
    assert tt.sign_bits(signs).tolist() == [0b10000110, 0b1]


def test_fused_blocks():
    assert tt.fused_blocks(1000, 64, 4) == 15
    assert tt.fused_blocks(7, 2, 2) == 2  # 3 blocks of 2 would end mid-byte at 4 codes per byte
    assert tt.fused_blocks(8, 2, 2) == 4
    assert tt.fused_blocks(7, 2, 4) == 3
    assert tt.fused_blocks(1 << 15, 1 << 14, 4) == 0  # too large a block for registers


def test_backend_selection(monkeypatch):
    codec = TurboQuantCodec(backend="auto")
    assert not codec._use_triton(torch.device("cpu"))  # auto: torch on the CPU
    assert TurboQuantCodec(backend="triton")._use_triton(torch.device("cpu"))  # interpreter
    assert not TurboQuantCodec(backend="triton", block=1 << 14)._use_triton(torch.device("cpu"))
    # kernels built for the interpreter are never picked for CUDA tensors by "auto"
    assert not TurboQuantCodec(backend="auto")._use_triton(torch.device("cuda"))
    monkeypatch.setattr(tt, "INTERPRETED", False)
    # compiled kernels on CUDA: auto encodes and decodes with Triton
    from lowbit_strategy.codecs import turboquant

    monkeypatch.setattr(turboquant, "_TRITON_OK", True)
    auto = TurboQuantCodec(backend="auto")
    assert auto._use_triton(torch.device("cuda"))
    with pytest.raises(RuntimeError, match=r"needs a CUDA tensor.*TRITON_INTERPRET=1"):
        TurboQuantCodec(backend="triton").encode(torch.randn(64))
    monkeypatch.setattr(tt, "AVAILABLE", False)
    with pytest.raises(ImportError, match=r'pip install "lowbit-strategy\[triton\]"'):
        TurboQuantCodec(backend="triton")


def test_empty_and_single_element():
    ref, fused = both(4, 64)
    assert fused.decode(fused.encode(torch.zeros(0, 3))).shape == (0, 3)
    assert_same(ref, fused, torch.tensor([2.5]))


_CUDA_CHECK = textwrap.dedent(
    """
    import torch
    from lowbit_strategy.codecs import TurboQuantCodec
    def same(a, b):
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
        return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))
    g = torch.Generator(device="cuda").manual_seed(0)
    for bits in (2, 3, 4, 8):
        for block, n in ((1024, 1 << 20), (1024, (1 << 20) + 777), (64, 10_000), (2, 7), (8192, 1 << 16)):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                x = (torch.randn(n, device="cuda", generator=g) * 3).to(dtype)
                ref = TurboQuantCodec(bits=bits, block=block, backend="torch")
                fused = TurboQuantCodec(bits=bits, block=block, backend="triton")
                for scale in (None, 0.7):
                    p, q = ref.encode(x, scale), fused.encode(x, scale)
                    assert torch.equal(p.codes, q.codes), (bits, block, n, dtype, scale, "codes")
                    assert same(p.scales, q.scales), (bits, block, n, dtype, scale, "scales")
                    assert same(ref.decode(p), fused.decode(p)), (bits, block, n, dtype, scale, "decode")
    print("ok")
    """
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the interpreter tests above cover CPU")
def test_cuda_bit_exact():
    assert_ok_on_cuda(_CUDA_CHECK)


_PTX_CHECK = textwrap.dedent(
    """
    import json
    from lowbit_strategy.codecs import turboquant_triton as tt
    from tests.codecs.triton_checks import compile_sm90 as ptx  # H100; needs no GPU

    assert not tt.INTERPRETED

    enc = {"x_ptr": "*fp32", "sgn_ptr": "*u8", "scale_in_ptr": "*fp32", "mids_ptr": "*fp32",
           "codes_ptr": "*u8", "scale_out_ptr": "*fp32", "nblocks": "i32", "nbytes": "i32",
           "inv_sqrt_b": "fp32", "inv_b": "fp32", "R": "constexpr", "B": "constexpr",
           "LOG2B": "constexpr", "ROTATE": "constexpr", "SCALE_MODE": "constexpr",
           "BITS": "constexpr", "LANE": "constexpr"}
    dec = {"codes_ptr": "*u8", "sgn_ptr": "*u8", "scale_ptr": "*fp32", "levels_ptr": "*fp32",
           "out_ptr": "*i16", "nblocks": "i32", "inv_sqrt_b": "fp32", "R": "constexpr",
           "B": "constexpr", "LOG2B": "constexpr", "ROTATE": "constexpr",
           "SHARED_SCALE": "constexpr", "LANE": "constexpr", "OUT_BF16": "constexpr"}
    e = ptx(tt._encode_kernel, enc, dict(R=1, B=1024, LOG2B=10, ROTATE=True, SCALE_MODE=0, BITS=4, LANE=4), **tt.LAUNCH)
    e8 = ptx(tt._encode_kernel, enc, dict(R=16, B=64, LOG2B=6, ROTATE=True, SCALE_MODE=2, BITS=8, LANE=8), **tt.LAUNCH)
    dconst = dict(R=1, B=1024, LOG2B=10, ROTATE=True, SHARED_SCALE=False, LANE=4, OUT_BF16=True)
    d = ptx(tt._decode_kernel, dec, dconst, **tt.LAUNCH)
    d_fused = ptx(tt._decode_kernel, dec, dconst, enable_fp_fusion=True) + ptx(
        tt._encode_kernel, enc, dict(R=1, B=1024, LOG2B=10, ROTATE=True, SCALE_MODE=0, BITS=4, LANE=4),
        enable_fp_fusion=True,
    )
    count = lambda text, *subs: sum(text.count(s) for s in subs)
    print(json.dumps({
        "enc_div_rn": count(e, "div.rn.f32"), "enc_sqrt_rn": count(e, "sqrt.rn.f32"),
        "enc8_div_rn": count(e8, "div.rn.f32"),
        "approx": count(e + e8 + d, "div.full", "div.approx", "sqrt.approx", "rsqrt"),
        "ftz": count(e + e8 + d, ".ftz"), "fma": count(e + e8 + d, "fma.rn"),
        "fma_if_fused": count(d_fused, "fma.rn"),
    }))
    """
)


@pytest.mark.slow  # compiles the kernels for sm_90 (seconds), like signs_triton's PTX test
def test_compiled_ptx_rounds_like_torch():
    """What the interpreter cannot show: the kernels compiled for an H100 (no GPU needed)
    divide and take square roots with IEEE rounding (div.rn/sqrt.rn, not the approximate
    forms Triton may pick), flush no subnormal to zero, and contract no mul + add into an
    FMA — which they would without enable_fp_fusion=False (the RMS tree's first level,
    ``a·a + b·b``, does: checked below), and which would break bit-exactness against
    torch."""
    got = compiled_figures(_PTX_CHECK)
    assert got["enc_div_rn"] > 0 and got["enc_sqrt_rn"] > 0 and got["enc8_div_rn"] > 0, got
    assert got["approx"] == 0 and got["ftz"] == 0 and got["fma"] == 0, got
    assert got["fma_if_fused"] > 0, got  # the check above can see an FMA


@pytest.mark.parametrize("bits, block, m", [(4, 64, 256), (2, 16, 128), (8, 32, 64), (4, 64, 200), (3, 8, 12)])
@pytest.mark.parametrize("shared", [False, True])
def test_decode_rows_one_launch_for_every_rank(bits, block, m, shared):
    # rows of whole blocks on whole bytes: one kernel launch over every row (the rotation's
    # signs repeated per row); other rows: one decode each. Bit for bit the torch rows either way.
    ref, fused = both(bits, block)
    xs = [sample(m, torch.float32, seed=s) for s in range(3)]
    payloads = [ref.encode(x, 0.5 if shared else None) for x in xs]
    codes = torch.stack([q.codes for q in payloads])
    scales = torch.stack([q.scales.reshape(-1) for q in payloads])
    want = torch.stack([ref.decode(q) for q in payloads])
    assert same_bits(decode_rows(fused, codes, scales, m), want)
    assert same_bits(decode_rows(ref, codes, scales, m), want)


@pytest.mark.parametrize("bits, block, m", [(4, 64, 256), (2, 16, 128), (3, 8, 24), (4, 64, 200)])
@pytest.mark.parametrize("scale", [None, 0.5, "rows"])
def test_encode_rows_one_launch_for_every_chunk(bits, block, m, scale):
    ref, fused = both(bits, block)
    x = torch.stack([sample(m, torch.float32, seed=s) for s in range(3)])
    g = -(-m // block)
    given = torch.rand(3 * g, generator=torch.Generator().manual_seed(1)) + 0.1 if scale == "rows" else scale
    codes, scales = encode_rows(fused, x, given)
    want_codes, want_scales = encode_rows(ref, x, given)
    assert torch.equal(codes, want_codes) and same_bits(scales, want_scales)
    for r in range(3):  # and each row is what encoding it alone gives
        one = given.view(3, g)[r] if scale == "rows" else given
        assert torch.equal(codes[r], ref.encode(x[r], one).codes)


@pytest.mark.parametrize("bits", [2, 4])
def test_signed_zeros_decode_as_torch(bits):
    """A block of equal codes decodes, after the inverse rotation, to one nonzero value and
    exact zeros, and torch's multiply by the −1 signs makes some of them −0.0. The kernels
    flip signs by the same multiply: a negation compiled as ``0 − x`` gave +0.0 there (found
    on an H100: 32 of 120 payloads differed only in signed zeros)."""
    import dataclasses

    ref, fused = both(bits, 64)
    p = ref.encode(sample(256, torch.float32, 0))
    p = dataclasses.replace(p, codes=torch.full_like(p.codes, 0x55))  # one level in every lane
    d = ref.decode(p)
    assert (d == 0).any() and torch.signbit(d[d == 0]).any(), "the case must hold negative zeros"
    assert same_bits(fused.decode(p), d)
    assert_same(ref, fused, torch.zeros(128))


def test_sign_tails_and_row_bits_are_kept_and_are_the_stream():
    """The tail signs and the rows' sign bits are made once per layout (not per call: four and
    one launches saved per codec call on a GPU) and are the seed's rotation signs."""
    codec = TurboQuantCodec(4, seed=3, block=64, backend="triton")
    bits, tail = codec._triton_signs(1000, 960, "cpu")
    again = codec._triton_signs(1000, 960, "cpu")[1]
    assert again is tail and torch.equal(tail, hadamard_signs(1000, 3)[960:])
    other = codec._triton_signs(1003, 960, "cpu")[1]  # another layout: its own entry
    assert torch.equal(other, hadamard_signs(1003, 3)[960:])
    rows = codec._row_sign_bits(128, 3, "cpu")
    assert rows is codec._row_sign_bits(128, 3, "cpu") and torch.equal(rows, bits[:16].repeat(3))
    for _ in range(70):  # bounded: the oldest entries go
        codec._triton_signs(2048, 1024 + 64 * (_ % 16), "cpu")
        codec._row_sign_bits(64, 1 + _, "cpu")
    assert len(codec._sign_tails) <= 64
