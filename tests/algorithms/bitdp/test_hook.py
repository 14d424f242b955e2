"""BitDP DDP communication hook (hooks.py) and its selection rule (quantized_params.py).

The DDP tests run a small GPT-like model (tied lm_head, LayerNorm, biased linears) with a
Llama-like block (RMSNorm, bias-free linears, SwiGLU) under real DistributedDataParallel on
gloo: P = 2, 3, 4 as subgroups of one 4-process run shared with test_two_stage.py (so group
rank != global rank and the hook runs on a non-default process group), and P = 1 in this
process. Every rank recomputes
all ranks' local gradients without DDP and checks that, after backward, full-precision
parameters hold the exact mean and quantized linear weights the mean of the dequantized
per-rank gradients (or BitDP Eq. 10).
"""
import copy
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowbit_strategy.codecs import channel_decode, channel_encode
from lowbit_strategy.collectives import TrafficLog
from lowbit_strategy import BitDPState, bitdp_hook
from lowbit_strategy.algorithms.bitdp import classify

VOCAB, DIM, CTX, BATCH = 32, 16, 8, 2


class GPTBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        q, k, v = self.c_attn(self.ln_1(x)).chunk(3, dim=-1)
        x = x + self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class LlamaBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate_proj, self.up_proj = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.down_proj = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        h = self.input_layernorm(x)
        a = F.scaled_dot_product_attention(self.q_proj(h), self.k_proj(h), self.v_proj(h), is_causal=True)
        x = x + self.o_proj(a)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Conv1D(nn.Module):
    """Hugging Face transformers' ``Conv1D`` (GPT-2's projections): a linear layer whose
    weight is stored in x out, so its output channels are the weight's columns."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf).normal_(std=0.02))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


class HFMLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(3 * d, d), Conv1D(d, 3 * d)

    def forward(self, x):
        return x + self.c_proj(F.gelu(self.c_fc(x)))


class TinyLM(nn.Module):
    def __init__(self, tied=True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(CTX, DIM)
        self.gpt, self.llama, self.ln_f = GPTBlock(DIM), LlamaBlock(DIM), nn.LayerNorm(DIM)
        self.hf = HFMLP(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        return self.lm_head(self.ln_f(self.hf(self.llama(self.gpt(x)))))


CONV1D_TINY = {"hf.c_fc.weight", "hf.c_proj.weight"}  # channels are columns
QUANTIZED_TINY = {
    "gpt.c_attn.weight", "gpt.c_proj.weight", "gpt.c_fc.weight", "gpt.mlp_proj.weight", *CONV1D_TINY,
    *(f"llama.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
}


def _decisions(model, **kw):
    return {info.name: info.quantized for info in classify(model, **kw).values()}


def test_default_selection_gpt_and_llama():
    got = _decisions(TinyLM())
    assert {n for n, q in got.items() if q} == QUANTIZED_TINY
    assert set(got) == {n for n, _ in TinyLM().named_parameters()}  # tied lm_head: one parameter
    info = {i.name: i for i in classify(TinyLM()).values()}["wte.weight"]
    assert info.names == ("wte.weight", "lm_head.weight") and info.owners == ("Embedding", "Linear")
    assert not info.quantized and "embedding" in info.reason
    assert {i.name for i in classify(TinyLM()).values() if i.transposed} == CONV1D_TINY
    # an untied Llama-style head is the output embedding: exact by default, quantize= overrides
    assert _decisions(TinyLM(tied=False))["lm_head.weight"] is False
    assert _decisions(TinyLM(tied=False), quantize="lm_head.weight")["lm_head.weight"] is True


def test_selection_overrides():
    got = _decisions(TinyLM(), quantize=["llama.*_proj.weight", "lm_head.weight"], exclude=["*.down_proj.*"])
    expected = {f"llama.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")}
    assert {n for n, q in got.items() if q} == expected | {"wte.weight"}  # an alias match selects a tied weight
    # exclude wins over quantize; frozen parameters are classified too
    m = TinyLM()
    m.gpt.c_fc.weight.requires_grad_(False)
    got = _decisions(m, quantize="gpt.*", exclude="gpt.c_attn.*")
    assert got["gpt.c_fc.weight"] is True and got["gpt.c_attn.weight"] is False and got["gpt.ln_1.bias"] is True
    # MultiheadAttention: out_proj is a Linear subclass; in_proj_weight (q, k, v stacked: rows are
    # output features) and the separate q/k/v projections (kdim != embed_dim) are linear weights too
    got = _decisions(nn.MultiheadAttention(8, 2))
    assert got == {"in_proj_weight": True, "in_proj_bias": False, "out_proj.weight": True, "out_proj.bias": False}
    got = _decisions(nn.MultiheadAttention(8, 2, kdim=4, vdim=6))
    assert {n for n, q in got.items() if q} == {"q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight"}
    # zero-element parameters are never quantized (nothing to send)
    assert _decisions(nn.Sequential(nn.Linear(0, 4), nn.Linear(4, 3)))["0.weight"] is False


def test_unmatched_patterns_are_errors_and_empty_selection_warns():
    with pytest.raises(ValueError, match=r"^exclude: pattern 'nothing.here' matches no parameter name \(names look like: "
                                         r"wte.weight"):
        classify(TinyLM(), exclude="nothing.here")
    with pytest.raises(ValueError, match="quantize: pattern 'gpt.nope' matches no parameter"):
        classify(TinyLM(), quantize=["gpt.*", "gpt.nope"])
    with pytest.warns(UserWarning, match="selects no parameter"):
        classify(nn.Sequential(nn.LayerNorm(4), nn.Embedding(3, 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        classify(TinyLM())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bits": 4}, r"BitDPState.bits: got 4; .*bits=1 or bits=2"),
        ({"bits": True}, r"BitDPState.bits: got True"),
        ({"reduction": "sum"}, r"BitDPState.reduction: got 'sum'; use 'mean' .* or 'paper'"),
        ({"start_iter": 1}, r"BitDPState.start_iter: got 1; pass an int >= 2"),
        ({"start_iter": 2.5}, r"BitDPState.start_iter: got 2.5"),
        ({"chunk_rows": 0}, r"BitDPState.chunk_rows: got 0; pass a positive number"),
        ({"error_feedback": "yes"}, r"BitDPState.error_feedback: got 'yes'"),
        ({"quantize": [3]}, r"BitDPState.quantize: got \[3\]; pass fnmatch patterns"),
        ({"exclude": ""}, r"BitDPState.exclude: got ''"),
        ({"process_group": "world"}, r"BitDPState.process_group: got 'world'"),
    ],
)
def test_state_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BitDPState(**kwargs)


def test_hook_needs_attached_model():
    with pytest.raises(RuntimeError, match=r"call state.attach\(model\)"):
        bitdp_hook(BitDPState(), None)
    with pytest.raises(TypeError, match="needs an nn.Module"):
        BitDPState().attach("model")


class FakeBucket:
    """Just the GradBucket API the hook's splitter reads."""

    def __init__(self, params, index=0):
        self.params, self.idx = params, index
        self.buf = torch.zeros(sum(p.numel() for p in params))
        self.views, o = [], 0
        for p in params:
            self.views.append(self.buf[o: o + p.numel()].view(p.shape))
            o += p.numel()

    def buffer(self):
        return self.buf

    def parameters(self):
        return self.params

    def gradients(self):
        return self.views

    def index(self):
        return self.idx

    def is_last(self):
        return self.idx == 0


def test_bucket_split_and_cache():
    m = TinyLM()
    state = BitDPState(model=m)
    b = m.gpt
    params = [b.c_fc.bias, b.c_fc.weight, b.ln_2.weight, b.ln_2.bias, b.c_attn.weight, m.wte.weight]
    plan = state.plan(FakeBucket(params, index=3))
    assert plan.quantized == ((64, (64, 16), id(b.c_fc.weight)), (64 + 1024 + 32, (48, 16), id(b.c_attn.weight)))
    assert plan.full == ((0, 64), (64 + 1024, 32), (64 + 1024 + 32 + 768, VOCAB * DIM))  # ln_2 weight+bias merged
    assert state.plan(FakeBucket(params, index=3)) is plan and (3, 64 + 1024 + 32 + 768 + 512) in state.plans
    # a rebuilt bucket with the same index and size but other contents gets a fresh split
    swapped = [params[1], params[0]] + params[2:]
    again = state.plan(FakeBucket(swapped, index=3))
    assert again is not plan and again.quantized[0] == (0, (64, 16), id(b.c_fc.weight))
    with pytest.raises(RuntimeError, match=r"does not know; call state.attach\(model\)"):
        state.plan(FakeBucket([nn.Linear(2, 2).weight], index=1))


# ---------------------------------------------------------------- DDP on real gloo groups

def _batch(rank: int, it: int):
    gen = torch.Generator().manual_seed(1000 * it + rank)
    idx = torch.randint(0, VOCAB, (BATCH, CTX + 1), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def _loss(model, rank, it):
    x, y = _batch(rank, it)
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def _local_grads(model, world_size, it, inject=None):
    """Every rank's gradients of ``model`` at iteration ``it``, computed here without DDP."""
    out = []
    for r in range(world_size):
        model.zero_grad(set_to_none=True)
        _loss(model, r, it).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if inject is not None and r == world_size - 1:
            grads[inject] = grads[inject] * math.inf
        out.append(grads)
    return out


def _dequantized(g, bits):
    return channel_decode(*channel_encode(g, bits), bits).view(g.shape)


def _deq(name, g, bits):
    """Per-rank dequantized gradient of parameter ``name``: channels are output features."""
    return _dequantized(g.t(), bits).t() if name in CONV1D_TINY else _dequantized(g, bits)


def _paper(per, bits, name=""):
    if name in CONV1D_TINY:
        return _paper([g.t() for g in per], bits).t()
    enc = [channel_encode(g, bits) for g in per]
    s = torch.stack([s for _, s in enc]).mean(0)
    q = torch.stack([channel_decode(c, torch.ones_like(s), bits) for c, _ in enc]).sum(0)
    return (s.unsqueeze(1) * q / len(per)).view(per[0].shape)


def _ddp(base, state, buckets, **ddp_kwargs):
    model = copy.deepcopy(base)
    ddp = nn.parallel.DistributedDataParallel(
        model, bucket_cap_mb=0.004, process_group=state.process_group, **ddp_kwargs)

    def spy(state, bucket):  # records which parameters share a bucket, then runs BitDP
        buckets[bucket.index()] = [id(p) for p in bucket.parameters()]
        return bitdp_hook(state, bucket)

    ddp.register_comm_hook(state.attach(ddp), spy)
    return model, ddp


def _step(model, ddp, rank, it, inject=None, world_size=None):
    model.zero_grad(set_to_none=True)
    handle = None
    if inject is not None and rank == world_size - 1:
        handle = model.get_parameter(inject).register_hook(lambda g: g * math.inf)
    _loss(ddp, rank, it).backward()
    if handle is not None:
        handle.remove()
    return {n: p.grad for n, p in model.named_parameters()}


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _ring_bytes(nbytes: int, p: int) -> int:
    return 2 * (p - 1) * (-(-nbytes // p)) if p > 1 else 0


def _check_bytes(traffic, buckets, state, p):
    """Codes all-gathered; scales all-gathered with one more float per bucket (the
    non-finite flag); the rest ring-allreduced; nothing else."""
    infos = [[state.params[i] for i in ids] for ids in buckets.values()]
    mixed = [b for b in infos if any(i.quantized for i in b)]
    q = [i for b in mixed for i in b if i.quantized]
    fp = [sum(math.prod(i.shape) for i in b if not i.quantized) for b in infos]
    assert traffic.by_op() == {
        "gathered.codes.all_gather": (p - 1) * sum(-(-math.prod(i.shape) // 4) for i in q),
        "gathered.scales.all_gather": (p - 1) * 4 * (sum(i.shape[1 if i.transposed else 0] for i in q) + len(mixed)),
        "bitdp.full.allreduce": sum(_ring_bytes(4 * n, p) for n in fp if n),
    }


def _check_exact_and_compressed(base, rank, p, group):
    """2 warm-up iterations, 2 compressed ones, then one with an Inf on the last rank."""
    ref, bits, traffic, buckets = copy.deepcopy(base), 2, TrafficLog(), {}
    state = BitDPState(bits=bits, process_group=group, start_iter=2, chunk_rows=5, traffic=traffic)
    model, ddp = _ddp(base, state, buckets)
    plain = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.004, process_group=group)
    quantized = {i.name for i in state.params.values() if i.quantized}
    assert quantized == QUANTIZED_TINY
    inject = "llama.up_proj.weight"  # a quantized weight: the codec must never see its Inf
    for it in range(5):
        traffic.clear()
        buckets.clear()
        per = _local_grads(ref, p, it, inject if it == 4 else None)
        got = _step(model, ddp, rank, it, inject if it == 4 else None, p)
        exact = {n: torch.stack([g[n] for g in per]).sum(0) / p for n in got}
        ops = {r.op for r in traffic.records}
        if it < 2:  # warm-up: exactly what DDP without a hook computes
            want = _step(plain.module, plain, rank, it)
            assert ops == {"bitdp.warmup.allreduce"} and state.iter == it + 1
            for n in got:
                assert torch.equal(got[n], want[n]), n
                _close(got[n], exact[n], n)
            continue
        # a bucket with a non-finite gradient on any rank: its quantized matrices are NaN on
        # every rank (AMP skips the step), its other gradients the exact mean, as always
        names = {id(q): n for n, q in model.named_parameters()}
        bad = {n for n in got if any(not torch.isfinite(g[n]).all() for g in per)}
        nonfinite = {names[i] for ids in buckets.values() if bad & {names[i] for i in ids} for i in ids}
        assert (it == 4) == bool(nonfinite) and not any("nonfinite" in op or "finite_check" in op for op in ops)
        assert it < 4 or inject in nonfinite
        for n in got:
            if n in quantized and n in nonfinite:
                assert torch.isnan(got[n]).all(), n
            elif n in quantized:
                _close(got[n], torch.stack([_deq(n, g[n], bits) for g in per]).mean(0), n)
            else:
                _close(got[n], exact[n], n)
        assert "gathered.codes.all_gather" in ops and len(buckets) > 2
        if it == 2:
            _check_bytes(traffic, buckets, state, p)
        flat = torch.cat([g.reshape(-1) for g in got.values()]).nan_to_num(0.0, 1.0, -1.0)
        every = torch.empty(p * flat.numel())
        dist.all_gather_single(every, flat, group=group)
        assert all(torch.equal(x, flat) for x in every.view(p, -1)), "replicas must stay identical"


def _check_paper(base, rank, p, group):
    """BitDP Eq. 10 with 1-bit codes: equals its formula, differs from the exact mean."""
    state = BitDPState(bits=1, process_group=group, reduction="paper", chunk_rows=None)
    model, ddp = _ddp(base, state, {}, gradient_as_bucket_view=True)  # grads are bucket views
    for it in range(3):
        got = _step(model, ddp, rank, it)
    per = _local_grads(copy.deepcopy(base), p, 2)
    for n in QUANTIZED_TINY:
        stacked = [g[n] for g in per]
        _close(got[n], _paper(stacked, 1, n), n)
        exact_mean = torch.stack([_deq(n, g, 1) for g in stacked]).mean(0)
        assert p == 1 or (got[n] - exact_mean).abs().max() > 1e-6, n  # one rank: the same


def _check_error_feedback(base, rank, p, group):
    """Each rank quantizes g + e and keeps e = (g + e) - s ⊙ q, rank-local."""
    ref = copy.deepcopy(base)
    state = BitDPState(bits=1, process_group=group, start_iter=2, error_feedback=True)
    model, ddp = _ddp(base, state, {})
    residual = [{n: torch.zeros_like(q) for n, q in base.named_parameters()} for _ in range(p)]
    for it in range(4):
        got = _step(model, ddp, rank, it)
        if it < 2:
            continue
        per = _local_grads(ref, p, it)
        for n in QUANTIZED_TINY:
            deq = []
            for r in range(p):
                c = per[r][n] + residual[r][n]
                deq.append(_deq(n, c, 1))
                residual[r][n] = c - deq[-1]
            _close(got[n], torch.stack(deq).mean(0), n)
            _close(state.residuals[id(model.get_parameter(n))], residual[rank][n], n)
    # an Inf on the last rank: its bucket is flagged on every rank, and no rank keeps that
    # bucket's residuals of this step (the other buckets go on as usual)
    kept = {k: r.clone() for k, r in state.residuals.items()}
    got = _step(model, ddp, rank, 4, "llama.up_proj.weight", p)
    flagged = {n for n in QUANTIZED_TINY if torch.isnan(got[n]).all()}
    assert "llama.up_proj.weight" in flagged and flagged != set(QUANTIZED_TINY)
    for n in QUANTIZED_TINY:
        key = id(model.get_parameter(n))
        assert torch.equal(kept[key], state.residuals[key]) == (n in flagged), n


def _check_bf16(rank, p, group):
    """A bf16 model has bf16 buckets: the hook decodes in float32 and returns bf16."""
    torch.manual_seed(1)
    small = nn.Sequential(nn.Linear(8, 16), nn.RMSNorm(16), nn.Linear(16, 4, bias=False)).to(torch.bfloat16)
    x = torch.randn(p, 3, 8, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(small), process_group=group)
    ddp.register_comm_hook(BitDPState(bits=2, process_group=group, model=ddp), bitdp_hook)
    for _ in range(3):
        ddp.zero_grad(set_to_none=True)
        ddp(x[rank]).float().square().sum().backward()
    per = []
    for r in range(p):
        small.zero_grad(set_to_none=True)
        small(x[r]).float().square().sum().backward()
        per.append({n: q.grad for n, q in small.named_parameters()})
    for n, q in ddp.module.named_parameters():
        assert q.grad.dtype == torch.bfloat16
        stacked = [g[n] for g in per]
        if n.endswith("weight") and q.dim() == 2:
            want = torch.stack([_dequantized(g, 2) for g in stacked]).mean(0).to(torch.bfloat16)
            assert torch.equal(q.grad, want), n
        else:
            want = torch.stack(stacked).float().mean(0)  # bf16 sums: a few ulps of the largest term
            tol = 0.02 * torch.stack(stacked).float().abs().max().item()
            torch.testing.assert_close(q.grad.float(), want, rtol=0, atol=tol, msg=n)


class _WithEmpty(nn.Module):
    """Zero-element parameters beside real ones (a Linear with no inputs, an empty vector),
    and nn.MultiheadAttention, whose in_proj_weight is a linear weight."""

    def __init__(self):
        super().__init__()
        self.fc, self.none_in, self.out = nn.Linear(8, 6), nn.Linear(0, 6), nn.Linear(6, 3)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.empty = nn.Parameter(torch.zeros(0))

    def forward(self, x):
        h = (self.fc(x) + self.none_in(x[:, :0]))[None]
        return self.out(self.attn(h, h, h, need_weights=False)[0][0]) + self.empty.sum()


def _check_zero_element(rank, p, group):
    torch.manual_seed(2)
    base = _WithEmpty()
    x = torch.randn(p, 5, 8, generator=torch.Generator().manual_seed(9))
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base), process_group=group)
    state = BitDPState(bits=2, process_group=group, model=ddp)
    quantized = ["fc.weight", "out.weight", "attn.in_proj_weight", "attn.out_proj.weight"]
    assert [n for n, i in state.selection().items() if i.quantized] == quantized
    ddp.register_comm_hook(state, bitdp_hook)
    for _ in range(3):  # two warm-up iterations, then compressed
        ddp.zero_grad(set_to_none=True)
        ddp(x[rank]).square().sum().backward()
    per = []
    for r in range(p):
        base.zero_grad(set_to_none=True)
        base(x[r]).square().sum().backward()
        per.append(dict(base.named_parameters()))
        per[-1] = {n: q.grad.clone() for n, q in per[-1].items()}
    for n, q in ddp.module.named_parameters():
        stacked = [g[n] for g in per]
        want = torch.stack([_dequantized(g, 2) for g in stacked]).mean(0) if n in quantized \
            else torch.stack(stacked).mean(0)
        torch.testing.assert_close(q.grad, want, rtol=1e-6, atol=1e-6, msg=n)


def _check_ddp(rank, world_size, group=None):
    torch.manual_seed(0)
    base = TinyLM()
    _check_zero_element(rank, world_size, group)
    _check_exact_and_compressed(base, rank, world_size, group)
    _check_paper(base, rank, world_size, group)
    _check_error_feedback(base, rank, world_size, group)
    _check_bf16(rank, world_size, group)


def test_bitdp_hook_one_rank():
    """World size 1 (one device): no network, the same results; run in this process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: intra-op threads only contend (as in run_ranks)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _check_ddp(0, 1)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


# P = 2, 3, 4 under DDP on gloo subgroups: one 4-process launch shared with the two-stage
# form, tests/algorithms/bitdp/test_two_stage.py::test_bitdp_hook_both_forms_in_ddp.
