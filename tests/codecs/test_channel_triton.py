"""BitDP's fused channel encode (:mod:`lowbit_strategy.codecs.channel_triton`) against the torch
code of :mod:`lowbit_strategy.codecs.channel`, bit for bit: codes, scales and the decoded rows
error feedback keeps.

On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` set before the module is
imported, as in ``test_signs_triton.py``), dispatched through the same public functions a CUDA
tensor takes (``channel.fused_kernels`` pointed at the interpreted module). On a machine with
CUDA, :func:`test_cuda_bit_exact` compares the compiled kernels there, with GPT-2's shapes;
without one, the slow :func:`test_compiled_ptx_rounds_like_torch` compiles them for an H100 and
reads the machine code.
"""

import textwrap

import pytest
import torch

from lowbit_strategy.codecs import channel
from lowbit_strategy.codecs.channel import channel_decode, channel_encode, channel_encode_many
from tests.codecs.triton_checks import assert_ok_on_cuda, compiled_figures, import_interpreted, need_triton, same_bits

ct = import_interpreted("channel_triton")


@pytest.fixture(autouse=True)
def _need_triton():
    need_triton(ct)


@pytest.fixture
def fused(monkeypatch):
    """CPU tensors go to the interpreted kernels, as CUDA ones to the compiled kernels; returns
    the shapes each launch encoded."""
    monkeypatch.setattr(channel, "fused_kernels", lambda t: ct if ct.serves(t) else None)
    calls = []
    real = ct.channel_encode
    monkeypatch.setattr(ct, "channel_encode", lambda rows, *a: (calls.append(tuple(rows.shape)), real(rows, *a))[1])
    return calls


def torch_code(fn, *args, **kw):
    """The torch code's result: the hook off for this call."""
    saved = channel.fused_kernels
    channel.fused_kernels = lambda t: None
    try:
        return fn(*args, **kw)
    finally:
        channel.fused_kernels = saved


def awkward(r: int, c: int, seed: int) -> torch.Tensor:
    """Gradients with the cases that matter, from the second row on (a lone row stays random):
    an all-zero row (α = 0: every entry kept, scale 0), signed zeros and subnormals, entries
    exactly at the threshold, huge values, and a scale that underflows to 0 under a negative
    code (decoded −0.0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, c, generator=g) * torch.rand(r, 1, generator=g) * 3
    special = [
        lambda row: row.zero_(),
        lambda row: (row[::2].fill_(-0.0), row[1::2].fill_(1e-41)),
        lambda row: row.copy_(torch.tensor([3.0, -3.0, 5.0, -5.0]).repeat(c // 4 + 1)[:c]),  # α = 3 = |x| (c % 4 == 0)
        lambda row: row[: c // 2].fill_(3.0e38),
        lambda row: (row.zero_(), row[0].fill_(-1.4e-45)),  # mean and scale underflow to 0: decoded -0.0
    ]
    for i, fill in enumerate(special[: max(0, r - 1)]):
        fill(x[i + 1])
    return x


SHAPES = [(1, 37), (2, 1), (3, 3), (4, 8), (6, 129), (3, 2048), (2, 2049), (6, 5000), (64, 96)]


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_encode_bit_exact(fused, bits, shape):
    x = awkward(*shape, seed=shape[0] * 7 + shape[1])
    want = torch_code(channel_encode, x, bits)
    got = channel_encode(x, bits)
    assert fused == [shape]
    for a, b in zip(got, want):
        assert same_bits(a, b), (bits, shape)


@pytest.mark.parametrize("bits", [1, 2])
def test_encode_many_with_decode_bit_exact(fused, bits):
    # a flat buffer's back-to-back matrices (stacked as one view), a transposed weight (its
    # strided rows: encoded alone, the kernel reading its strides), a 1-D bias and a lone row
    flat = awkward(8, (3 * 4 * 48 + 48 * 20) // 8, seed=bits).view(-1)
    mats = [flat[: 4 * 48].view(4, 48), flat[4 * 48 : 8 * 48].view(4, 48), flat[8 * 48 : 12 * 48].view(4, 48)]
    mats.append(flat[12 * 48 :].view(20, 48).t())  # (48, 20), strided
    mats += [awkward(1, 30, seed=3).view(-1), awkward(3, 7, seed=4)]
    want = torch_code(channel_encode_many, mats, bits, decode=True)
    got = channel_encode_many(mats, bits, decode=True)
    assert fused == [(12, 48), (48, 20), (1, 30), (3, 7)]
    for (c1, s1, d1), (c2, s2, d2) in zip(got, want):
        assert same_bits(c1, c2) and same_bits(s1, s2) and same_bits(d1, d2)
        assert same_bits(d1, channel_decode(c1, s1, bits))  # the kernel's decode is channel_decode


@pytest.mark.parametrize("bits", [1, 2])
def test_strided_inputs_bit_exact(fused, bits):
    # the kernel reads rows through their strides and writes the kept magnitudes back through
    # |rows|' own: a transposed weight, a permuted 3-D one, an expanded (stride-0) row
    base = awkward(6, 96, seed=11)
    cases = [base.t(), base.view(6, 8, 12).permute(2, 0, 1), awkward(1, 40, seed=12).expand(5, 40)]
    for x in cases:
        want = torch_code(channel_encode_many, [x], bits, decode=True)[0]
        got = channel_encode_many([x], bits, decode=True)[0]
        assert all(same_bits(a, b) for a, b in zip(got, want)), tuple(x.stride())


def test_the_decoded_signed_zero_is_kept(fused):
    # a scale that underflows to 0 under a -1 code decodes to -0.0 (the kernel must not lose it)
    x = awkward(6, 16, seed=13)
    for bits in (1, 2):
        _, _, d = channel_encode_many([x], bits, decode=True)[0]
        assert (d[5, 0] == 0) and torch.signbit(d[5, 0]) and not torch.signbit(d[5, 1])


def test_non_finite_input_gives_the_same_codes_and_nan_where_torch_has_nan(fused):
    # a flagged step (the hook never reads the result) must still not fault or differ in codes
    x = awkward(4, 40, seed=9)
    x[1, 3], x[2, 5], x[3, 0] = float("nan"), float("inf"), float("-inf")
    for bits in (1, 2):
        want = torch_code(channel_encode_many, [x], bits, decode=True, validate=False)[0]
        got = channel_encode_many([x], bits, decode=True, validate=False)[0]
        assert same_bits(got[0], want[0])
        for a, b in zip(got[1:], want[1:]):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_the_threshold_and_the_kept_scale():
    # Eq. 7 and Eq. 4 by hand: mean |x| = 2, α = 1.5; mean 4, α = 3 (>= α kept, -α itself not)
    row = torch.tensor([[4.0, -4.0, 3.0, -3.0, 0.0, 1.0, -1.0, 0.0], [3.0, -3.0, 5.0, -5.0, 3.0, -3.0, 5.0, -5.0]])
    for hook in (lambda t: None, lambda t: ct if ct.serves(t) else None):
        saved, channel.fused_kernels = channel.fused_kernels, hook
        try:
            codes, scales = channel_encode(row, 2)
        finally:
            channel.fused_kernels = saved
        assert codes.tolist() == [1, 2, 1, 2, 0, 0, 0, 0, 1, 0, 1, 2, 1, 0, 1, 2]
        assert scales.tolist() == torch.tensor([3.5, 13 / 3]).tolist()


def test_torch_compile_leaves_the_kernels_out_of_its_graph(fused):
    # Dynamo traced into the launch (on the H100, Inductor then failed to compile the kernel; in
    # the interpreter, the trace fails): the launcher is disabled for it, so a compiled caller
    # gets the same bits
    x = awkward(6, 40, seed=5)
    want = channel_encode(x, 2)
    got = torch.compile(lambda t: channel_encode(t, 2, validate=False), backend="eager")(x)
    assert all(same_bits(a, b) for a, b in zip(got, want))


def test_cpu_never_dispatches_without_the_hook():
    assert channel.fused_kernels(torch.zeros(4)) is None


_CUDA_CHECK = textwrap.dedent(
    """
    import torch
    from lowbit_strategy.codecs import channel, channel_triton as ct
    from lowbit_strategy.codecs.channel import channel_encode_many
    assert ct.serves(torch.zeros(1, device="cuda")) and not ct.INTERPRETED
    from tests.codecs.triton_checks import same_bits as same
    g = torch.Generator().manual_seed(0)
    shapes = [(2304, 768), (768, 768), (3072, 768), (768, 3072), (1, 50257), (3, 37)]
    for bits in (1, 2):
        mats = [torch.randn(r, c, generator=g) * torch.rand(r, 1, generator=g) for r, c in shapes]
        mats[0][:5] = 0.0
        mats[1][0] = 0.0
        mats[1][0, 0] = -1.4e-45  # scale underflows to 0 under a -1 code: decoded -0.0
        mats[1][1, ::2], mats[1][1, 1::2] = -0.0, 1e-41
        mats[1][2] = torch.tensor([3.0, -3.0, 5.0, -5.0]).repeat(192)  # at the threshold
        mats[1][3, :100] = 3.0e38
        mats.append(torch.randn(96, 64, generator=g).t())  # strided rows
        cuda = [m.cuda() for m in mats]
        saved, channel.fused_kernels = channel.fused_kernels, lambda t: None
        torch_cuda = channel_encode_many(cuda, bits, decode=True, validate=False)
        channel.fused_kernels = saved
        got = channel_encode_many(cuda, bits, decode=True, validate=False)
        for (c1, s1, d1), (c2, s2, d2) in zip(got, torch_cuda):  # the same as the torch code on the GPU
            assert same(c1, c2) and same(s1, s2) and same(d1, d2), ("fused vs torch on CUDA", bits)
        # against the CPU: torch's CUDA row means round differently, which can move an entry
        # at the threshold across it (a 2-bit row's kept set, hence its scale); rarely
        cpu = channel_encode_many(mats, bits, decode=True, validate=False)
        for (c1, s1, _), (c2, s2, _), m in zip(got, cpu, mats):
            rows_same = (c1.cpu() == c2).view(m.shape[0], -1).all(dim=1)
            assert (c1.cpu() != c2).float().mean() < 1e-4 and rows_same.float().mean() > 0.99, ("codes vs CPU", bits)
            torch.testing.assert_close(s1.cpu()[rows_same], s2[rows_same], rtol=1e-5, atol=0)
    print("ok")
    """
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the interpreter tests above cover CPU")
def test_cuda_bit_exact():
    assert_ok_on_cuda(_CUDA_CHECK)


_PTX_CHECK = textwrap.dedent(
    """
    import json, re
    from lowbit_strategy.codecs import channel_triton as ct
    from tests.codecs.triton_checks import compile_sm90

    assert not ct.INTERPRETED
    sass = []
    codes = {"x_ptr": "*fp32", "mean_ptr": "*fp32", "codes_ptr": "*u8", "kept_ptr": "*fp32", "count_ptr": "*i32",
             "c": "i64", "x_rs": "i64", "x_cs": "i64", "k_rs": "i64", "k_cs": "i64", "factor": "fp32",
             "BITS": "constexpr", "TILE": "constexpr"}
    finish = {"codes_ptr": "*u8", "sum_ptr": "*fp32", "count_ptr": "*i32", "scales_ptr": "*fp32", "out_ptr": "*fp32",
              "c": "i64", "BITS": "constexpr", "DECODE": "constexpr", "TILE": "constexpr"}
    text = "".join(compile_sm90(ct._codes_kernel, codes, dict(BITS=b, TILE=1024), sass, **ct.LAUNCH)
                   + compile_sm90(ct._finish_kernel, finish, dict(BITS=b, DECODE=True, TILE=1024), sass, **ct.LAUNCH)
                   for b in (1, 2))
    machine = "".join(sass)
    print(json.dumps({"fma": text.count("fma.rn"), "ftz": text.count(".ftz"), "div_rn": text.count("div.rn.f32"),
                      "div_approx": len(re.findall(r"div\\.(approx|full)", text)),
                      "fsel_negated": len(re.findall(r"FSEL[^;]*, -R", machine))}))
    """
)


@pytest.mark.slow
def test_compiled_ptx_rounds_like_torch():
    """What the interpreter cannot show: the kernels compile for an H100 (no GPU needed) with no
    FMA contraction and no flush-to-zero, the scale's division IEEE round-to-nearest (no
    approximate division), and no select with a negated operand in the machine code (``FSEL …,
    -RZ`` read +0.0 on an H100)."""
    got = compiled_figures(_PTX_CHECK)
    assert got["fma"] == 0 and got["ftz"] == 0 and got["div_approx"] == 0 and got["fsel_negated"] == 0, got
    assert got["div_rn"] > 0, got
