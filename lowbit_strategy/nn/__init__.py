"""Layers that compress what training keeps for backward.

``TurboQuantLinear`` ("TurboQuant-Adam"'s activation compression): an ``nn.Linear`` that
keeps its input for the weight gradient as TurboQuant codes (4 bits per element plus a
float32 scale per block) instead of the full tensor; forward and the input gradient are
exact. ``compress_activations(model)`` swaps a model's linear layers in place (the output
head left alone by default), ``decompress_activations`` swaps them back, and
``SavedTensorMeter`` counts the bytes a forward pass keeps for backward with and without.

::

    from lowbit_strategy.nn import compress_activations, SavedTensorMeter
    compress_activations(model)                 # before building the optimizer
    with SavedTensorMeter(model) as meter:
        loss = loss_fn(model(x), y)
    loss.backward()
    print(meter.stats.total_bytes, meter.stats.total_bytes_uncompressed)

Lightning: ``callbacks.ActivationCompression``. Imports torch only.
"""

from lowbit_strategy.nn.linear import TurboQuantLinear, default_block
from lowbit_strategy.nn.memory import SavedTensorMeter, SavedTensorStats
from lowbit_strategy.nn.swap import compress_activations, decompress_activations, select_linears

__all__ = [
    "TurboQuantLinear",
    "SavedTensorMeter",
    "SavedTensorStats",
    "compress_activations",
    "decompress_activations",
    "default_block",
    "select_linears",
]
