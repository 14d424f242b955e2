"""BitDP's per-run state: :class:`BitDPState` (the configuration, validated on construction;
which parameters are quantized; the bucket split and its cache; residuals, server errors and the
form chosen once per run; checkpoints) and :class:`BucketSplit` (how one bucket splits). The hook
that uses them, and what each part means (warm-up, non-finite flags, error feedback, forms,
checkpoints), is :mod:`.hook`, BitDP Algorithm 1."""

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lowbit_strategy.algorithms.bitdp import local_state
from lowbit_strategy.algorithms.bitdp.quantized_params import ParamInfo, classify
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives.exact import EXACT_WIRES
from lowbit_strategy.collectives.gathered import DEFAULT_CHUNK_ROWS, REDUCTIONS, PayloadLayout
from lowbit_strategy.collectives.gathered_two_stage import chunking
from lowbit_strategy.pricing.flat import BITDP_FORMS, bitdp_form
from lowbit_strategy.roles import check_patterns
from lowbit_strategy.validation import is_int

logger = logging.getLogger(__name__)

__all__ = ["BitDPState", "BucketSplit"]


def _bad(field: str, value, fix: str) -> ValueError:
    return ValueError(f"BitDPState.{field}: got {value!r}; {fix}")


@dataclass(frozen=True)
class BucketSplit:
    """How one bucket splits: quantized matrices ``(offset, shape, param id)`` and runs of
    consecutive full-precision gradients ``(offset, numel)``; ``transposed`` holds the ids
    of weights stored ``in x out`` (HF Conv1D), whose channels are columns."""

    quantized: tuple[tuple[int, tuple[int, ...], int], ...]
    full: tuple[tuple[int, int], ...]
    param_ids: tuple[int, ...]  # the bucket's parameters, in order: validates a cached plan
    transposed: frozenset[int] = frozenset()


class BitDPState:
    """Configuration and state of :func:`bitdp_hook`, validated on construction.

    Args:
        bits: 1 (binary codes, Eq. 5-6) or 2 (ternary codes, Eq. 7-9).
        process_group: the data-parallel group (None: the default group).
        quantize: fnmatch patterns over parameter names replacing the default selection rule
            (linear weights, not embeddings); see :mod:`lowbit_strategy.algorithms.bitdp.quantized_params`.
        exclude: patterns of parameters always sent at full precision (wins over quantize).
        start_iter: iterations of plain mean allreduce before compression starts (>= 2).
        warmup_wire: what those iterations send: ``"fp32"`` (DDP's own mean) or ``"bf16"``
            (torch's ``bf16_compress_hook``'s).
        full_wire: what the gradients BitDP does not quantize send afterwards, as
            ``warmup_wire`` names it (``"fp32"``: Algorithm 1's full-precision allreduce).
        reduction: ``"mean"`` (exact mean of dequantized gradients) or ``"paper"`` (Eq. 10).
        chunk_rows: rows decoded at a time (bounds decode memory); None: whole matrices.
        error_feedback: keep a rank-local residual per quantized parameter (off in BitDP).
        form: ``"auto"``, ``"allgather"`` or ``"two_stage"`` (module docstring, "Forms").
        link: ``(latency seconds, bandwidth bits/s)`` that ``auto`` plans for.
        model: optional; the same as calling :meth:`attach` with it.
        traffic: a :class:`~lowbit_strategy.collectives.TrafficLog` receiving every transfer.
    """

    __slots__ = (
        "bits",
        "process_group",
        "quantize",
        "exclude",
        "start_iter",
        "warmup_wire",
        "full_wire",
        "reduction",
        "chunk_rows",
        "error_feedback",
        "traffic",
        "form",
        "link",
        # internal state
        "iter",
        "params",
        "plans",
        "residuals",
        "forms",
        "server_errors",
        "local_shapes",
    )

    def __init__(
        self,
        bits: int = 2,
        process_group: dist.ProcessGroup | None = None,
        quantize=None,
        exclude=None,
        start_iter: int = 2,
        reduction: str = "mean",
        chunk_rows: int | None = DEFAULT_CHUNK_ROWS,
        error_feedback: bool = False,
        *,
        model: torch.nn.Module | None = None,
        traffic=None,
        form: str = "auto",
        link: tuple[float, float] = (50e-6, 1e9),
        warmup_wire: str = "fp32",
        full_wire: str = "fp32",
    ):
        if isinstance(bits, bool) or bits not in (1, 2):
            raise _bad("bits", bits, "BitDP quantizes gradients to 1 or 2 bits (Sec. 3.1.2); pass bits=1 or bits=2")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise _bad("process_group", process_group, "pass a torch.distributed ProcessGroup or None (default group)")
        if not is_int(start_iter, 2):
            raise _bad(
                "start_iter",
                start_iter,
                "pass an int >= 2: as with PowerSGD's start_powerSGD_iter, at least the first two "
                "iterations (DDP's provisional buckets, then their rebuild) run as a plain allreduce",
            )
        if warmup_wire not in EXACT_WIRES:
            raise _bad("warmup_wire", warmup_wire, "use 'fp32' (DDP's mean) or 'bf16' (torch's bf16_compress_hook's)")
        if full_wire not in EXACT_WIRES:
            raise _bad("full_wire", full_wire, "use 'fp32' (DDP's mean) or 'bf16' (torch's bf16_compress_hook's)")
        if reduction not in REDUCTIONS:
            raise _bad("reduction", reduction, "use 'mean' (exact mean of dequantized gradients) or 'paper' (Eq. 10)")
        if chunk_rows is not None and not is_int(chunk_rows, 1):
            raise _bad("chunk_rows", chunk_rows, "pass a positive number of rows decoded at a time, or None")
        if not isinstance(error_feedback, bool):
            raise _bad("error_feedback", error_feedback, "pass True or False")
        if form not in ("auto", *BITDP_FORMS):
            raise _bad("form", form, "use 'auto', 'allgather' (exact mean) or 'two_stage' (bytes flat in P)")
        if form == "two_stage" and reduction != "mean":
            raise _bad("form", form, "the two-stage form averages exactly (reduction='mean'); use form='allgather'")
        if not (isinstance(link, tuple) and len(link) == 2 and link[0] >= 0 and link[1] > 0):
            raise _bad("link", link, "pass (latency seconds >= 0, bandwidth bits/s > 0)")
        self.bits, self.process_group = int(bits), process_group
        self.quantize = check_patterns("BitDPState.quantize", quantize)
        self.exclude = check_patterns("BitDPState.exclude", exclude)
        self.start_iter, self.reduction, self.chunk_rows = start_iter, reduction, chunk_rows
        self.warmup_wire, self.full_wire = warmup_wire, full_wire
        self.error_feedback, self.traffic = error_feedback, traffic
        self.form, self.link = form, (float(link[0]), float(link[1]))
        self.iter = 0
        # id(parameter) -> what the selection rule decided; filled by attach()
        self.params: dict[int, ParamInfo] = {}
        # (bucket index, bucket numel) -> split of that bucket; robust to DDP's bucket rebuild
        self.plans: dict[tuple[int, int], BucketSplit] = {}
        # id(parameter) -> this rank's quantization residual (error feedback only)
        self.residuals: dict[int, torch.Tensor] = {}
        # the form chosen for this run ("model" -> form); parameter name -> its server error
        self.forms: dict[str, str] = {}
        self.server_errors: dict[str, torch.Tensor] = {}
        # id(parameter) -> the shape this rank holds of it, where sharded (FSDP2): residuals have it
        self.local_shapes: dict[int, tuple[int, ...]] = {}
        if model is not None:
            self.attach(model)

    def attach(self, model: torch.nn.Module) -> "BitDPState":
        """Learn, from ``model``'s modules, which parameters are quantized. Pass the module
        DDP wraps (or the DDP model itself; it is unwrapped). Returns ``self``."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"BitDPState.attach needs an nn.Module, got {type(model).__name__}")
        self.params = classify(model, self.quantize, self.exclude)
        self.plans.clear()
        self.forms.clear()
        n_q = sum(i.quantized for i in self.params.values())
        logger.info("BitDP: %d of %d parameters quantized to %d bits", n_q, len(self.params), self.bits)
        return self

    def state_dict(self) -> dict:
        """What a resume needs (:func:`.local_state.state_dict`): this rank's own, on CPU."""
        return local_state.state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; call after :meth:`attach` (names are resolved
        against the attached model; :func:`.local_state.load_state_dict`)."""
        local_state.load_state_dict(self, state)

    def selection(self) -> dict[str, ParamInfo]:
        """Every parameter's decision by (first) name: ``info.quantized``, ``info.reason``."""
        return {i.name: i for i in self.params.values()}

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count iterations: DDP processes the bucket with ``is_last()`` last in each one."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_iter:
                logger.info("BitDP: compression starts after %d iterations of plain allreduce", self.iter)

    def plan(self, bucket: dist.GradBucket) -> BucketSplit:
        """The split of ``bucket`` into quantized matrices and full-precision runs (cached)."""
        buf, params = bucket.buffer(), bucket.parameters()
        key = (bucket.index(), buf.numel())
        cached = self.plans.get(key)
        if (
            cached is not None
            and len(cached.param_ids) == len(params)
            and all(i == id(p) for i, p in zip(cached.param_ids, params))
        ):
            return cached
        quantized: list[tuple[int, tuple[int, ...], int]] = []
        full: list[tuple[int, int]] = []
        transposed: set[int] = set()
        offset = 0
        for p, view in zip(params, bucket.gradients()):
            info = self.params.get(id(p))
            if info is None or info.shape != tuple(p.shape):
                raise RuntimeError(
                    f"BitDP: bucket {bucket.index()} holds a parameter of shape {tuple(p.shape)} that "
                    "BitDPState does not know; call state.attach(model) with the model DDP wraps"
                )
            if view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
                if view.storage_offset() - buf.storage_offset() != offset:
                    raise RuntimeError(f"BitDP: unexpected layout of DDP bucket {bucket.index()} at {info.name}")
            if info.quantized:
                quantized.append((offset, tuple(p.shape), id(p)))
                if info.transposed:
                    transposed.add(id(p))
            elif p.numel() == 0:
                pass  # nothing to send (a zero-element parameter)
            elif full and full[-1][0] + full[-1][1] == offset:
                full[-1] = (full[-1][0], full[-1][1] + p.numel())
            else:
                full.append((offset, p.numel()))
            offset += p.numel()
        if offset != buf.numel():
            raise RuntimeError(f"BitDP: bucket {bucket.index()} parameters cover {offset} of {buf.numel()} elements")
        self.plans[key] = BucketSplit(
            tuple(quantized), tuple(full), tuple(id(p) for p in params), frozenset(transposed)
        )
        return self.plans[key]

    def form_of(self) -> str:
        """The form of every bucket of this run (module docstring, "Forms"), chosen once."""
        form = self.forms.get("model")
        if form is None:
            p = g.world_size(self.process_group)
            shapes = [(i.shape[1] if i.transposed else i.shape[0]) for i in self.params.values() if i.quantized]
            numel = [math.prod(i.shape) for i in self.params.values() if i.quantized]
            layout = PayloadLayout.of([(r, n // r) for r, n in zip(shapes, numel)], self.bits) if shapes else None
            form = "allgather" if layout is None else bitdp_form(self.form, layout, p, *self.link, self.reduction)
            self.forms["model"] = form
            logger.info("BitDP: %s form at P=%d (form=%s)", form, p, self.form)
        return form

    def server_error(self, plan: BucketSplit, layout: PayloadLayout, device: torch.device) -> torch.Tensor:
        """This rank's server error of a two-stage bucket (:func:`.local_state.server_error`)."""
        names = tuple(self.params[key].name for _, _, key in plan.quantized)
        group = self.process_group
        return local_state.server_error(self, names, chunking(layout, g.world_size(group)), g.rank(group), device)
