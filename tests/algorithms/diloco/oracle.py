"""A single-process DiLoCo over N workers: the oracle the distributed runs are compared with.

Every worker is a model of its own in this process, trained on the data its rank (or its
node's ranks) would see (:mod:`tests.training`), with its own inner AdamW; after the steps
the schedule names, the workers' pseudo-gradients are averaged by the same codec calls the
exchange makes (encode, decode, the ranks' fixed summation order), with each worker's error
buffer, and the outer Nesterov SGD is written out here, not imported.
"""
from __future__ import annotations

import torch

from lowbit_strategy.algorithms.diloco import exchange as ex
from lowbit_strategy.algorithms.diloco import fragments as frag
from lowbit_strategy.codecs import blockwise
from lowbit_strategy.codecs.reduce import divide, rank_sum
from lowbit_strategy.codecs.turboquant import TurboQuantCodec
from lowbit_strategy.collectives import gathered
from lowbit_strategy.collectives.compensated import server_chunk_length
from lowbit_strategy.collectives.reference import compensated_allreduce_reference, turboquant_mean_reference
from tests import training

BLOCKWISE = {"int8": 8, "int4": 4, "int2": 2}


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, foreach=False)


def mean_of(compression: str, parts: list[torch.Tensor], errors: list, server: list, ef: bool, fragment: int,
            round_: int) -> torch.Tensor:
    """The exchange's mean of the workers' ``parts`` (float32, equal lengths); ``errors`` /
    ``server``: per worker, updated in place."""
    p, m = len(parts), parts[0].numel()
    if compression == "fp32":
        return sum(x * (1.0 / p) for x in parts)
    if compression == "sign":
        if not ef:
            for e in errors:
                e.zero_()
            for s in server:
                s.zero_()
        outs, we, se = compensated_allreduce_reference(parts, errors, server, block=ex.SIGN_BLOCK)
        for e, n in zip(errors, we):
            e.copy_(n)
        for s, n in zip(server, se):
            s.copy_(n)
        return outs[0].float()
    if compression == "turboquant":
        codec = TurboQuantCodec(bits=ex.TURBOQUANT_BITS)
        if not ef:
            return turboquant_mean_reference(parts, codec)[0].float()
        outs, new = turboquant_mean_reference(parts, codec, worker_errors=[e.clone() for e in errors])
        for e, n in zip(errors, new):
            e.copy_(n)
        return outs[0].float()
    us = [x + e for x, e in zip(parts, errors)] if ef else list(parts)
    if compression == "bf16":  # rounded to bf16 (the error kept), divided by P, summed in bf16 (P = 2: one add)
        ws = [u.to(torch.bfloat16) for u in us]
        if ef:
            for e, u, w in zip(errors, us, ws):
                e.copy_(u - w.float())
        total = ws[0] / p
        for w in ws[1:]:
            total = total + w / p
        return total.float()
    if compression in BLOCKWISE:
        bits = BLOCKWISE[compression]
        rows = []
        for w, u in enumerate(us):
            codes, scales = blockwise.encode(u.view(1, -1), bits, salt=ex.salt(fragment, round_, w))
            d = blockwise.decode(codes, scales, bits, m)[0]
            rows.append(d)
            if ef:
                missed = u - d
                errors[w].copy_(torch.where(torch.isfinite(missed), missed, torch.zeros_like(missed)))
        return divide(rank_sum(torch.stack(rows)), p)
    if compression == "bitdp":
        r = -(-m // ex.BITDP_ROW)
        words, scales = [], []
        for w, u in enumerate(us):
            mat = torch.zeros(r * ex.BITDP_ROW)
            mat[:m] = u
            mat = mat.view(r, ex.BITDP_ROW)
            layout, wd, sc = gathered.encode([mat], 2)
            words.append(wd)
            scales.append(sc)
            if ef:
                from lowbit_strategy.codecs.channel import channel_decode, channel_encode

                c, s = channel_encode(mat, 2, validate=False)
                errors[w].copy_(u - channel_decode(c, s, 2).reshape(-1)[:m])
        out = gathered.decode_reduce(torch.stack(words), torch.stack(scales), layout)
        return out.reshape(-1)[:m]
    raise ValueError(compression)


class Worker:
    def __init__(self, ranks: list[int]):
        self.ranks = ranks  # the ranks whose data this worker sees (a node's, or one)
        self.net = training.model()
        self.opt = adamw(self.net.parameters())

    def step(self, step: int) -> None:
        self.opt.zero_grad()
        grads = []
        for r in self.ranks:
            self.net.zero_grad()
            training.loss(self.net, r, step).backward()
            grads.append([p.grad.clone() for p in self.net.parameters()])
        k = len(self.ranks)
        for i, p in enumerate(self.net.parameters()):  # DDP's node mean: each scaled by 1/k, then summed
            total = grads[0][i] * (1.0 / k)
            for g in grads[1:]:
                total = total + g[i] * (1.0 / k)
            p.grad = total
        self.opt.step()


def diloco(workers: int, steps: int, *, ranks_per_node: int = 1, sync_every: int, compression: str,
           error_feedback: bool, fragments: int = 1, delay: int = 0, alpha: float = 0.5, outer_lr: float = 0.7,
           outer_momentum: float = 0.9, nesterov: bool = True) -> list[torch.nn.Module]:
    """Every worker's model after ``steps`` inner steps of DiLoCo (module docstring)."""
    ws = [Worker(list(range(w * ranks_per_node, (w + 1) * ranks_per_node))) for w in range(workers)]
    names = [n for n, _ in ws[0].net.named_parameters()]
    which = frag.fragment_of(names, fragments)

    def flat(net, f):
        return torch.cat([p.detach().reshape(-1).float() for p, w in zip(net.parameters(), which) if w == f])

    def load(net, f, vec):
        off = 0
        with torch.no_grad():
            for p, w in zip(net.parameters(), which):
                if w == f:
                    p.copy_(vec[off: off + p.numel()].view(p.shape))
                    off += p.numel()

    glob = [flat(ws[0].net, f) for f in range(fragments)]
    mom = [torch.zeros_like(g) for g in glob]
    n = [g.numel() for g in glob]
    errors = [[torch.zeros(n[f]) for _ in ws] for f in range(fragments)]
    server = [[torch.zeros(server_chunk_length(n[f], workers)) for _ in ws] for f in range(fragments)]
    pending: dict[int, tuple[int, torch.Tensor]] = {}
    syncs = 0

    def land(f, mean):
        nonlocal syncs
        mom[f].mul_(outer_momentum).add_(mean)
        d = mean.add(mom[f], alpha=outer_momentum) if nesterov else mom[f]
        glob[f].sub_(d, alpha=outer_lr)
        for w in ws:
            merged = glob[f] if delay == 0 else flat(w.net, f).mul_(alpha).add_(glob[f], alpha=1 - alpha)
            load(w.net, f, merged)
        syncs += 1

    for t in range(1, steps + 1):
        for w in ws:
            w.step(t)
        for f, (at, mean) in list(pending.items()):
            if at == t:
                del pending[f]
                land(f, mean)
        for f in range(fragments):
            if frag.syncs_after(t, f, fragments, sync_every):
                parts = [glob[f] - flat(w.net, f) for w in ws]
                mean = (mean_of(compression, parts, errors[f], server[f], error_feedback, f, syncs)
                        if workers > 1 else parts[0])
                if delay == 0:
                    land(f, mean)
                else:
                    pending[f] = (t + delay, mean)
    return [w.net for w in ws]
