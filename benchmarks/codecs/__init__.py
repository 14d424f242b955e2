"""Codec studies: every codec's throughput (``python -m benchmarks.codecs``), and
``python -m benchmarks.codecs.<name>`` for BitDP's CPU cost (``bitdp``), TurboQuant's error and
kernels (``turboquant_mse``, ``turboquant_kernels``), operator calls per bucket
(``ops_per_bucket``), one sync per mode (``sync``) and the optimizer step (``optim_step``)."""
