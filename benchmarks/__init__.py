"""Benchmarks: codec throughput (:mod:`benchmarks.codecs`), the emulated-network harness
(:mod:`benchmarks.netem`, needs root) and the collective benchmark that uses it
(:mod:`benchmarks.collectives`). Run from the repository root with ``python -m``."""
