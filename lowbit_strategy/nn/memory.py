"""How many bytes a forward pass keeps for backward, and how many compression saved.

:class:`SavedTensorMeter` counts every tensor autograd saves while it is active
(``torch.autograd.graph.saved_tensors_hooks``), by *storage*: a storage saved several
times (a view saved by two ops, one input read by three linear layers) counts once, with
its full size, because that is what stays allocated until backward. Storages of the
model's parameters and buffers are left out (they are allocated anyway; this is activation
memory).

Two parts of the total are told apart:

* **linear inputs**: what ``nn.Linear`` layers keep of their input (the input's storage,
  recognized by a forward pre-hook on each ``nn.Linear``; under autocast ``nn.Linear``
  keeps a cast copy, which is then counted as *other*), and what
  :class:`~lowbit_strategy.nn.TurboQuantLinear` layers keep instead (codes and scales);
* for each input a ``TurboQuantLinear`` compressed, the bytes its storage would have kept
  uncompressed, so the meter also gives the total **without** compression from the same
  pass: ``total - codes and scales + the inputs' storages`` (each storage once, and not
  if something else saved it anyway).

While active, the meter holds a reference to every compressed input (to recognize its
storage if another op saves it), so during the measured pass those inputs live until
:meth:`SavedTensorMeter.stop`: stop it before backward (and measure one step, not all
of them); its counts are exact, the memory high-water mark of that one pass is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lowbit_strategy.nn import linear as _linear

__all__ = ["SavedTensorMeter", "SavedTensorStats"]


@dataclass(frozen=True)
class SavedTensorStats:
    """Bytes kept for backward by one measured pass (see the module doc).

    ``total_bytes``: every saved storage, parameters and buffers excluded;
    ``linear_input_bytes``: of which linear layers' inputs or their codes and scales;
    ``compressed_inputs``: calls of ``TurboQuantLinear`` that kept codes;
    ``total_bytes_uncompressed`` / ``linear_input_bytes_uncompressed``: the same pass with
    every ``TurboQuantLinear`` keeping its input as ``nn.Linear`` does.
    """

    total_bytes: int
    linear_input_bytes: int
    compressed_inputs: int
    total_bytes_uncompressed: int
    linear_input_bytes_uncompressed: int

    @property
    def saved_bytes(self) -> int:
        """Bytes compression kept out of memory in this pass."""
        return self.total_bytes_uncompressed - self.total_bytes

    @property
    def linear_input_ratio(self) -> float:
        """How many times fewer bytes the linear inputs take (1.0 when there are none)."""
        return self.linear_input_bytes_uncompressed / self.linear_input_bytes if self.linear_input_bytes else 1.0


def _storage_key(t: torch.Tensor) -> tuple[str, int, int]:
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr(), s.nbytes())


class SavedTensorMeter:
    """``SavedTensorMeter(model=None)``: counts the bytes autograd saves between
    :meth:`start` and :meth:`stop` (or inside ``with``); ``model``'s parameters and buffers
    are excluded, and its ``nn.Linear`` layers' inputs are told apart. :attr:`stats` holds
    the result after :meth:`stop`.

    ::

        with SavedTensorMeter(model) as meter:
            loss = loss_fn(model(x), y)
        loss.backward()
        meter.stats.total_bytes, meter.stats.total_bytes_uncompressed
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"SavedTensorMeter: model must be an nn.Module or None, got {type(model).__name__}")
        self.model = model
        self.stats: SavedTensorStats | None = None
        self._hooks_ctx: torch.autograd.graph.saved_tensors_hooks | None = None
        self._handles: list = []
        self._reset()

    def _reset(self) -> None:
        self._saved: dict[tuple, int] = {}  # storage key -> nbytes
        self._linear_inputs: set[tuple] = set()  # storage keys of nn.Linear inputs
        self._payload: set[tuple] = set()  # storage keys of TurboQuantLinear codes/scales
        self._compressed: list[torch.Tensor] = []  # inputs TurboQuantLinear compressed (refs, see doc)
        self._excluded: set[tuple] = set()
        self._keep: list[torch.Tensor] = []  # nn.Linear inputs, kept so their addresses stay theirs

    # -- hooks ------------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor):
        key = _storage_key(t)
        if key not in self._excluded:
            self._saved[key] = key[2]
        return t

    @staticmethod
    def _unpack(t):
        return t

    def _pre_hook(self, module, args):
        if args and isinstance(args[0], torch.Tensor) and not isinstance(module, _linear.TurboQuantLinear):
            self._linear_inputs.add(_storage_key(args[0]))
            self._keep.append(args[0])

    def add_compressed(self, codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> None:
        """Called by ``TurboQuantLinear`` for each input it compresses while this meter runs."""
        self._payload.add(_storage_key(codes))
        self._payload.add(_storage_key(scales))
        self._compressed.append(x)

    # -- API --------------------------------------------------------------------------------

    def start(self) -> SavedTensorMeter:
        """Start counting (from zero)."""
        if self._hooks_ctx is not None:
            raise RuntimeError("SavedTensorMeter.start: already started; call stop() first")
        self._reset()
        self.stats = None
        if self.model is not None:
            for t in [*self.model.parameters(), *self.model.buffers()]:
                self._excluded.add(_storage_key(t))
            for m in self.model.modules():
                if isinstance(m, nn.Linear):
                    self._handles.append(m.register_forward_pre_hook(self._pre_hook))
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()
        _linear.RECORDERS.append(self)
        return self

    def stop(self) -> SavedTensorStats:
        """Stop counting; returns (and keeps in :attr:`stats`) the counts. Call it on the
        thread that called :meth:`start`, after the forward pass, before backward."""
        if self._hooks_ctx is None:
            raise RuntimeError("SavedTensorMeter.stop: not started; call start() first")
        _linear.RECORDERS.remove(self)
        self._hooks_ctx.__exit__(None, None, None)
        self._hooks_ctx = None
        for h in self._handles:
            h.remove()
        self._handles = []
        total = sum(self._saved.values())
        linear = sum(n for k, n in self._saved.items() if k in self._linear_inputs or k in self._payload)
        payload = sum(n for k, n in self._saved.items() if k in self._payload)
        compressed = {_storage_key(x) for x in self._compressed}
        # an input whose storage something else saves anyway costs nothing more uncompressed
        raw_total = sum(k[2] for k in compressed if k not in self._saved and k not in self._excluded)
        # ... but is then a linear input too (nn.Linear would keep that same storage)
        shared = sum(
            n
            for k, n in self._saved.items()
            if k in compressed and k not in self._linear_inputs and k not in self._payload
        )
        self.stats = SavedTensorStats(
            total_bytes=total,
            linear_input_bytes=linear,
            compressed_inputs=len(self._compressed),
            total_bytes_uncompressed=total - payload + raw_total,
            linear_input_bytes_uncompressed=linear - payload + raw_total + shared,
        )
        self._compressed, self._keep = [], []
        return self.stats

    def __enter__(self) -> SavedTensorMeter:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
