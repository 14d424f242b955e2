"""Fine-tune a Hugging Face causal LM with ``transformers.Trainer`` (or TRL's ``SFTTrainer``)
and low-bit synchronization.

The script is an ordinary ``Trainer`` script; the one low-bit change is the class,
``LowBitTrainer`` in place of ``Trainer`` (``class SFT(LowBitTrainerMixin, SFTTrainer)`` for
TRL). The algorithm comes from the environment the launcher passes on::

    LOWBIT_CONFIG=examples/lowbit.yaml torchrun --nproc-per-node 2 examples/hf_trainer_finetune.py
    LOWBIT_CONFIG=examples/lowbit.yaml LOWBIT_ALGORITHM=bitdp torchrun --nproc-per-node 2 \\
        examples/hf_trainer_finetune.py --trainer sft --model path/to/local/model
    LOWBIT_CONFIG=examples/lowbit.yaml LOWBIT_RANKS_PER_NODE=2 torchrun --nproc-per-node 4 \\
        examples/hf_trainer_finetune.py --fsdp      # sharded in 2 emulated nodes of 2, low-bit across them

Model: ``--model`` names a local Hugging Face causal LM directory (a model you downloaded;
nothing is fetched). Without it, a small GPT-2 with random weights and a byte-level BPE
tokenizer trained on the text is written to ``checkpoints/hf_small_gpt2`` once and used.
Data: the Python Language Reference's topics (installed with Python: real text, offline),
5 % held out for evaluation. ``Trainer`` mode trains on fixed windows of tokens; ``sft``
mode hands TRL's ``SFTTrainer`` a ``datasets.Dataset`` of text passages, which it tokenizes.

At the end the main process prints the evaluation loss and the bytes each rank sent per
optimizer step next to what DDP's fp32 allreduce would have sent. The same figures are in
``Trainer``'s logs (``comm/bytes_per_step``, ``comm/ratio_vs_fp32``) and progress bar.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from examples.causal_lm import reference_manual_text  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="a local Hugging Face causal LM directory (default: a small GPT-2)")
    p.add_argument("--trainer", choices=["trainer", "sft"], default="trainer",
                   help="LowBitTrainer, or TRL's SFTTrainer through LowBitTrainerMixin")
    p.add_argument("--max-steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="per rank and micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--seq", type=int, default=128, help="tokens per training window")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="Trainer's default; 0 turns clipping off")
    p.add_argument("--optim-args", default=None, help="the optimizer's other arguments, e.g. 'freeze_step=10'")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps too (0: at the end only)")
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--save-steps", type=int, default=0, help="write a checkpoint every N steps (0: none)")
    p.add_argument("--resume", default=None, help="a checkpoint folder, or 'last' for the newest in --output-dir")
    p.add_argument("--output-dir", default="checkpoints/hf_trainer")
    p.add_argument("--fsdp", nargs="?", const="args", choices=["args", "model"], default=None,
                   help="sharded inside each node, the low-bit exchange across nodes (node size: "
                        "LOWBIT_RANKS_PER_NODE or the launcher's): 'args' (the default) through the Trainer's FSDP "
                        "arguments (fsdp='full_shard', fsdp_config version 2); 'model': the script shards the model "
                        "itself (fully_shard over lowbit_strategy.sharding_mesh) before handing it over")
    p.add_argument("--report-to", default="none", help="Trainer's report_to: none, tensorboard, wandb, ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--summary", default="", help="write a JSON summary here (main process)")
    return p.parse_args(argv)


# ---- model and data --------------------------------------------------------------------
def small_gpt2(path: Path, context: int, vocab: int = 1024) -> Path:
    """A GPT-2 with random weights (4 layers, 128 wide) and a byte-level BPE tokenizer trained
    on the text, written as a downloaded model would be. Offline, a few seconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([reference_manual_text()], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=max(context, 128), n_embd=128, n_layer=4,
                        n_head=4, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


class TokenWindows(torch.utils.data.Dataset):
    """Consecutive windows of ``seq`` tokens as ``Trainer`` inputs (labels = inputs; the model shifts)."""

    def __init__(self, tokens: torch.Tensor, seq: int):
        self.tokens, self.seq = tokens, seq

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.tokens[i * self.seq:(i + 1) * self.seq]
        return {"input_ids": window, "labels": window.clone()}


def shard(model) -> None:
    """Each transformer block, then the root, ``fully_shard``-ed over the node (the process group
    exists: TrainingArguments set it up)."""
    from torch.distributed.fsdp import fully_shard

    import lowbit_strategy

    mesh = lowbit_strategy.sharding_mesh("cuda" if torch.cuda.is_available() else "cpu",
                                         lowbit_strategy.LowBitConfig.from_env())
    blocks = set(model._no_split_modules or [])
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])


def passages(text: str, chars: int) -> list[str]:
    """The text cut at blank lines into passages of about ``chars`` characters."""
    out, current = [], ""
    for para in text.split("\n\n"):
        if current and len(current) + len(para) > chars:
            out.append(current)
            current = ""
        current = f"{current}\n\n{para}" if current else para
    return out + ([current] if current else [])


# ---- the run ---------------------------------------------------------------------------
def main(argv=None) -> dict:
    args = parse(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments, default_data_collator

    from lowbit_strategy.hf import LowBitTrainer, LowBitTrainerMixin

    common = dict(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        optim_args=args.optim_args, bf16=args.bf16, ddp_find_unused_parameters=False,
        # the last evaluation runs inside train() (eval_steps defaults to max_steps): one evaluate()
        # after train() would reopen the tensorboard writer train() closed, and tensorboardX names
        # event files by the second, so within the same second it truncates the training's file
        eval_strategy="steps", eval_steps=args.eval_steps or args.max_steps,
        logging_steps=args.logging_steps, save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500, report_to=args.report_to, seed=args.seed, data_seed=args.seed,
        lr_scheduler_type="cosine", warmup_steps=max(1, args.max_steps // 10), dataloader_num_workers=0,
        disable_tqdm=False, use_cpu=not torch.cuda.is_available(),  # CPU processes: one gloo group
    )
    if args.fsdp == "args":  # each GPT2Block (the model's _no_split_modules) one FSDP unit, then the root
        common.update(fsdp="full_shard", fsdp_config={"fsdp_version": 2})
    if args.gradient_checkpointing:  # (its name since transformers 5; gradient_checkpointing before)
        name = "activation_checkpointing" if hasattr(TrainingArguments, "activation_checkpointing") else (
            "gradient_checkpointing")
        common[name] = True
    if args.trainer == "sft":
        from trl import SFTConfig

        training_args = SFTConfig(**common, max_length=args.seq, dataset_text_field="text", packing=False)
    else:
        training_args = TrainingArguments(**common)

    model_dir = Path(args.model) if args.model else ROOT / "checkpoints" / "hf_small_gpt2"
    with training_args.main_process_first(desc="writing the small GPT-2"):
        if not args.model and not (model_dir / "config.json").exists():
            small_gpt2(model_dir, args.seq)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if tokenizer.pad_token is None:  # (GPT-2's way: padded positions are left out of the loss)
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    if args.fsdp == "model":
        shard(model)

    text = reference_manual_text()
    cut = int(len(text) * 0.95)
    if args.trainer == "sft":
        from datasets import Dataset
        from trl import SFTTrainer

        class LowBitSFTTrainer(LowBitTrainerMixin, SFTTrainer):
            """TRL's SFTTrainer with low-bit synchronization: the mixin goes first."""

        train = Dataset.from_dict({"text": passages(text[:cut], 4 * args.seq)})
        held_out = Dataset.from_dict({"text": passages(text[cut:], 4 * args.seq)})
        trainer = LowBitSFTTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=held_out,
                                   processing_class=tokenizer)
    else:
        tokens = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
        split = int(len(tokens) * 0.95)
        trainer = LowBitTrainer(model=model, args=training_args, train_dataset=TokenWindows(tokens[:split], args.seq),
                                eval_dataset=TokenWindows(tokens[split:], args.seq), data_collator=default_data_collator)

    resume = args.resume
    if resume == "last":
        from transformers.trainer_utils import get_last_checkpoint

        resume = get_last_checkpoint(args.output_dir)
    trainer.train(resume_from_checkpoint=resume)
    final = [e for e in trainer.state.log_history if "eval_loss" in e and e.get("step") == trainer.state.global_step]
    evaluation = final[-1] if final else trainer.evaluate()
    return report(args, trainer, evaluation)


def report(args, trainer, evaluation: dict) -> dict:
    """Print the figures (main process) and write the JSON summary the tests read."""
    meter = trainer.lowbit_meter
    totals = meter.summary(trainer.state.global_step)
    digest = hashlib.sha256()
    for p in trainer.model.parameters():  # (a sharded parameter gathered whole: a collective)
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        digest.update(p.detach().float().cpu().numpy().tobytes())
    digests = [digest.hexdigest()]
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1:
        digests = [None] * world
        dist.all_gather_object(digests, digest.hexdigest())
    summary = {
        "world_size": world,
        "algorithm": trainer.lowbit_config.algorithm,
        "trainer": [cls.__name__ for cls in type(trainer).__mro__],
        "optimizer": f"{type(trainer.optimizer.optimizer).__module__}.{type(trainer.optimizer.optimizer).__name__}",
        "param_groups": [[len(g["params"]), g["weight_decay"]] for g in trainer.optimizer.optimizer.param_groups],
        "global_step": trainer.state.global_step,
        "bytes_per_step": totals["comm/bytes_per_step"],
        "ddp_bytes_per_step": meter.ddp_bytes_per_step,
        "eval_loss": evaluation.get("eval_loss"),
        "log_history": trainer.state.log_history,
        # sharded (--fsdp): the share of the model each rank holds, and the fp32 figure is HSDP's
        # all-reduce of the shards across nodes
        "local_fraction": sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in trainer.model.parameters())
        / sum(p.numel() for p in trainer.model.parameters()),
        "params_sha256": digests[0],
        "replicas_identical": len(set(digests)) == 1,
    }
    if trainer.is_world_process_zero():
        sent, ddp = summary["bytes_per_step"], summary["ddp_bytes_per_step"]
        print(f"algorithm {summary['algorithm']} on {world} processes, {summary['global_step']} steps: "
              f"eval loss {summary['eval_loss']:.4f}")
        fp32 = "DDP fp32 allreduce" if summary["local_fraction"] == 1 else "HSDP fp32 all-reduce of the shards"
        print(f"bytes sent per step per rank: {sent:,.0f} ({fp32}: {ddp:,.0f}; "
              f"{ddp / sent if sent else 1.0:.1f}x less)")
        # the optimizer-level algorithms send fp32 during their warm-up: the last logging
        # window shows the compressed phase alone
        windows = [(e["step"], e["comm/bytes_per_step"]) for e in trainer.state.log_history
                   if "loss" in e and "comm/bytes_per_step" in e]
        if len(windows) > 1 and windows[-1][1] != sent:
            (first, _), (last, late) = windows[-2], windows[-1]
            print(f"  steps {first + 1}-{last}: {late:,.0f} per step ({ddp / late if late else 1.0:.1f}x less)")
        if args.summary:
            Path(args.summary).write_text(json.dumps(summary, indent=1, default=str))
    return summary


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
    if dist.is_available() and dist.is_initialized():  # every rank done before any leaves
        dist.barrier()
        dist.destroy_process_group()
