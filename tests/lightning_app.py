"""A tiny language model and a `Trainer.fit` driver for the strategy tests.

Run as ``python -m tests.lightning_app --strategy NAME [...] --out result.json``, or with
``--plan PLAN.json`` for several runs in one interpreter (:func:`main`); the global-zero
process writes a JSON summary. The strategy tests run it in a fresh interpreter, because the
``popen`` launchers re-execute the command line and forking from inside pytest is not safe.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lowbit_strategy
from lowbit_strategy import rank_state
from callbacks import CommStats, DivergenceMonitor, MomentumSync

VOCAB, SEQ = 32, 8


class TinyLM(pl.LightningModule):
    """Embedding -> MLP -> head tied to the embedding; an optional branch used only on odd
    ranks' batches exercises unused parameters."""

    def __init__(self, optimizer: str = "lion", lr: float = 1e-2, unused: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.wte = nn.Embedding(VOCAB, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, VOCAB, bias=False)
        self.head.weight = self.wte.weight
        self.extra = nn.Linear(16, 16) if unused else None

    def forward(self, x):
        h = self.wte(x)
        h = h + self.mlp(h)
        if self.extra is not None and self.global_rank % 2 == 1:
            h = h + self.extra(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        if self.hparams.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        if self.hparams.optimizer in ("onebit_adam", "onebit_lamb"):
            # 4 steps an epoch on 2 ranks: epoch 1 is warm-up and switch, epoch 2 compresses
            cls = lowbit_strategy.OneBitAdam if self.hparams.optimizer == "onebit_adam" else lowbit_strategy.OneBitLamb
            return cls(self.parameters(), lr=self.hparams.lr, weight_decay=0.01, freeze_step=3)
        if self.hparams.optimizer == "demo":  # top-4 of each chunk: the tiny model's tensors are single chunks
            return lowbit_strategy.DeMo(self.parameters(), lr=self.hparams.lr, compression_topk=4, weight_decay=0.01)
        if self.hparams.optimizer == "turboquant":  # as above: epoch 2 compresses
            return lowbit_strategy.TurboQuantAdamW(self.parameters(), lr=self.hparams.lr, warmup_steps=3)
        return lowbit_strategy.Lion(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


def loader(n: int = 64, batch: int = 8) -> DataLoader:
    """Next-token task y = (x + 1) mod V on fixed random tokens: learnable, deterministic."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
    return DataLoader(TensorDataset(x, (x + 1) % VOCAB), batch_size=batch, shuffle=False)


def trainer(strategy, devices: int, max_epochs: int, **kw) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=max_epochs,
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        deterministic=True, **{"enable_checkpointing": False, **kw},
    )


def fit_once(args) -> dict:
    pl.seed_everything(0, verbose=False)
    model = TinyLM(optimizer=args.optimizer, unused=args.unused)
    stats = CommStats(prog_bar=False)
    cbs = [stats]
    if args.optimizer == "lion":
        # momentum sync every 5: the last step (8 with 2 ranks, 6 with 3) sends only the update,
        # whose bytes are the logged ratio
        cbs += [MomentumSync(every=5), DivergenceMonitor(every=2, sign_agreement=True)]
    elif args.optimizer.startswith("onebit") or args.optimizer == "turboquant":
        # step 4 compresses; the monitor's own allreduce is counted in the next step's bytes, never the last one's
        cbs += [DivergenceMonitor(every=4)]
    extra = {}
    if args.accumulate > 1:
        extra["accumulate_grad_batches"] = args.accumulate
    if args.clip:
        extra["gradient_clip_val"] = args.clip
    overrides = {**(TQ_FORM if args.optimizer == "turboquant" else {}), **dict(kv.split("=", 1) for kv in args.lowbit)}
    strategy = _strategy(args.strategy, overrides or None)
    if args.unused:
        strategy = lowbit_strategy.LowBitStrategy(mode="1bit", find_unused_parameters=True,
                                                  start_method="spawn" if "spawn" in args.strategy else "popen")
    tr = trainer(strategy, args.devices, args.epochs, callbacks=cbs, precision=args.precision, **extra)
    first = float(nn.functional.cross_entropy(model(loader().dataset.tensors[0]).reshape(-1, VOCAB),
                                              loader().dataset.tensors[1].reshape(-1)))
    tr.fit(model, loader())
    metrics = {k: float(v) for k, v in tr.callback_metrics.items()}
    sent = sum(t.bytes_sent for t in tr.strategy.traffic_logs()) if hasattr(tr.strategy, "traffic_logs") else 0
    return {"first_loss": first, "metrics": metrics, "world_size": tr.world_size, "bytes_after_fit": sent,
            "global_step": tr.global_step, "is_global_zero": tr.is_global_zero,
            "overlap": getattr(getattr(tr.strategy, "sync", None), "overlap", None),
            "momentum_syncs": max((getattr(o, "momentum_syncs", 0) for o in tr.optimizers), default=0)}


#: TurboQuant's compressed form, pinned: on this CPU and the default 1 Gbit/s link ``auto``
#: measures the codec and falls back to the exact fp32 mean, and these tests check the codes
TQ_FORM = {"turboquant_form": "allgather"}


def _strategy(strategy: str, overrides: dict | None):
    """A registered name, or (with LowBitConfig ``overrides``) the strategy it names, rebuilt."""
    from lightning.pytorch.strategies import StrategyRegistry

    if not overrides:
        return strategy
    entry = StrategyRegistry[strategy]
    return entry["strategy"](**{**entry["init_params"], **overrides})


def _run(strategy, devices, epochs, optimizer, overrides, ckpt=None, callbacks=(), save=False):
    pl.seed_everything(0, verbose=False)
    model = TinyLM(optimizer=optimizer)
    if optimizer == "turboquant":
        overrides = {**TQ_FORM, **(overrides or {})}
    tr = trainer(_strategy(strategy, overrides), devices, epochs, callbacks=list(callbacks), enable_checkpointing=save)
    tr.fit(model, loader(), ckpt_path=ckpt)
    return tr, {k: v.clone() for k, v in model.state_dict().items()}


def _rank_states(ckpt: str, optimizer: str) -> dict:
    """What the checkpoint keeps per rank: Lion's momenta, 1-bit Adam/LAMB's error buffers or
    BitDP's iteration and residuals."""
    entry = torch.load(ckpt, weights_only=False).get(rank_state.KEY)
    if entry is None:
        return {"saved_world_size": None}
    # every rank's state in a file of its own beside the checkpoint (rank_state.save_files)
    assert entry["format"] == "files" and "states" not in entry, sorted(entry)
    states = [torch.load(rank_state._file(ckpt + ".lowbit", r, entry["world_size"]), weights_only=True)
              for r in range(entry["world_size"])]
    out = {"saved_world_size": entry["world_size"], "saved_algorithm": entry["algorithm"]}
    if optimizer == "lion":
        moms = [next(iter(st["optimizers"][0].values()))["exp_avg"] for st in states]
        return {**out, "rank_states_differ": not torch.equal(moms[0], moms[1])}
    if optimizer.startswith("onebit") or optimizer == "turboquant":
        errors = [st["optimizers"][0]["errors"]["buckets"] for st in states]  # state format 2, by names
        keys = sorted(errors[0])
        return {**out, "error_buckets": len(keys), "rank_states_differ": bool(keys) and any(
            not torch.equal(errors[0][k]["worker"], errors[1][k]["worker"]) for k in keys)}
    if entry["algorithm"] == "demo":  # each worker's momenta, and with delay 1 the exchange in flight
        deltas = [next(iter(st["optimizers"][0].values()))["delta"] for st in states]
        return {**out, "rank_states_differ": not torch.equal(deltas[0], deltas[1]),
                "pending_saved": all(st["pending"][0] is not None for st in states)}
    if entry["algorithm"] == "diloco":  # each worker's own weights and inner AdamW state, and the global copy
        return {**out, "rank_states_differ": not torch.equal(states[0]["local"][0], states[1]["local"][0]),
                "global_same": torch.equal(states[0]["global"][0], states[1]["global"][0]),
                "inner_saved": all(bool(st["inner"][0]["state"]) for st in states)}
    residuals = [st["residuals"] for st in states]
    return {**out, "saved_iters": [st["iter"] for st in states],
            "residual_names": sorted(residuals[0]) if residuals else [],
            "rank_states_differ": bool(residuals) and any(
                not torch.equal(residuals[0][n], residuals[1][n]) for n in residuals[0])}


def resume_check(strategy: str, devices: int, workdir: str, optimizer: str = "lion", overrides=None) -> dict:
    """Two epochs straight vs one epoch, checkpoint (ModelCheckpoint during fit), resume for
    the second: bit-exact? And on another world size: finite? ``overrides``: LowBitConfig
    fields applied to the registered ``strategy`` name."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    _, straight = _run(strategy, devices, 2, optimizer, overrides)
    _run(strategy, devices, 1, optimizer, overrides, save=True,
         callbacks=[ModelCheckpoint(dirpath=workdir, filename="epoch{epoch}", save_top_k=-1)])
    ckpt = os.path.join(workdir, sorted(os.listdir(workdir))[0])
    tr, resumed = _run(strategy, devices, 2, optimizer, overrides, ckpt=ckpt)
    _, other_world = _run(strategy, devices + 1, 2, optimizer, overrides, ckpt=ckpt)
    return {"bit_exact": all(torch.equal(straight[k], resumed[k]) for k in straight),
            "other_world_finite": all(bool(torch.isfinite(v).all()) for v in other_world.values()),
            "is_global_zero": tr.is_global_zero, **_rank_states(ckpt, optimizer)}


def save_after_fit_check(strategy: str, devices: int, workdir: str, optimizer: str = "lion", overrides=None) -> dict:
    """``trainer.save_checkpoint(path)`` once ``fit`` has returned (every rank calls it, as
    with any popen-launched script), then ``fit(ckpt_path=path)``: bit-exact with two
    epochs straight?"""
    _, straight = _run(strategy, devices, 2, optimizer, overrides)
    tr, _ = _run(strategy, devices, 1, optimizer, overrides)
    ckpt = os.path.join(workdir, "final.ckpt")
    tr.save_checkpoint(ckpt)
    tr, resumed = _run(strategy, devices, 2, optimizer, overrides, ckpt=ckpt)
    return {"bit_exact": all(torch.equal(straight[k], resumed[k]) for k in straight),
            "is_global_zero": tr.is_global_zero, **_rank_states(ckpt, optimizer)}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--optimizer", default="lion")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--unused", action="store_true")
    parser.add_argument("--resume-check", default="")
    parser.add_argument("--save-after-fit-check", default="")
    parser.add_argument("--lowbit", action="append", default=[], metavar="KEY=VALUE",
                        help="LowBitConfig override (repeatable)")
    return parser


def run(argv: list[str]) -> dict:
    """One run (a fit, or a resume / save-after-fit check) from its command-line arguments;
    an exception becomes ``{"error": ...}``, which the tests assert on."""
    args = _parser().parse_args(argv)
    try:
        overrides = dict(kv.split("=", 1) for kv in args.lowbit)
        if args.resume_check:
            return resume_check(args.strategy, args.devices, args.resume_check, args.optimizer, overrides)
        if args.save_after_fit_check:
            return save_after_fit_check(args.strategy, args.devices, args.save_after_fit_check, args.optimizer,
                                        overrides)
        return fit_once(args)
    except Exception as exc:  # reported to the test, which asserts on the message
        return {"error": f"{type(exc).__name__}: {exc}", "is_global_zero": int(os.environ.get("LOCAL_RANK", 0)) == 0}


def main(argv=None) -> None:
    """``--out FILE`` and either one run's arguments, or ``--plan PLAN.json``: a list of
    ``[id, [arguments]]`` run one after the other in this interpreter (``{id: result}`` is
    written). A plan shares one interpreter's imports among its runs; with a ``popen``
    strategy it also shares the launched processes and their process group: the first fit
    launches the other ranks, which run the same plan, and every later fit finds them (so a
    plan's ``popen`` runs all use the same ``--devices``)."""
    top = argparse.ArgumentParser()
    top.add_argument("--out", required=True)
    top.add_argument("--plan", default="")
    known, rest = top.parse_known_args(argv)
    if known.plan:
        with open(known.plan) as fh:
            result = {str(key): run(list(args)) for key, args in json.load(fh)}
        zero = int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0
    else:
        result = run(rest)
        zero = result.get("is_global_zero", True)
    if zero:
        with open(known.out, "w") as fh:
            json.dump(result, fh)
    sys.exit(0)


if __name__ == "__main__":
    main()
