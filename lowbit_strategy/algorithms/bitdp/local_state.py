"""BitDP's rank-local state in checkpoints: the hook's iteration count, this rank's
error-feedback residuals and its two-stage server errors, both by parameter name. A server
error holds the rows of a parameter this rank owns in the two-stage form (which depend only
on the parameter's shape and P, :mod:`lowbit_strategy.collectives.gathered_two_stage`), so
it survives DDP's bucket rebuild and a restart at the same world size."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lowbit_strategy.collectives.gathered_two_stage import Chunking
from lowbit_strategy.validation import check_int

if TYPE_CHECKING:  # (hook.py imports this module)
    from lowbit_strategy.algorithms.bitdp.hook import BitDPState


#: the state's layout version (states written before the key are format 1, the same layout)
FORMAT = 1


def state_dict(state: BitDPState) -> dict:
    """``{"format": 1, "iter": int, "residuals": {param name: tensor}, "server_errors": {param
    name: flat tensor of the rows this rank owns}}``, this rank's own (copies on CPU)."""
    names = {k: info.name for k, info in state.params.items()}
    return {
        "format": FORMAT,
        "iter": state.iter,
        "residuals": {names[k]: r.detach().cpu().clone() for k, r in state.residuals.items() if k in names},
        "server_errors": {k: e.detach().cpu().clone() for k, e in state.server_errors.items()},
    }


def load_state_dict(state: BitDPState, sd: dict) -> None:
    """Restore :func:`state_dict`'s output into ``state`` (attached). Residuals and server
    errors move to the gradients' device on first use; a state without ``server_errors``
    (written before the two-stage form existed) starts them at zero."""
    if not state.params:
        raise RuntimeError("BitDPState.load_state_dict: call attach(model) first, so parameter names resolve")
    version = sd.get("format", 1) if isinstance(sd, dict) else FORMAT  # not a dict: the 'iter' check names it
    if version != FORMAT:
        raise ValueError(
            f"BitDPState.load_state_dict: the state has format {version!r}; this version reads format {FORMAT}: "
            "resume with the lowbit-strategy version that wrote it"
        )
    it = check_int("BitDPState.load_state_dict", "'iter'", sd.get("iter") if isinstance(sd, dict) else None, 0)
    by_name = {name: (k, info) for k, info in state.params.items() for name in info.names}
    residuals = {}
    for name, tensor in sd.get("residuals", {}).items():
        if name not in by_name:
            raise KeyError(f"BitDPState.load_state_dict: residual for unknown parameter {name!r}")
        key, info = by_name[name]
        if not info.quantized or tuple(tensor.shape) not in (info.shape, state.local_shapes.get(key)):
            raise ValueError(
                f"BitDPState.load_state_dict: residual of {name!r} has shape {tuple(tensor.shape)}; "
                f"the model's is {info.shape} and {'quantized' if info.quantized else 'not quantized'}"
            )
        residuals[key] = tensor.float()
    server_errors = {}
    quantized = {i.name for i in state.params.values() if i.quantized}
    for name, tensor in sd.get("server_errors", {}).items():
        if name not in quantized or not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"BitDPState.load_state_dict: server error of {name!r}: keys must be the model's quantized "
                "parameter names, values tensors"
            )
        server_errors[name] = tensor.float().reshape(-1).contiguous()
    state.iter, state.residuals, state.server_errors = it, residuals, server_errors


def server_error(state: BitDPState, names: tuple[str, ...], plan: Chunking, rank: int, device) -> torch.Tensor:
    """This rank's server error of a two-stage payload whose matrices are the parameters
    ``names``, as the flat buffer the collective updates in place: the parameters' entries
    (zeros at first, a checkpoint's after a resume) concatenated in the chunk's piece order;
    each parameter's entry then becomes a view of it. An entry of another length (a
    checkpoint of another world size) is an error naming the fix."""
    parts, sizes = [], []
    for k, a, b in plan.pieces[rank]:
        n = (b - a) * plan.layout.shapes[k][1]
        e = state.server_errors.get(names[k])
        if e is not None and e.numel() != n:
            raise ValueError(
                f"BitDP: the checkpoint's server error of {names[k]!r} has {e.numel()} elements, this rank's rows "
                f"of it {n}: resume at the world size the checkpoint was written with"
            )
        parts.append(torch.zeros(n, dtype=torch.float32, device=device) if e is None else e.reshape(-1).to(device))
        sizes.append(n)
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32, device=device)
    for (k, _, _), view in zip(plan.pieces[rank], flat.split(sizes)):
        state.server_errors[names[k]] = view
    return flat
