"""The compiled codec chains (``compile_codecs``): bit for bit the eager codecs, opt-in, and
eager again after one warning when compiling fails.

The fast tests compile nothing (the switch, the config field, the fallback through a
failing compiler). The slow ones compile each chain once in this module's process and
compare it with the eager codec over sizes around :data:`MIN_NUMEL` and the slices of
:mod:`lowbit_strategy.codecs.streaming`, dtypes, ties, signed zeros, subnormals, large
values and thread counts; one trains 2 ranks through the config, eager and compiled.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import lowbit_strategy
from lowbit_strategy import LowBitConfig
from lowbit_strategy.codecs import channel_encode, compiled, lp_quantize, lp_quantize_levels, scaled_sign_compress
from lowbit_strategy.codecs.compiled import MIN_NUMEL
from lowbit_strategy.codecs.streaming import SLICE
from tests.distributed import run_ranks

#: sizes: below the threshold (eager), at it, odd sizes, and around the streaming slices
SIZES = (MIN_NUMEL - 1, MIN_NUMEL, MIN_NUMEL + 3, SLICE - 1, SLICE, SLICE + 1, 3 * SLICE + 5)
#: (rows, cols) of BitDP gradients: one long row, many short ones, rows that are no slice multiple
SHAPES = ((1, MIN_NUMEL + 3), (64, 1031), (1024, 1024), (3, SLICE + 7), (SLICE // 100 + 1, 203))
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@pytest.fixture
def switch():
    """The process-wide switch, off again afterwards."""
    yield compiled.use_compiled
    compiled.use_compiled(False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its width, so that ``torch.equal`` compares bits (-0.0, NaN payloads)."""
    if t.dtype.is_floating_point:
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _same(a, b) -> None:
    if isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
        return
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(_bits(a), _bits(b))


def _both(fn, *args, **kwargs):
    """``fn`` eager, then compiled: both results (the compiled one really compiled: no chain fell
    back to eager, which a failed compile or a first call unlike eager would make it do)."""
    compiled.use_compiled(False)
    eager = fn(*args, **kwargs)
    compiled.use_compiled(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = fn(*args, **kwargs)
        fell_back = [str(w.message) for w in caught if "compile_codecs" in str(w.message)]
        assert not fell_back and not compiled._failed, fell_back or compiled._failed
        return eager, got
    finally:
        compiled.use_compiled(False)


def _values(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Gaussian values with every special case sprinkled in: exact zeros of both signs,
    subnormals (float32's), large values, and values on rounding ties."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    x[::97] = 0.0
    x[5::89] = -0.0
    x[7::101] = 1e-40
    x[9::103] = -3e-39
    x[11::997] = 1e4
    x[13::991] = -2.5  # a tie for p = inf below
    return x.to(dtype)


# -- fast: the switch, the config field, the fallback ------------------------------------------


def test_switch_is_off_by_default_and_config_field_reaches_it():
    assert compiled.compiled_enabled() is False and LowBitConfig().compile_codecs is False
    assert LowBitConfig(compile_codecs=True).to_dict()["compile_codecs"] is True
    assert LowBitConfig.from_env({"LOWBIT_COMPILE_CODECS": "1"}).compile_codecs is True
    assert LowBitConfig.from_dict({"compile_codecs": "false"}).compile_codecs is False


def test_a_failing_compiler_warns_once_and_the_eager_codecs_serve(switch, monkeypatch):
    def broken(fn):
        def call(*args):
            raise RuntimeError("no C++ compiler")

        return call

    monkeypatch.setattr(compiled, "_compile", broken)
    monkeypatch.setattr(compiled, "_chains", {})
    monkeypatch.setattr(compiled, "_failed", set())
    x = _values(MIN_NUMEL + 5)
    expected = lp_quantize(x, 8, 1)
    switch(True)
    with pytest.warns(RuntimeWarning, match=r"compile_codecs.*no C\+\+ compiler.*eager codecs are used"):
        _same(lp_quantize(x, 8, 1), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the failed chain is not tried again
        _same(lp_quantize(x, 8, 1), expected)
    assert compiled._failed == {"lp_quantize |x|"}  # the first chain of p = 1


def test_a_chain_unlike_eager_on_its_first_call_is_dropped_and_the_eager_codecs_serve(switch, monkeypatch):
    # a miscompiled kernel (inductor's cache once served one built for another ATEN_CPU_CAPABILITY:
    # zeros): the codec's result and the input it updates in place are eager's, with one warning
    def zeros(fn):
        return lambda *args: torch.zeros_like(fn(*args))

    def corrupts_its_input(fn):
        def call(*args):
            out = fn(*args)
            args[0].add_(1.0)
            return out

        return call

    x = _values(MIN_NUMEL + 5)
    for wrong, codec, name in ((zeros, lambda: lp_quantize(x, 8, 2.0), "lp_quantize"),
                               (corrupts_its_input, lambda: _signs(x), "scaled_sign_compress")):
        monkeypatch.setattr(compiled, "_compile", wrong)
        monkeypatch.setattr(compiled, "_chains", {})
        monkeypatch.setattr(compiled, "_failed", set())
        switch(False)
        expected = codec()
        switch(True)
        with pytest.warns(RuntimeWarning, match=rf"compiled {name} codec chain gave other bits than eager"):
            _same(codec(), expected)
        assert compiled._failed == {name}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # dropped: not tried again
            _same(codec(), expected)


def _signs(x):
    """1-bit compression of a copy of ``x``: the packed signs and the updated error (in place)."""
    v, error = x.clone(), torch.zeros_like(x)
    bits, scale = scaled_sign_compress(v, error, nbytes=-(-v.numel() // 8))
    return bits, scale, error


def test_small_and_non_cpu_inputs_stay_eager(switch, monkeypatch):
    monkeypatch.setattr(compiled, "_compile", lambda fn: pytest.fail("compiled a chain for a small input"))
    switch(True)
    x = _values(MIN_NUMEL - 1)
    lp_quantize(x, 8, 1)
    channel_encode(x, 2)
    scaled_sign_compress(x, torch.zeros(x.numel()))


def test_bad_arguments_raise_as_in_eager_before_anything_compiles(switch, monkeypatch):
    monkeypatch.setattr(compiled, "_compile", lambda fn: pytest.fail("compiled a chain for bad arguments"))
    switch(True)
    x = _values(MIN_NUMEL)
    with pytest.raises(ValueError, match="p must be one of 0, 1, 2, inf, got 3"):
        lp_quantize(x, 8, 3)
    with pytest.raises(TypeError, match="floating-point"):
        lp_quantize(torch.ones(MIN_NUMEL, dtype=torch.int32), 8, 1)
    x[5] = float("nan")
    with pytest.raises(ValueError, match="input contains NaN or Inf"):
        lp_quantize(x, 8, 2)


# -- slow: compiled against eager ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("n", SIZES)
def test_lp_quantize_compiled_is_eager_bit_for_bit(n, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = _values(n)
        for p in (1.0, 0.0, 2.0, float("inf")):
            _same(*_both(lp_quantize, x, 8, p))
        _same(*_both(lp_quantize, x.view(-1, 1) if n % 2 else x.view(2, -1), 4, 1.0))  # shapes kept
        _same(*_both(lp_quantize, x, 16, 1.0))  # int16 codes
        _same(*_both(lp_quantize_levels, x, 5, 1.0))  # a summed allreduce's levels
    finally:
        torch.set_num_threads(old)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_lp_quantize_compiled_every_dtype_ties_and_edges(dtype):
    n = SLICE + 9
    _same(*_both(lp_quantize, _values(n, dtype), 8, 1.0))
    # p = inf with max |x| = 63.5: scale exactly 1, so every x.5 is a round-half-even tie
    ties = (torch.arange(n, dtype=torch.float32) % 128 - 63.5).to(dtype)
    _same(*_both(lp_quantize, ties, 8, float("inf")))
    _same(*_both(lp_quantize, torch.zeros(n, dtype=dtype), 8, 1.0))  # M_p = 0: all codes 0
    _same(*_both(lp_quantize, -torch.zeros(n, dtype=dtype), 8, 1.0))
    if dtype in (torch.float32, torch.float64):  # all subnormal: the overflowing scale of the docstring
        _same(*_both(lp_quantize_levels, torch.full((n,), 1e-42, dtype=dtype), 127, 1.0, validate=False))


@pytest.mark.slow
def test_lp_quantize_compiled_refuses_non_finite_input_as_eager_does(switch):
    switch(True)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = _values(SLICE + 3)
        x[SLICE // 3] = bad
        with pytest.raises(ValueError, match="lp_quantize: input contains NaN or Inf"):
            lp_quantize(x, 8, 1)
    # finite values whose sum overflows: the exact scan decides, and they are quantized
    big = torch.full((MIN_NUMEL,), 3e38)
    switch(False)
    expected = lp_quantize(big, 8, 1)
    switch(True)
    _same(lp_quantize(big, 8, 1), expected)


@pytest.mark.slow
@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("shape", SHAPES)
def test_channel_encode_2bit_compiled_is_eager_bit_for_bit(shape, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = _values(shape[0] * shape[1], seed=1).view(shape)
        _same(*_both(channel_encode, g, 2))
        g[0] = 0.0  # a row with nothing kept: scale 0
        _same(*_both(channel_encode, g, 2))
        if shape[0] == 1:
            _same(*_both(channel_encode, g.view(-1), 2))  # 1-D: a single row
    finally:
        torch.set_num_threads(old)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_channel_encode_2bit_compiled_every_dtype(dtype):
    _same(*_both(channel_encode, _values(256 * 1031, dtype, seed=2).view(256, 1031), 2))


def _compress(x: torch.Tensor, error: torch.Tensor, **kwargs):
    """``scaled_sign_compress`` on a copy of ``error``: the bits, the scale and the new error."""
    e = error.clone()
    bits, scale = scaled_sign_compress(x, e, **kwargs)
    return bits, scale, e


@pytest.mark.slow
@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("n", SIZES)
def test_scaled_sign_compress_compiled_is_eager_bit_for_bit(n, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, error = _values(n, seed=3), _values(n, seed=4) * 0.01
        _same(*_both(_compress, x, error))
        _same(*_both(_compress, x, error, nbytes=-(-n // 8) + 13))  # padded to whole chunks
        _same(*_both(_compress, torch.zeros(n), torch.zeros(n)))  # scale 0, errors stay 0
        _same(*_both(_compress, -torch.zeros(n), torch.zeros(n)))
    finally:
        torch.set_num_threads(old)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_sign_compress_compiled_every_dtype(dtype):
    n = 2 * SLICE + 3
    _same(*_both(_compress, _values(n, dtype, seed=5), _values(n, seed=6) * 0.01))


# -- slow: a 2-rank training through the config ------------------------------------------------


def _train(rank: int, world_size: int) -> None:
    """Lion (L_p 8-bit) and BitDP (2-bit) for 3 steps, eager then with ``compile_codecs=True``:
    the same weights bit for bit, and the compiled run did go through the chains."""
    runs = [
        ("lion", dict(mode="lp", bits=8), lambda ps: lowbit_strategy.Lion(ps, lr=1e-3), "lp_quantize"),
        ("bitdp", dict(bits=2), lambda ps: torch.optim.SGD(ps, lr=0.1), "channel_encode"),
    ]
    for algorithm, fields, make_optimizer, chain in runs:
        weights = {}
        for flag in (False, True):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 4))
            ddp = nn.parallel.DistributedDataParallel(net)
            opt = make_optimizer(ddp.parameters())
            lowbit_strategy.attach(ddp, [opt], LowBitConfig(algorithm=algorithm, compile_codecs=flag, **fields))
            assert compiled.compiled_enabled() is flag
            for step in range(1, 4):
                gen = torch.Generator().manual_seed(100 * step + rank)
                x, y = torch.randn(8, 512, generator=gen), torch.randint(0, 4, (8,), generator=gen)
                opt.zero_grad()
                nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
            weights[flag] = [p.detach().clone() for p in net.parameters()]
        assert any(key[0] == chain for key in compiled._chains), f"{algorithm}: the compiled {chain} chain never ran"
        assert not compiled._failed
        for eager, fast in zip(weights[False], weights[True]):
            _same(eager, fast)


def _inductor_failure_on_one_thread() -> str | None:
    """torch's error when it cannot compile the L_p chain as the ranks run it (one thread, two
    sizes), else None. Under ATEN_CPU_CAPABILITY=default torch 2.13's inductor writes C++ for one
    thread that names ``at::vec`` without declaring it: the codecs fall back to eager there, as
    designed (a RuntimeWarning), and no compiled run exists to compare with eager."""
    threads, chains, failed = torch.get_num_threads(), dict(compiled._chains), set(compiled._failed)
    torch.set_num_threads(1)
    compiled._chains.clear()  # this process's chains were compiled for more threads: compile afresh
    compiled._failed.clear()
    compiled.use_compiled(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n in (MIN_NUMEL, MIN_NUMEL + 4099):
                lp_quantize_levels(torch.randn(n), 127, 1.0)
        return next((str(w.message) for w in caught if "compile_codecs" in str(w.message)), None)
    finally:
        compiled.use_compiled(False)
        compiled._chains.clear()
        compiled._chains.update(chains)
        compiled._failed.clear()
        compiled._failed.update(failed)
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_two_rank_training_with_compile_codecs_equals_eager():
    failure = _inductor_failure_on_one_thread()
    if failure is not None:  # torch cannot compile here: no compiled run to compare (the fallback is tested above)
        pytest.skip(f"torch.compile cannot build the codec chains on this machine: {failure[:300]}")
    run_ranks(2, _train)
