"""Model quality per algorithm (``python -m benchmarks.quality``), and activation compression's
memory and loss (``python -m benchmarks.quality.activation_memory``)."""
