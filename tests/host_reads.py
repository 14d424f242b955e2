"""Counting host reads of tensors (``item``, ``bool(t)``, ``tolist``, ``nonzero``, ``.cpu()``,
...) while a phase is open: on CUDA each such read waits for every kernel queued before it.

Used by ``tests/integrations/test_host_syncs.py`` (no host reads during backward, on CPU
ranks) and by ``benchmarks/gpu_check`` (the same count on CUDA ranks). The Python entry
points of ``torch.Tensor`` (and ``torch.nonzero``) are wrapped while the counter is entered;
every call made while a phase is open is counted, from any thread (DDP's hooks run on
autograd's threads).
"""

import threading
import traceback

import torch

#: torch.Tensor methods that read a tensor's value on the host
READS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy", "nonzero", "cpu")


class HostReads:
    """Counts calls of ``names`` (default :data:`READS`) (and ``torch.nonzero``) made while a phase is open."""

    def __init__(self, names: tuple[str, ...] = READS):
        self.names = names
        self.phase: str | None = None
        self.counts: dict[str, int] = {}
        self.where: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._saved = {}

    def _wrap(self, orig):
        def counted(*args, **kwargs):
            phase = self.phase
            if phase is not None:
                with self._lock:
                    self.counts[phase] = self.counts.get(phase, 0) + 1
                    self.where.setdefault(phase, []).append("".join(traceback.format_stack(limit=6)[:-1]))
            return orig(*args, **kwargs)

        return counted

    def __enter__(self):
        for name in self.names:
            self._saved[(torch.Tensor, name)] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name)))
        self._saved[(torch, "nonzero")] = torch.nonzero
        torch.nonzero = self._wrap(torch.nonzero)
        return self

    def __exit__(self, *exc):
        for (owner, name), orig in self._saved.items():
            setattr(owner, name, orig)

    def run(self, phase: str, fn):
        self.phase = phase
        try:
            return fn()
        finally:
            self.phase = None

    def take(self, phase: str) -> tuple[int, list[str]]:
        with self._lock:
            return self.counts.pop(phase, 0), self.where.pop(phase, [])
