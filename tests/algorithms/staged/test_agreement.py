"""What the staged optimizers' ranks agree on (:mod:`lowbit_strategy.algorithms.staged.agreement`):
the NaN/Inf test and the verdict levels, on one process (across ranks: the distributed tests
of each algorithm, NaN on one rank skipping the step everywhere)."""
import torch

from lowbit_strategy.algorithms.staged.agreement import ALARM, SKIP, any_nonfinite, verdict_level


def test_any_nonfinite_is_isfinite_all():
    """The staged optimizers' NaN/Inf test (a sum per tensor, max/min when a sum is not
    finite) answers as ``isfinite(t).all()`` does: NaN and ±Inf anywhere (the vectorized
    body and the tail), finite values whose sum overflows, 16-bit and empty tensors."""
    gen = torch.Generator().manual_seed(0)
    for n in (1, 7, 33, 1000):
        for pos in (0, n // 2, n - 1):
            for bad in (float("nan"), float("inf"), -float("inf")):
                for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
                    x = torch.randn(n, generator=gen).to(dtype)
                    x[pos] = bad
                    assert any_nonfinite([torch.ones(3), x, torch.zeros(0)]), (n, pos, bad, dtype)
    big = torch.full((4,), 3e38)  # finite, its float32 sum is not
    assert not any_nonfinite([big, torch.full((8,), 6e4, dtype=torch.float16), torch.randn(5, 5)])
    assert not any_nonfinite([]) and not any_nonfinite([torch.zeros(0)])


def test_the_verdict_level_is_skip_over_alarm_over_nothing():
    no, yes = torch.tensor(False), torch.tensor(True)
    assert verdict_level([], None) == 0
    assert verdict_level([no, no], torch.tensor(False)) == 0
    assert verdict_level([no], torch.tensor(True)) == ALARM
    assert verdict_level([no, yes], torch.tensor(True)) == SKIP > ALARM
    assert verdict_level([yes], None) == SKIP
