"""``codecs.device_cache``: a per-device stream grows at least 2x when asked for more, is
drawn once per growth, and is the same tensor while it covers what is asked (on a CPU the
copy and the wait are plain; the CUDA path is the GPU check's, part 3)."""

import torch

from lowbit_strategy.codecs.device_cache import grown, ready, to_device


def test_a_stream_grows_at_least_twofold_and_is_reused_while_it_covers():
    draws = []

    def draw(length):
        draws.append(length)
        return torch.arange(length, dtype=torch.float32)

    cache: dict = {}
    cpu = torch.device("cpu")
    first = grown(cache, cpu, 10, draw)
    assert draws == [16] and torch.equal(first, torch.arange(16.0))  # whole bytes of packed bits
    assert grown(cache, cpu, 16, draw) is first and draws == [16]  # covered: no new draw
    bigger = grown(cache, cpu, 17, draw)
    assert draws == [16, 32] and bigger.numel() == 32  # at least twice the old length
    bits = grown({}, cpu, 20, lambda length: torch.zeros(length // 8, dtype=torch.uint8))
    assert bits.numel() == 3  # packed bits count 8 elements a byte


def test_on_a_cpu_the_copy_and_the_wait_are_plain():
    t = torch.ones(3)
    moved = to_device(t, torch.device("cpu"))
    assert ready(moved) is moved and not hasattr(moved, "_lowbit_copied")
