"""Constant tensors a codec builds on the CPU and keeps on each device it meets (TurboQuant's
level tables and rotation-sign streams), moved there without a host sync.

They first reach a GPU inside DDP's hooks, during backward, where a pageable host-to-device
copy would synchronize the host with the GPU; and they are read afterwards from several
streams (the compute stream, the side stream, gloo's callback streams). So :func:`to_device`
copies through pinned memory asynchronously and records an event, and :func:`ready` makes
whichever stream reads the tensor wait for that event: a device-side wait, no host read.
On a CPU both are plain.
"""

from __future__ import annotations

import torch


def grown(cache: dict[torch.device, torch.Tensor], device: torch.device, n: int, draw) -> torch.Tensor:
    """``cache[device]``, first grown (``draw(length)`` on the CPU, at least 2x the old length,
    copied to ``device`` once) until it covers ``n`` elements (``n / 8`` bytes for packed bits:
    ``draw`` returns either; a stream only ever grows)."""
    have = cache.get(device)
    covered = 0 if have is None else have.numel() * (8 if have.dtype == torch.uint8 else 1)
    if have is None or covered < n:
        have = cache[device] = to_device(draw(-(-max(n, 2 * covered) // 8) * 8), device)
    return ready(have)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """CPU ``t`` on ``device``; to a GPU through pinned memory, asynchronously. A pageable
    copy synchronizes the host with the GPU, and the codec's tables and sign streams reach
    a device inside DDP's hooks, during backward (2 to 6 syncs per run, found on an H100 by
    ``benchmarks/gpu_check`` part 3). The caching host allocator keeps the pinned block
    until the copy has run; an event recorded after the copy lets every stream that later
    reads the cached tensor wait for it (:func:`ready`)."""
    if device.type != "cuda":
        return t.to(device)
    out = t.pin_memory().to(device, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(device))
    out._lowbit_copied = copied  # type: ignore[attr-defined]
    return out


def ready(t: torch.Tensor) -> torch.Tensor:
    """``t``, once the current stream waits for its copy (:func:`to_device`). The caches
    are read from the compute stream, the side stream and gloo's callback streams, and the
    copy ran on whichever stream first asked: a device-side wait, no host sync."""
    copied = getattr(t, "_lowbit_copied", None)
    if copied is not None:
        torch.cuda.current_stream(t.device).wait_event(copied)
    return t


def made_here(t: torch.Tensor) -> torch.Tensor:
    """``t``, computed on the device by the current stream, marked so that :func:`ready` makes
    any other stream that later reads it (from a cache) wait for that computation: an event
    recorded now, as :func:`to_device` records one after its copy. A no-op off CUDA."""
    if t.is_cuda:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(t.device))
        t._lowbit_copied = done  # type: ignore[attr-defined]
    return t


def remember(cache: dict, key, make, most: int = 64) -> torch.Tensor:
    """``cache[key]``, made by ``make()`` (marked by :func:`made_here`) the first time; the
    oldest entry is dropped past ``most`` (layouts repeat every step: a few entries serve a
    run). Returned through :func:`ready`."""
    hit = cache.get(key)
    if hit is None:
        hit = made_here(make())  # (make may fill the cache itself)
        while len(cache) >= most:
            cache.pop(next(iter(cache)))
        cache[key] = hit
    return ready(hit)
