"""Single-process DeMo over N workers: what the distributed runs are compared with.

* :func:`demo` — the oracle fed the same codec: every worker is a model of its own in this
  process, trained on the data its rank (or its node's ranks) would see (:mod:`tests.training`);
  the momentum arithmetic, the skip rule, the one-step delay and the sign step are written out
  here; the codec's encode and mean (:class:`~lowbit_strategy.codecs.topk.TopKCodec`) are the
  library's, so the distributed runs must equal it bit for bit (what they add is the exchange,
  the collectives, the hierarchy, the checkpoints).
* :func:`reference_step` — DeMo as its paper and published class state it, written
  independently (DCT basis from its cosine formula, einsum chunking, ``torch.topk``,
  ``scatter_reduce`` mean over everyone's concatenated coefficients): the fp32-values
  optimizer must equal it to rounding.
"""
from __future__ import annotations

import math

import torch

from lowbit_strategy.codecs.topk import TopKCodec
from tests import training

LR, DECAY, TOPK, CHUNK, WD = 0.01, 0.9, 4, 4, 0.1


def make(params, **kw):
    from lowbit_strategy import DeMo

    args = dict(lr=LR, compression_decay=DECAY, compression_topk=TOPK, compression_chunk=CHUNK, weight_decay=WD)
    return DeMo(params, **{**args, **kw})


class Worker:
    def __init__(self, ranks: list[int]):
        self.ranks = ranks
        self.net = training.model()
        self.params = list(self.net.parameters())
        self.delta = [torch.zeros_like(p) for p in self.params]

    def grads(self, step: int, nan: bool = False) -> list[torch.Tensor]:
        """DDP's node mean of the worker's ranks' gradients (each scaled by 1/k, then summed)."""
        per = []
        for r in self.ranks:
            self.net.zero_grad()
            out = training.loss(self.net, r, step)
            if nan and r == 1:
                out = out * float("inf")
            out.backward()
            per.append([p.grad.clone() for p in self.params])
        k = len(self.ranks)
        out = []
        for i in range(len(self.params)):
            total = per[0][i] * (1.0 / k)
            for g in per[1:]:
                total = total + g[i] * (1.0 / k)
            out.append(total)
        return out


def demo(workers: int, steps: int, *, values: str = "fp32", delay: int = 0, ranks_per_node: int = 1,
         nan_at: int | None = None, lr=LR, decay=DECAY, topk=TOPK, chunk=CHUNK, wd=WD) -> list[torch.nn.Module]:
    """Every worker's model after ``steps`` steps of DeMo (module docstring); ``nan_at``: rank 1's
    loss is inf at that step."""
    ws = [Worker(list(range(w * ranks_per_node, (w + 1) * ranks_per_node))) for w in range(workers)]
    codec = TopKCodec([tuple(p.shape) for p in ws[0].params], chunk, topk, values, "cpu")
    pending = None

    def land(flight):
        payloads, sents, bads, lr_t = flight
        if any(bads):
            for w, sent, bad in zip(ws, sents, bads):
                if not bad:
                    for d, s in zip(w.delta, sent):
                        d.add_(s)
            return
        update = codec.mean(torch.stack(payloads), ws[0].params)
        with torch.no_grad():
            for w in ws:
                for p, u in zip(w.params, update):
                    p.mul_(1 - lr_t * wd)
                    p.add_(torch.sign(u), alpha=-lr_t)

    for t in range(1, steps + 1):
        grads = [w.grads(t, nan=(t == nan_at)) for w in ws]  # forward and backward: before the step
        if pending is not None:  # the step first applies the previous step's update (delay 1)
            land(pending)
            pending = None
        payloads, sents, bads = [], [], []
        for w, g in zip(ws, grads):
            bad = not all(bool(torch.isfinite(x).all()) for x in g)
            m = w.delta if bad else [d * decay + x * lr for d, x in zip(w.delta, g)]
            payload, sent, _ = codec.encode(m, bad)
            if not bad:
                for d, mm, s in zip(w.delta, m, sent):
                    torch.sub(mm, s, out=d)
            payloads.append(payload)
            sents.append(sent)
            bads.append(bad)
        flight = (payloads, sents, bads, lr)
        if delay == 0:
            land(flight)
        else:
            pending = flight
    return [w.net for w in ws]


# ---- the paper's DeMo, written independently -------------------------------------------------
def _split(n: int, target: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    below = [d for d in divisors if d <= target]
    return below[-1] if below else divisors[0]


def _basis(n: int) -> torch.Tensor:
    j = torch.arange(n, dtype=torch.float64)
    rows = [torch.cos(math.pi * (2 * j + 1) * k / (2 * n)) * math.sqrt((1 if k == 0 else 2) / n) for k in range(n)]
    return torch.stack(rows, 1).float()  # column k: basis vector k


def _encode(x, target):
    if x.dim() == 1:
        c = _split(x.shape[0], target)
        return torch.einsum("xw,wb->xb", x.reshape(-1, c), _basis(c))
    h, w = _split(x.shape[0], target), _split(x.shape[1], target)
    y = x.reshape(x.shape[0] // h, h, x.shape[1] // w, w)
    return torch.einsum("yhxw,hb,wd->yxbd", y, _basis(h), _basis(w))


def _decode(c):
    if c.dim() == 2:
        return torch.einsum("xb,wb->xw", c, _basis(c.shape[1])).reshape(-1)
    y, x, h, w = c.shape
    out = torch.einsum("yxbd,hb,wd->yhxw", c, _basis(h), _basis(w))
    return out.reshape(y * h, x * w)


def _sparse(c, k):
    flat = c.reshape(*c.shape[:-2], -1) if c.dim() == 4 else c
    k = min(k, flat.shape[-1])
    idx = torch.topk(flat.abs(), k, dim=-1).indices
    return idx, torch.gather(flat, -1, idx)


def _dense(shape, idx, val):
    flat_shape = (*shape[:-2], shape[-2] * shape[-1]) if len(shape) == 4 else shape
    out = torch.zeros(flat_shape).scatter_reduce(-1, idx, val, reduce="mean", include_self=False)
    return out.reshape(shape)


def reference_step(params_per_worker, deltas_per_worker, grads_per_worker, *, lr, decay, topk, chunk, wd):
    """One DeMo step of every worker, in place (module docstring); returns each parameter's
    update before its sign (the decoded mean), for telling near-ties from differences."""
    updates = []
    sent_idx, sent_val = [], []
    for deltas, grads in zip(deltas_per_worker, grads_per_worker):
        idxs, vals = [], []
        for d, g in zip(deltas, grads):
            d.mul_(decay).add_(g, alpha=lr)
            c = _encode(d, chunk)
            idx, val = _sparse(c, topk)
            d.sub_(_decode(_dense(c.shape, idx, val)).reshape(d.shape))
            idxs.append(idx)
            vals.append(val)
        sent_idx.append(idxs)
        sent_val.append(vals)
    for i, d in enumerate(deltas_per_worker[0]):
        shape = _encode(d, chunk).shape
        idx = torch.cat([s[i] for s in sent_idx], -1)
        val = torch.cat([s[i] for s in sent_val], -1)
        mean = _decode(_dense(shape, idx, val)).reshape(d.shape)
        updates.append(mean)
        update = torch.sign(mean)
        with torch.no_grad():
            for params in params_per_worker:
                params[i].mul_(1 - lr * wd).add_(update, alpha=-lr)
    return updates
