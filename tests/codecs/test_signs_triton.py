"""The fused 1-bit kernels (:mod:`lowbit_strategy.codecs.signs_triton`) against the torch
codes, bit for bit: the scaled-sign decode, the server's mean, ``signs_from_bits``, the
majority vote and BitDP's channel decode-and-reduce.

On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` set before the module
is imported, as in ``test_turboquant_triton.py``), dispatched through the same public
functions a CUDA tensor takes (their ``fused_kernels`` hook pointed at the interpreted module),
so the argument handling is the one a GPU runs. On a machine with CUDA,
:func:`test_cuda_bit_exact` compiles them for the GPU in a subprocess and compares there;
without one, :func:`test_compiled_ptx_has_no_fma` compiles them for an H100 and reads the PTX.
"""

import textwrap

import pytest
import torch

from lowbit_strategy.codecs import scaled_signs as ss
from lowbit_strategy.codecs import scaled_signs_decode as ssd
from lowbit_strategy.codecs import signs, votes
from lowbit_strategy.codecs.reduce import rank_sum
from lowbit_strategy.codecs.votes import majority_bits
from lowbit_strategy.collectives import gathered
from tests.codecs.triton_checks import assert_ok_on_cuda, compiled_figures, import_interpreted, need_triton, same_bits

st = import_interpreted("signs_triton")


@pytest.fixture(autouse=True)
def _need_triton():
    need_triton(st)


@pytest.fixture
def fused(monkeypatch):
    """The public codecs dispatch CPU tensors to the interpreted kernels, as CUDA ones to the
    compiled kernels."""
    hook = lambda t: st if st.serves(t) else None  # noqa: E731
    monkeypatch.setattr(ssd, "fused_kernels", hook)
    monkeypatch.setattr(signs, "fused_kernels", hook)
    monkeypatch.setattr(ss, "fused_kernels", hook)
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    real = st.decode
    monkeypatch.setattr(st, "decode", counted)
    return calls


def payload(k: int, c: int, nb: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bytes, and scales with the awkward values: 0 (signed zeros in the output),
    subnormals, values that round differently in bf16/fp16, and large ones."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (k, c), dtype=torch.uint8, generator=g)
    scales = torch.rand(k * nb, generator=g) * 3
    special = torch.tensor([0.0, 1e-40, 1.00390625, 1.0009765625, 3.0e38, 65504.0, 2.0**-20])
    scales[: min(len(special), scales.numel())] = special[: scales.numel()]
    return bits, scales[torch.randperm(scales.numel(), generator=g)].view(k, nb) if nb > 1 else scales


def reference(fn, *args, **kw):
    """The torch code's result: the hook off for this call."""
    saved = ssd.fused_kernels, signs.fused_kernels, ss.fused_kernels
    ssd.fused_kernels = signs.fused_kernels = ss.fused_kernels = lambda t: None
    try:
        return fn(*args, **kw)
    finally:
        ssd.fused_kernels, signs.fused_kernels, ss.fused_kernels = saved


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "k, c, block, cut",
    [(1, 37, None, 0), (3, 64, None, 5), (5, 129, None, 8), (4, 50, 16, 3), (3, 33, 24, 0), (2, 4096, 16384, 7),
     (3, 40, 64, 1)],
)
def test_decode_bit_exact(fused, dtype, k, c, block, cut):
    nb = 1 if block is None else -(-8 * c // block)
    bits, scales = payload(k, c, nb, seed=k * 1000 + c)
    n = 8 * k * c - cut
    want = reference(ssd.scaled_sign_decode, bits, scales, n, dtype, block)
    got = ssd.scaled_sign_decode(bits, scales, n, dtype, block)
    assert fused, "the fused decode did not run"
    assert same_bits(got, want), (dtype, k, c, block)
    into = torch.full((n,), 7.0, dtype=dtype)
    assert ssd.scaled_sign_decode(bits, scales, n, dtype, block, out=into) is into
    assert same_bits(into, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "n, pad, block, chunk",
    [(1, 0, None, None), (37, 3, None, None), (1000, 0, None, None), (1003, 13, 16, None), (200, 0, 24, None),
     (999, 1, 64, 8 * 125), (4096, 2048, 512, 2048), (40, 24, 16, 32), (70000, 0, 32768, 8 * 8750)],
)
def test_compress_bit_exact(monkeypatch, dtype, n, pad, block, chunk):
    """1-bit Adam/LAMB's worker and server compress (signs, packing, error feedback) in one
    kernel: the torch code's bits, scales and new error, signed zeros and exact ties included."""
    g = torch.Generator().manual_seed(n + pad)
    x = torch.randn(n, generator=g).mul_(torch.rand(n, generator=g) * 4).to(dtype)
    x[::7] = 0.0
    x[3::11] = -0.0
    error = torch.randn(n, generator=g) * 0.1
    error[::13] = -x[::13].float()  # v = +0.0 or -0.0 exactly: counted +1
    nbytes = -(-n // 8) + pad if chunk is None else -(-n // chunk) * chunk // 8
    want_error = error.clone()
    want = reference(ss.scaled_sign_compress, x, want_error, nbytes=nbytes, block=block, chunk=chunk)
    calls = []
    real = st.compress
    monkeypatch.setattr(ss, "fused_kernels", lambda t: st)
    monkeypatch.setattr(st, "compress", lambda *a: calls.append(1) or real(*a))
    got = ss.scaled_sign_compress(x, error, nbytes=nbytes, block=block, chunk=chunk)
    assert calls, "the fused compress did not run"
    assert torch.equal(got[0], want[0]) and same_bits(got[1], want[1])
    assert same_bits(error, want_error), (n, block, chunk)


def test_decode_1d_bits_and_empty(fused):
    bits, scales = payload(1, 10, 1, seed=3)
    want = reference(ssd.scaled_sign_decode, bits.view(-1), scales, 75)
    assert same_bits(ssd.scaled_sign_decode(bits.view(-1), scales, 75), want)
    assert ssd.scaled_sign_decode(bits, scales, 0).shape == (0,)


@pytest.mark.parametrize(
    "k, block",
    [*[(k, b) for k in (1, 2, 3, 4, 5, 7, 8, 9) for b in (None, 16)], (3, 16384),
     *[pytest.param(k, b, marks=pytest.mark.slow) for k, b in ((16, None), (33, None), (33, 16), (9, 16384))]],
)
def test_mean_bit_exact_in_rank_sum_order(monkeypatch, k, block):
    c = 2048 if block == 16384 else 40
    nb = 1 if block is None else -(-8 * c // block)
    bits, scales = payload(k, c, nb, seed=k + (block or 0))
    if k >= 4:  # a row of zero scales: -0.0 terms, which must stay -0.0 where every term is
        scales[1] = 0.0
        bits[1] = 0
    want = reference(ssd.scaled_sign_mean, bits, scales, block)
    monkeypatch.setattr(ssd, "fused_kernels", lambda t: st)
    got = ssd.scaled_sign_mean(bits, scales, block)
    assert same_bits(got, want), (k, block)
    into = torch.empty(8 * c)
    assert ssd.scaled_sign_mean(bits, scales, block, out=into) is into and same_bits(into, want)


def test_mean_padding_keeps_signed_zeros_and_the_tree(monkeypatch):
    # every term -0.0 -> the sum is -0.0 (a +0.0 pad or identity would give +0.0); and values
    # where the pairwise order and the rank order round differently
    monkeypatch.setattr(ssd, "fused_kernels", lambda t: st)
    zeros = ssd.scaled_sign_mean(torch.zeros(3, 2, dtype=torch.uint8), torch.zeros(3))
    assert same_bits(zeros, torch.full((16,), -0.0))
    scales = torch.tensor([1.0, 2.0**-24, 2.0**-24, 2.0**-24, 2.0**-24]) * 5
    bits = torch.full((5, 1), 255, dtype=torch.uint8)
    got = ssd.scaled_sign_mean(bits, scales)
    w = scales / 5
    assert same_bits(got, rank_sum(w.view(5, 1).expand(5, 8).contiguous()))
    in_rank_order = w[0].expand(8)
    for r in range(1, 5):
        in_rank_order = in_rank_order + w[r]
    assert not same_bits(got, in_rank_order)  # 1 + 2^-22 against 1: the orders differ here


def test_signs_from_bits(fused):
    g = torch.Generator().manual_seed(5)
    words = torch.randint(0, 256, (77,), dtype=torch.uint8, generator=g)
    for dtype in DTYPES:
        for n in (0, 1, 613, 616):
            want = reference(signs.signs_from_bits, words, n, dtype)
            assert same_bits(signs.signs_from_bits(words, n, dtype), want), (dtype, n)
    assert fused


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8, 9, 16, 33])
@pytest.mark.parametrize("step", [1, 2])
def test_majority_bit_exact(p, step):
    g = torch.Generator().manual_seed(p * 10 + step)
    received = torch.randint(0, 256, (p, 300), dtype=torch.uint8, generator=g)
    received[:, :40] = 0b10101010  # every column tied at even P
    words = received[:, :291]  # rows with a stride: as the majority collective passes them
    want = majority_bits(words, step, method="bitsliced")
    assert torch.equal(majority_bits(words, step, method="fused"), want)
    assert torch.equal(st.majority(words, votes.majority_threshold(p, step)), want)


def channel_payload(p: int, shapes, bits: int, seed: int, stride_pad: int = 0):
    """Every rank's packed words for ``shapes`` (random bytes: 2-bit lanes include the unused
    code 3, which the torch code decodes as 3), per-rank scales with zeros (signed-zero
    terms) and awkward values, and the layout; ``stride_pad`` extra bytes per rank row (a
    view into a larger buffer, as the two-stage server passes it)."""
    g = torch.Generator().manual_seed(seed)
    layout = gathered.PayloadLayout.of(list(shapes), bits)
    words = torch.randint(0, 256, (p, layout.words + stride_pad), dtype=torch.uint8, generator=g)[:, : layout.words]
    scales = torch.rand(p, layout.rows, generator=g) * 3
    scales.view(-1)[:: 7] = 0.0
    scales.view(-1)[1] = 1e-40
    return words, scales, layout


CHANNEL_SHAPES = [(3, 37), (1, 8), (5, 13), (2, 64), (1, 1), (4, 3)]


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("reduction", ["mean", "paper"])
@pytest.mark.parametrize("p", [1, 2, 5, *(pytest.param(p, marks=pytest.mark.slow) for p in (3, 8, 9))])
def test_channel_reduce_bit_exact(monkeypatch, bits, reduction, p):
    words, scales, layout = channel_payload(p, CHANNEL_SHAPES, bits, seed=10 * p + bits, stride_pad=5)
    if reduction == "paper":
        scales = scales[0]
    monkeypatch.setattr(gathered, "fused_kernels", lambda t: None)
    want = gathered.decode_reduce(words, scales, layout, reduction=reduction)
    chunked = gathered.decode_reduce(words, scales, layout, reduction=reduction, chunk_rows=2)
    assert same_bits(chunked, want)  # the torch code: chunks change nothing
    calls = []
    real = st.channel_reduce
    monkeypatch.setattr(st, "channel_reduce", lambda *a: (calls.append(a[2:4]), real(*a))[1])
    monkeypatch.setattr(gathered, "fused_kernels", lambda t: st)
    got = gathered.decode_reduce(words, scales, layout, reduction=reduction)
    assert calls == list(layout.shapes)  # one kernel per matrix
    assert same_bits(got, want), (bits, reduction, p)
    # out as one tensor per matrix: contiguous views run fused, a strided one the torch code
    flat = torch.full((layout.numel,), 7.0)
    views = [flat[e : e + r * c] for e, (r, c) in zip(layout.elem_offsets, layout.shapes)]
    strided = torch.full((layout.shapes[0][0] * layout.shapes[0][1], 2), 7.0)
    views[0] = strided[:, 0]
    calls.clear()
    gathered.decode_reduce(words, scales, layout, reduction=reduction, out=views)
    assert len(calls) == len(layout.shapes) - 1
    assert same_bits(torch.cat([v.reshape(-1) for v in views]), want)


def test_channel_reduce_signed_zeros_and_the_tree(monkeypatch):
    # every term of a column -0.0 (code -1 with scale 0) -> -0.0, and +0.0 where a 2-bit code is
    # 0; a case where the pairwise order and the rank order round differently
    monkeypatch.setattr(gathered, "fused_kernels", lambda t: st)
    layout = gathered.PayloadLayout.of([(1, 8)], 1)
    got = gathered.decode_reduce(torch.zeros(3, 1, dtype=torch.uint8), torch.zeros(3, 1), layout)
    assert same_bits(got, torch.full((8,), -0.0))
    layout2 = gathered.PayloadLayout.of([(1, 4)], 2)
    got = gathered.decode_reduce(torch.zeros(3, 1, dtype=torch.uint8), torch.zeros(3, 1), layout2)
    assert same_bits(got, torch.zeros(4))
    scales = torch.tensor([1.0, 2.0**-24, 2.0**-24, 2.0**-24, 2.0**-24]).view(5, 1) * 5
    got = gathered.decode_reduce(torch.full((5, 1), 255, dtype=torch.uint8), scales, layout)
    w = scales.view(5) / 5
    assert same_bits(got, rank_sum(w.view(5, 1).expand(5, 8).contiguous()))
    in_rank_order = w[0].expand(8)
    for r in range(1, 5):
        in_rank_order = in_rank_order + w[r]
    assert not same_bits(got, in_rank_order)  # the orders differ here


def test_fused_is_lanes_where_it_cannot_run():
    # more rows than a program holds: the byte-lane count (same bits)
    words = torch.randint(0, 256, (st.MAX_ROWS + 1, 16), dtype=torch.uint8)
    assert torch.equal(majority_bits(words, 3, method="fused"), majority_bits(words, 3, method="bitsliced"))


def test_cpu_never_dispatches_without_the_hook():
    # the real hook serves CUDA tensors only: a CPU run keeps the torch code (and never
    # imports triton through it)
    assert signs.fused_kernels(torch.zeros(8, dtype=torch.uint8)) is None
    assert ssd.fused_kernels is signs.fused_kernels


_CUDA_CHECK = textwrap.dedent(
    """
    import torch
    from lowbit_strategy.codecs import scaled_signs as ss, scaled_signs_decode as ssd, signs
    from lowbit_strategy.codecs.votes import majority_bits
    from lowbit_strategy.codecs import signs_triton as st
    assert st.serves(torch.zeros(1, device="cuda")) and not st.INTERPRETED
    def same(a, b):
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))
    g = torch.Generator().manual_seed(0)
    for k, c, block in ((1, 1 << 17, None), (5, 50_000, None), (8, 4099, 16), (3, 1 << 15, 16384), (64, 999, None)):
        nb = 1 if block is None else -(-8 * c // block)
        bits = torch.randint(0, 256, (k, c), dtype=torch.uint8, generator=g)
        scales = torch.rand(k * nb, generator=g) * 3
        scales[0] = 0.0
        scales = scales.view(k, nb) if block else scales
        n = 8 * k * c - 3
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            want = ssd.scaled_sign_decode(bits, scales, n, dtype, block)  # CPU: the torch code
            got = ssd.scaled_sign_decode(bits.cuda(), scales.cuda(), n, dtype, block)
            assert same(got.cpu(), want), ("decode", k, c, block, dtype)
        want = ssd.scaled_sign_mean(bits, scales, block)
        assert same(ssd.scaled_sign_mean(bits.cuda(), scales.cuda(), block).cpu(), want), ("mean", k, c, block)
        x = want[: 8 * c - 5].clone()
        x[::9] = -0.0
        chunk = None if block is None else 8 * c
        for where in ("cpu", "cuda"):
            e = torch.randn(x.numel(), generator=g).mul_(0.01)
            e[::4] = 0.0
            e = e.to(where)
            got = ss.scaled_sign_compress(x.to(where), e, nbytes=c, block=block, chunk=chunk)
            if where == "cpu":
                want_c, want_e = got, e
        assert torch.equal(got[0].cpu(), want_c[0]) and same(got[1].cpu(), want_c[1]), ("compress", k, c, block)
        assert same(e.cpu(), want_e), ("compress error", k, c, block)
        assert same(signs.signs_from_bits(bits[0].cuda(), 8 * c - 1).cpu(), signs.signs_from_bits(bits[0], 8 * c - 1))
        for step in (1, 2):
            want = majority_bits(bits, step, method="bitsliced")
            assert torch.equal(majority_bits(bits.cuda(), step).cpu(), want), ("majority", k, c, step)
    from lowbit_strategy.collectives import gathered
    for p in (1, 2, 5, 8):
        for bits in (1, 2):
            layout = gathered.PayloadLayout.of([(768, 3072), (1, 50257), (3, 37), (2304, 768)], bits)
            words = torch.randint(0, 256, (p, layout.words), dtype=torch.uint8, generator=g)
            scales = torch.rand(p, layout.rows, generator=g)
            scales[:, ::5] = 0.0
            for reduction in ("mean", "paper"):
                sc = scales if reduction == "mean" else scales[0]
                want = gathered.decode_reduce(words, sc, layout, reduction=reduction)
                got = gathered.decode_reduce(words.cuda(), sc.cuda(), layout, reduction=reduction)
                assert same(got.cpu(), want), ("channel_reduce", p, bits, reduction)
    zeros = ssd.scaled_sign_mean(torch.zeros(3, 2, dtype=torch.uint8, device="cuda"), torch.zeros(3, device="cuda"))
    assert same(zeros.cpu(), torch.full((16,), -0.0)), "the -0.0 padding lost its sign"
    print("ok")
    """
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the interpreter tests above cover CPU")
def test_cuda_bit_exact():
    assert_ok_on_cuda(_CUDA_CHECK)


_PTX_CHECK = textwrap.dedent(
    """
    import json
    import re
    from lowbit_strategy.codecs import signs_triton as st
    from tests.codecs.triton_checks import compile_sm90

    assert not st.INTERPRETED
    sass = []

    def ptx(fn, sig, consts, **options):
        return compile_sm90(fn, sig, consts, sass, **options)

    dec = {"bits_ptr": "*u8", "scale_ptr": "*fp32", "out_ptr": "*i16", "n": "i64", "row_len": "i64", "nb": "i32",
           "block_bytes": "i32", "TILE": "constexpr", "BLOCKED": "constexpr", "OUT": "constexpr"}
    mean = {"bits_ptr": "*u8", "w_ptr": "*fp32", "out_ptr": "*fp32", "k": "i32", "c": "i64", "nb": "i32",
            "block_bytes": "i32", "neg_zero": "fp32", "KP": "constexpr", "LOGK": "constexpr", "TILE": "constexpr", "BLOCKED": "constexpr"}
    maj = {"words_ptr": "*u8", "out_ptr": "*u8", "p": "i32", "c": "i64", "row_stride": "i64", "threshold": "i32",
           "PP": "constexpr", "TB": "constexpr"}
    chan = {"words_ptr": "*u8", "w_ptr": "*fp32", "out_ptr": "*fp32", "k": "i32", "n": "i64", "cols": "i64",
            "word_stride": "i64", "w_stride": "i64", "neg_zero": "fp32", "BITS": "constexpr", "KP": "constexpr", "LOGK": "constexpr",
            "TILE": "constexpr", "MEAN": "constexpr"}
    comp = {"v_ptr": "*fp32", "scale_ptr": "*fp32", "bits_ptr": "*u8", "n": "i64", "nbytes": "i64", "row_len": "i64",
            "nb": "i32", "block_bytes": "i32", "TB": "constexpr", "BLOCKED": "constexpr"}
    text = (ptx(st._decode_kernel, dec, dict(TILE=1024, BLOCKED=True, OUT=2), **st.LAUNCH)
            + ptx(st._compress_kernel, comp, dict(TB=128, BLOCKED=True), **st.LAUNCH)
            + ptx(st._mean_kernel, mean, dict(KP=8, LOGK=3, TILE=512, BLOCKED=True), **st.LAUNCH)
            + ptx(st._majority_kernel, maj, dict(PP=8, TB=512), **st.LAUNCH)
            + "".join(ptx(st._channel_kernel, chan, dict(BITS=b, KP=8, LOGK=3, TILE=512, MEAN=m), **st.LAUNCH)
                      for b in (1, 2) for m in (True, False)))
    print(json.dumps({"fma": text.count("fma.rn"), "ftz": text.count(".ftz"), "neg": text.count("neg.f32"),
                      "add": text.count("add.rn.f32"), "xor": text.count("xor.b32"),
                      "fsel_negated": len(re.findall(r"FSEL[^;]*, -R", "".join(sass))),
                      "fsel": "".join(sass).count("FSEL")}))
    """
)


@pytest.mark.slow
def test_compiled_ptx_has_no_fma():
    """What the interpreter cannot show: the kernels compile for an H100 (no GPU needed); the
    mean's adds stay IEEE adds (no FMA contraction, no flush-to-zero); signs are flipped by
    XOR, with no float negation (which ptxas may fold into a select that loses −0.0); and no
    select in the machine code (SASS) has a negated operand: ``FSEL …, -RZ`` (how ptxas wrote
    a constant −0.0 padding) read +0.0 on an H100."""
    got = compiled_figures(_PTX_CHECK)
    assert got["fma"] == 0 and got["ftz"] == 0 and got["neg"] == 0, got
    assert got["add"] > 0 and got["xor"] > 0, got
    assert got["fsel_negated"] == 0 and got["fsel"] > 0, got
