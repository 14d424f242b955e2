"""Will low-bit sync pay? ``lowbit-plan`` (``python -m lowbit_strategy.plan``) predicts, for a
model on a cluster, each method's bytes on each node's link, step time and memory, against
DDP fp32/bf16 and PowerSGD, and recommends one in a sentence (which may be "use DDP with bf16
communication"). ``--measure`` measures the link under a launcher first.

Modules: :mod:`.inputs` (model shapes, rates, compute time), :mod:`.predict` (the rows),
:mod:`.warmup` (a whole run's time, full-precision warm-ups included: ``--steps``),
:mod:`.recommend` (the sentence), :mod:`.cli` (table, JSON, command line), :mod:`.measure`
(the link, intra-node exchange, compute step and codecs measured on the machines at hand).
"""

from lowbit_strategy.plan.cli import main
from lowbit_strategy.plan.inputs import Model, PlanError
from lowbit_strategy.plan.predict import Row, Setup
from lowbit_strategy.plan.warmup import Run

# (the functions stay in their modules: `plan.predict` names the module, not its function)
__all__ = ["Model", "PlanError", "Row", "Run", "Setup", "main"]
