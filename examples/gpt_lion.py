"""Train a small GPT with Lion Cub: ``Trainer(strategy="lowbit_lion")`` on CPU processes.

Data: the bytes of the installed Python standard library's source files (real text,
available offline on every machine with Python), byte-level tokens, the last 10% held out
for validation. Model: a GPT of a few million parameters with tied embeddings.

    python examples/gpt_lion.py --devices 2 --max-minutes 3
    python examples/gpt_lion.py --strategy lowbit_lion_8bit --max-steps 300 --out r.json
    python examples/gpt_lion.py --strategy lowbit_adam --optimizer onebit_adam --max-steps 300
    python examples/gpt_lion.py --strategy lowbit_turboquant --optimizer turboquant --max-steps 300
    python examples/gpt_lion.py --compress-activations    # linear inputs kept as 4-bit codes

Two nodes of two ranks (on one machine or two): start it once per node, ``--devices`` being
the ranks of one node; Lightning forms ranks node by node and the lowbit strategies their
node-aware topology from it (``--lowbit topology=flat`` to keep one flat group)::

    NODE_RANK=K MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python examples/gpt_lion.py --devices 2 --num-nodes 2

At the end the global-zero process prints the validation loss, steps/s, and the bytes it
sent per step next to what DDP's fp32 allreduce would have sent.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import lowbit_strategy  # registers the lowbit_* strategies: must come before Trainer(...)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from callbacks import CommStats, MomentumSync  # noqa: E402
from callbacks import ActivationCompression  # noqa: E402
from examples.causal_lm import CausalLM, Windows, split_windows  # noqa: E402,F401  (Windows: the others import it from here)


# ---- data ---------------------------------------------------------------------------
def stdlib_bytes(limit: int = 6 * 2**20) -> torch.Tensor:
    """Up to ``limit`` bytes of the standard library's .py files, in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


# ---- model --------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(CausalLM):
    """A byte-level GPT (vocabulary 256) with learned positions and tied embeddings; its
    training, optimizers and sampling are :class:`~examples.causal_lm.CausalLM`'s."""

    def __init__(self, vocab=256, seq=128, d=192, layers=4, heads=4, lr=1e-3, weight_decay=0.1,
                 optimizer="lion", warmup=50, total_steps=1000, freeze_step=None, variance="synchronized",
                 scale_decay=0.0, update_clip="auto", guard=1000.0, demo_topk=32):
        super().__init__()
        self.save_hyperparameters()
        self.context = seq
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, x):
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))

    def save_weights(self, path) -> None:
        """Hyperparameters and weights in one file (what ``make demo`` writes for the notebook)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"hparams": dict(self.hparams), "state_dict": self.state_dict()}, path)

    @classmethod
    def load_weights(cls, path, **changes) -> "GPT":
        """The model :meth:`save_weights` wrote, with some hyperparameters changed (the
        optimizer and schedule of a fine-tuning run; not the shapes)."""
        saved = torch.load(path, map_location="cpu", weights_only=True)
        model = cls(**{**saved["hparams"], **changes})
        model.load_state_dict(saved["state_dict"])
        return model


# ---- driver -------------------------------------------------------------------------
class Throughput(pl.Callback):
    """Wall time of the training steps (validation excluded)."""

    def __init__(self):
        self.seconds, self.steps, self._t = 0.0, 0, None

    def on_train_batch_start(self, *args):
        self._t = time.perf_counter()

    def on_train_batch_end(self, *args):
        self.seconds += time.perf_counter() - self._t
        self.steps += 1


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="lowbit_lion")
    p.add_argument("--devices", type=int, default=2, help="processes per node")
    p.add_argument("--num-nodes", type=int, default=1,
                   help="Trainer(num_nodes=...): start the script on every node with NODE_RANK=K and the same "
                        "MASTER_ADDR/MASTER_PORT")
    p.add_argument("--optimizer", default="lion",
                   choices=["lion", "adamw", "onebit_adam", "onebit_lamb", "turboquant", "demo"],
                   help="onebit_* need strategy lowbit_adam / lowbit_lamb, turboquant lowbit_turboquant, demo lowbit_demo")
    p.add_argument("--lr", type=float, default=None, help="default 1e-3 for Lion and DeMo (sign steps), 3e-3 for the others")
    p.add_argument("--freeze-step", type=int, default=None,
                   help="1-bit Adam/LAMB freeze_step, TurboQuantAdamW warmup_steps (default 20 %% of the steps)")
    p.add_argument("--variance", default="synchronized", choices=["synchronized", "local"],
                   help="TurboQuantAdamW: v from the synchronized momentum (replicas identical) or, as the paper, "
                        "from each rank's own gradient")
    p.add_argument("--scale-decay", type=float, default=0.0,
                   help="TurboQuantAdamW: EMA decay of the code scales (0: each step's own RMS)")
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--val-every", type=int, default=100)
    p.add_argument("--val-batches", type=int, default=20)
    p.add_argument("--momentum-sync", type=int, default=0, help="sync embedding/head momentum every k steps")
    p.add_argument("--compress-activations", action="store_true",
                   help="ActivationCompression: linear layers (not the head) keep their input as 4-bit TurboQuant codes")
    p.add_argument("--data-mb", type=float, default=6.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lowbit", nargs="*", default=[], metavar="KEY=VALUE",
                   help="LowBitConfig overrides on top of --strategy's preset, e.g. bitdp_quantize='*'")
    p.add_argument("--out", default="", help="write a JSON summary here")
    p.add_argument("--save-weights", default="", metavar="PATH",
                   help="write the trained model here (GPT.load_weights reads it; examples/finetune.ipynb starts from it)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, args.devices)))
    pl.seed_everything(args.seed, verbose=False)
    tokens = stdlib_bytes(int(args.data_mb * 2**20))
    train_set, val_set = split_windows(tokens, args.seq)  # the last 10 % held out
    train = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val = DataLoader(val_set, batch_size=args.batch_size)
    steps = args.max_steps if args.max_steps > 0 else 2000
    lr = args.lr or (1e-3 if args.optimizer in ("lion", "demo") else 3e-3)
    model = GPT(seq=args.seq, d=args.d_model, layers=args.layers, lr=lr, optimizer=args.optimizer, total_steps=steps,
                freeze_step=args.freeze_step, variance=args.variance,
                scale_decay=args.scale_decay)
    stats, clock, drift = CommStats(), Throughput(), ReplicaDrift()
    ranks = RankTraffic(stats)
    cbs = [stats, clock, drift, ranks] + ([MomentumSync(every=args.momentum_sync)] if args.momentum_sync else [])
    activations = ActivationCompression() if args.compress_activations else None
    cbs += [activations] if activations else []
    trainer = pl.Trainer(
        strategy=build_strategy(args.strategy, args.lowbit), accelerator="cpu", devices=args.devices,
        num_nodes=args.num_nodes, max_steps=args.max_steps,
        max_time={"minutes": args.max_minutes} if args.max_minutes else None,
        val_check_interval=args.val_every, limit_val_batches=args.val_batches, check_val_every_n_epoch=None,
        callbacks=cbs, logger=False, enable_checkpointing=False, num_sanity_val_steps=0,
    )
    trainer.fit(model, train, val)
    train_loss = float(trainer.callback_metrics.get("train_loss", float("nan")))
    last_bytes = float(trainer.callback_metrics.get("comm/bytes_per_step", float("nan")))  # validate() clears it
    trainer.validate(model, val, verbose=False)
    summary = {
        "strategy": args.strategy, "optimizer": args.optimizer, "world_size": trainer.world_size,
        "params": sum(p.numel() for p in model.parameters()), "steps": trainer.global_step,
        "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
        "train_loss": train_loss,
        "steps_per_s": clock.steps / clock.seconds if clock.seconds else 0.0,
        "bytes_per_step": stats.bytes_per_step, "fp32_bytes_per_step": stats.fp32_bytes_per_step,
        "last_bytes_per_step": last_bytes,
        # None on CUDA, where the host cannot time collectives (CommStats)
        "comm_s_per_step": None if stats.total_seconds is None else stats.total_seconds / max(1, stats.steps),
        "replica_drift": drift.max_abs, "replica_drift_relative": drift.relative,
        "topology": ranks.topology, "num_nodes": args.num_nodes,
        # every rank's bytes per step: [over the network, inside its node] (rank order)
        "rank_bytes_per_step": ranks.per_rank,
    }
    if activations is not None and activations.report is not None:  # first batch, this rank
        summary["saved_tensor_bytes"] = activations.report.total_bytes
        summary["saved_tensor_bytes_uncompressed"] = activations.report.total_bytes_uncompressed
    if trainer.is_global_zero:
        report(summary)
        if args.out:
            Path(args.out).write_text(json.dumps(summary, indent=2))
        if args.save_weights:
            model.save_weights(args.save_weights)
            print(f"  weights saved to     {args.save_weights}")
    return summary


class ReplicaDrift(pl.Callback):
    """At the end of training: how far the ranks' weights are apart, ``max |w_r − w_0|`` over
    every weight and rank (and relative to ``max |w_0|``). 0 for every data-parallel method
    that keeps replicas identical; TurboQuantAdamW with ``variance="local"`` (the paper's)
    drifts."""

    max_abs: float = 0.0
    relative: float = 0.0

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.world_size < 2:
            return
        import torch.distributed as dist

        flat = torch.cat([p.detach().float().reshape(-1) for p in pl_module.parameters()])
        every = [torch.empty_like(flat) for _ in range(trainer.world_size)]
        dist.all_gather(every, flat)
        self.max_abs = max(float((e - every[0]).abs().max()) for e in every[1:])
        self.relative = self.max_abs / max(float(every[0].abs().max()), 1e-30)


class RankTraffic(pl.Callback):
    """At the end of training: every rank's bytes per step over the network (``CommStats``'
    count) and inside its node (the hierarchical form's reduction and all-gather), in rank
    order, and the strategy's topology ("flat: ..." / "hierarchical: 2 node(s) x 2 rank(s)")."""

    def __init__(self, stats: CommStats):
        self.stats, self.topology = stats, "–"
        self.per_rank: list[list[float]] = []
        self._node_start = 0

    @staticmethod
    def _node_bytes(trainer) -> int:
        getter = getattr(trainer.strategy, "traffic_logs", None)
        return sum(log.node_bytes_sent for log in getter()) if getter is not None else 0

    def on_train_start(self, trainer, pl_module) -> None:
        self._node_start = self._node_bytes(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        topology = getattr(getattr(trainer.strategy, "sync", None), "topology", None)
        self.topology = topology.describe() if topology is not None else "–"
        steps = max(1, self.stats.steps)
        mine = [self.stats.bytes_per_step, (self._node_bytes(trainer) - self._node_start) / steps]
        if trainer.world_size < 2:
            self.per_rank = [mine]
            return
        import torch.distributed as dist

        every: list = [None] * trainer.world_size
        dist.all_gather_object(every, mine)
        self.per_rank = every


#: the DDP baselines of benchmarks/harness/baselines.py by name: torch's own comm hooks on any device
BASELINE_STRATEGIES = {"ddp_bf16": "bf16", "ddp_fp16": "fp16", "ddp_powersgd": "powersgd"}


def build_strategy(name: str, overrides: list[str]):
    """``name`` itself, or with ``KEY=VALUE`` overrides the registered preset rebuilt with them;
    ``ddp_bf16`` / ``ddp_fp16`` / ``ddp_powersgd``: DDP with torch's ``bf16_compress_hook``,
    ``fp16_compress_hook`` or ``powerSGD_hook`` (rank 4, torch's default warm-up), which
    Lightning registers on CUDA only (:mod:`benchmarks.harness.baselines` registers them anywhere)."""
    if name in BASELINE_STRATEGIES:
        from benchmarks.harness.baselines import make_baseline

        return make_baseline(BASELINE_STRATEGIES[name])
    if not overrides:
        return name
    from lightning.pytorch.strategies import StrategyRegistry

    params = dict(StrategyRegistry[name]["init_params"])
    for item in overrides:
        key, _, value = item.partition("=")
        params[key] = value
    return lowbit_strategy.LowBitStrategy(**params)


def _ms(seconds: float | None) -> str:
    return "time unavailable on CUDA" if seconds is None else f"{1e3 * seconds:.1f} ms/step"


def report(s: dict) -> None:
    sent, fp32 = s["bytes_per_step"], s["fp32_bytes_per_step"]
    ratio = f"{fp32 / sent:.1f}x less" if sent else "nothing sent by the optimizer (gradients went through DDP)"
    print(
        f"\n{s['strategy']} on {s['world_size']} CPU processes, {s['params'] / 1e6:.2f}M parameters, {s['steps']} steps\n"
        f"  validation loss      {s['val_loss']:.4f}   (train {s['train_loss']:.4f})\n"
        f"  steps/s              {s['steps_per_s']:.2f}   (communication {_ms(s['comm_s_per_step'])})\n"
        f"  bytes sent per step  {sent / 1024:.1f} KiB per rank; DDP fp32 would send {fp32 / 1024:.1f} KiB: {ratio}"
        + (f"\n  replicas differ by   {s['replica_drift']:.3g} (max |w_r - w_0|)" if s["replica_drift"] else "")
    )


if __name__ == "__main__":
    main()
