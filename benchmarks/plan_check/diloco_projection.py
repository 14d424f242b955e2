"""DiLoCo projected by ``lowbit-plan``'s model: 8 nodes x 8 H100, 1B and 8B parameters, 1-10 Gbit/s
between nodes, 1M tokens per step. Prints a Markdown table (step seconds and x DDP bf16) of DDP
bf16, the fastest per-step method of the plan, and the DiLoCo rows at H = 100 (and 500), and
writes it to ``benchmarks/results/plan_check/diloco_projection.md``. Arithmetic only (seconds).

    python -m benchmarks.plan_check.diloco_projection
"""
from __future__ import annotations

from pathlib import Path

from lowbit_strategy.plan import cli, predict
from lowbit_strategy.plan.recommend import QUALITY_CAVEATS

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "plan_check" / "diloco_projection.md"
PARAMS = (1e9, 8e9)
LINKS = ("1gbit", "10gbit")
SYNC_EVERY = (100, 500)


def rows(params: float, link: str, h: int) -> dict[str, predict.Row]:
    args = cli.parser().parse_args(["--params", f"{params:g}", "--nodes", "8", "--gpus-per-node", "8", "--link", link,
                                    "--gpu", "h100", "--tokens-per-step", "1e6", "--diloco-sync-every", str(h)])
    return {r.key: r for r in predict.predict(cli.setup_from(args))}


def main() -> None:
    lines = ["| model | link | DDP bf16 s/step | best per-step method (no measured loss cost) | its s/step, × DDP bf16 | "
             + " | ".join(f"DiLoCo {c} H={h}" for h in SYNC_EVERY for c in ("fp32", "int4", "1-bit", "stream int4"))
             + " |", "|---|---|---:|---|---:|" + "---:|" * (4 * len(SYNC_EVERY))]
    for params in PARAMS:
        for link in LINKS:
            base = rows(params, link, SYNC_EVERY[0])
            bf16 = base["ddp_bf16"]
            per_step = min((r for k, r in base.items() if not k.startswith(("diloco", "ddp", *QUALITY_CAVEATS))),
                           key=lambda r: r.step_s)
            cells = []
            for h in SYNC_EVERY:
                got = rows(params, link, h)
                for key in ("fp32", "int4", "sign", "streaming_int4"):
                    r = got[f"diloco_{key}_hierarchical"]
                    cells.append(f"{r.step_s:.3g} s, {r.speedup:.2f}×")
            lines.append(f"| {params / 1e9:g}B | {link} | {bf16.step_s:.3g} | {per_step.method} ({per_step.form}) | "
                         f"{per_step.step_s:.3g} s, {per_step.speedup:.2f}× | " + " | ".join(cells) + " |")
    memory = rows(8e9, "1gbit", 100)
    note = (f"\nMemory per GPU (8B, optimizer and outer state, fp32): DDP + AdamW "
            f"{memory['ddp_bf16'].memory_bytes / 2**30:.0f} GiB, DiLoCo int4 "
            f"{memory['diloco_int4_hierarchical'].memory_bytes / 2**30:.0f} GiB (the global copy, outer momentum and "
            "error buffer on every GPU of a node; `--sharded` / `lowbit_diloco_fsdp` divide it by 8).\n")
    text = ("# DiLoCo projected: 8 nodes × 8 H100, 1M tokens per step\n\n"
            "`python -m benchmarks.plan_check.diloco_projection` (lowbit-plan's α–β model, the H100 codec report; "
            "compute from FLOPs at 40 % MFU). DiLoCo's effect on the loss is not in these figures; nor is PowerSGD's "
            "or Lion Cub 1-bit's, which the per-step column leaves out for that reason. The int4 and 1-bit rows "
            "all-gather codes: at 8 workers each node sends 7 payloads per sync.\n\n"
            + "\n".join(lines) + "\n" + note)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
