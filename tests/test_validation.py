"""The strict integer checks of :mod:`lowbit_strategy.validation` that function and constructor
arguments share (config fields have their own converters, tested in test_config.py)."""

import numpy as np
import pytest
import torch

from lowbit_strategy.validation import check_int, is_int


def test_is_int_takes_python_ints_only():
    assert is_int(3) and is_int(-3) and is_int(0, 0) and is_int(8, 2, 8)
    for value in (True, False, 3.0, "3", np.int64(3), torch.tensor(3), None):
        assert not is_int(value), value
    assert not is_int(1, 2) and not is_int(9, 2, 8) and not is_int(-1, 0)


def test_check_int_names_the_caller_the_argument_the_value_and_the_range():
    assert check_int("F", "n", 7, 1) == 7
    with pytest.raises(ValueError, match=r"^F: n must be a positive int, got 0$"):
        check_int("F", "n", 0, 1)
    with pytest.raises(ValueError, match=r"^F: every must be an int >= 0, got True$"):
        check_int("F", "every", True, 0)
    with pytest.raises(ValueError, match=r"^F: bits must be an int in \[2, 8\] \(4 is the paper's\), got 8.0$"):
        check_int("F", "bits", 8.0, 2, 8, what=" (4 is the paper's)")
    with pytest.raises(ValueError, match=r"^F: seed must be an int in \[0, 2\*\*63 - 1\], got -1$"):
        check_int("F", "seed", -1, 0, 2**63 - 1)
    with pytest.raises(ValueError, match=r"in \[1, 32767\], got 'x'$"):
        check_int("F", "levels", "x", 1, 2**15 - 1)
