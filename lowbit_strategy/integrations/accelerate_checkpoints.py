"""The Accelerate front end's checkpoints: every rank's own low-bit state beside Accelerate's
files, and save/load that fail on every rank together (:class:`RankStateCheckpoints`, a
mixin of :class:`~lowbit_strategy.integrations.accelerate.LowBitAccelerator`)."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any, cast

import torch

from lowbit_strategy import rank_state
from lowbit_strategy.algorithms.base import Sync
from lowbit_strategy.integrations.ddp import load_rank_states

logger = logging.getLogger(__name__)

#: the index of every rank's low-bit state files, written by ``save_state`` beside Accelerate's files
STATE_FILE = "lowbit_rank_states.pt"


class RankStateCheckpoints:
    """``save_state`` / ``load_state`` of a :class:`LowBitAccelerator` (which registers
    :meth:`_save_lowbit_states` and :meth:`_remember_load_dir` as Accelerate's pre-hooks)."""

    if TYPE_CHECKING:  # provided by LowBitAccelerator and Accelerator
        lowbit_config: Any
        num_processes: int
        _lowbit_load_dir: str | None

        @property
        def lowbit_syncs(self) -> list[Sync]: ...

        def wait_for_everyone(self) -> None: ...

        def _without_sharded(self) -> contextlib.AbstractContextManager[None]: ...

        def save_sharded_state(self, output_dir: str) -> None: ...

        def load_sharded_state(self, input_dir: str) -> None: ...

    # ---- checkpoints: every rank's own state ----------------------------------------
    def _save_lowbit_states(self, models, weights, output_dir: str) -> None:
        """``save_state`` pre-hook (every rank runs it): every rank writes its own state of
        each prepared model to ``lowbit_rank_states/model_<k>/`` (a failed write on any rank
        raises on every rank); the main process writes their index, :data:`STATE_FILE`. Sharded
        models and their optimizers go to ``sharded_model_<k>/`` first (DCP)."""
        if not self.lowbit_syncs:
            return
        self.save_sharded_state(output_dir)
        entries = [
            rank_state.save_files(sync.state_dict(), _model_dir(output_dir, k), sync.group)  # collective
            for k, sync in enumerate(self.lowbit_syncs)
        ]
        if entries[0] is not None:
            torch.save(
                {"algorithm": self.lowbit_config.algorithm, "models": entries}, os.path.join(output_dir, STATE_FILE)
            )

    def save_state(self, output_dir: str | None = None, *args: Any, **kwargs: Any):
        """Accelerate's ``save_state`` plus every rank's low-bit state (call it on every rank,
        as Accelerate asks). Returns once every rank's files are written; if writing failed on
        any rank (the main process writes the model and optimizer files), every rank raises
        the same error, instead of the others waiting for it until the process group's timeout."""

        def save() -> Any:
            with self._without_sharded():  # (saved by the pre-hook, through DCP)
                return cast(Any, super(RankStateCheckpoints, self)).save_state(output_dir, *args, **kwargs)

        location = rank_state.together("save_state", save)
        self.wait_for_everyone()
        return location

    def _remember_load_dir(self, models, input_dir: str) -> None:
        self._lowbit_load_dir = input_dir

    def load_state(self, input_dir: str | None = None, *args: Any, **kwargs: Any):
        """Accelerate's ``load_state``, then each rank's own low-bit state (its momenta, error
        buffers, hook iteration) over the main process's optimizer state Accelerate loaded."""
        self._lowbit_load_dir = None

        # a rank that cannot read the checkpoint fails in Accelerate's load before the others'
        # next collective: every rank learns it here and raises, naming the ranks
        def load() -> Any:
            with self._without_sharded():
                return cast(Any, super(RankStateCheckpoints, self)).load_state(input_dir, *args, **kwargs)

        result = rank_state.together("load_state", load)
        if self._lowbit_load_dir is not None:
            self.load_lowbit_state(self._lowbit_load_dir)
        return result

    def save_lowbit_state(self, output_dir: str) -> None:
        """Every rank's own low-bit state of each prepared model into ``output_dir`` (what
        ``save_state`` adds to Accelerate's files), and the sharded models with their optimizers
        (DCP), for front ends that write the rest of a checkpoint themselves (the Hugging Face
        ``Trainer``). Collective: call it on every rank."""
        self._save_lowbit_states(None, None, output_dir)

    def load_lowbit_state(self, input_dir: str) -> None:
        """Each rank's own low-bit state from ``input_dir`` (written by :meth:`save_lowbit_state`
        or ``save_state``), loaded *after* the optimizer's state; at another world size the
        algorithm's merge, with a logged warning; the sharded models and their optimizers first.
        Collective: call it on every rank."""
        if self.lowbit_syncs:
            self.load_sharded_state(input_dir)
            self._load_lowbit_states(input_dir)
        elif os.path.exists(os.path.join(input_dir, STATE_FILE)):
            logger.info(
                "lowbit: one process, nothing to synchronize: the ranks' low-bit state in %s is not used; "
                "the optimizer continues from the main process's state",
                input_dir,
            )

    def _load_lowbit_states(self, input_dir: str) -> None:
        path = os.path.join(input_dir, STATE_FILE)
        algorithm = self.lowbit_config.algorithm
        # every rank reads the index itself: a rank that cannot see it must not start afresh alone
        missing = rank_state.failing_ranks(not os.path.exists(path), self.lowbit_syncs[0].group)
        if missing and len(missing) < self.num_processes:
            raise FileNotFoundError(
                f"lowbit: rank(s) {missing} cannot see {path}, the others can: resume from storage every rank "
                "can read (or copy the checkpoint to each node)"
            )
        saved = torch.load(path, map_location="cpu", weights_only=True) if not missing else None
        if saved is None or saved.get("algorithm") != algorithm:
            logger.warning(
                "lowbit: %s holds no %s rank-local state; every rank starts from the main process's optimizer state",
                input_dir,
                algorithm,
            )
            return
        if len(saved["models"]) != len(self.lowbit_syncs):
            raise ValueError(
                f"{path} holds the low-bit state of {len(saved['models'])} models, but this "
                f"accelerator prepared {len(self.lowbit_syncs)}; prepare the same models as the "
                "run that saved it"
            )
        for k, (sync, entry) in enumerate(zip(self.lowbit_syncs, saved["models"])):
            if entry.get("format") == "files":
                merge = sync.algorithm.merge_states if sync.algorithm is not None else None
                what = f"{algorithm} rank-local buffers"
                sync.load_state_dict(rank_state.load_files(entry, _model_dir(input_dir, k), merge, what, sync.group))
            else:  # a state file of lowbit-strategy 0.1: every rank's state in the entry
                load_rank_states(sync, entry)


def _model_dir(directory: str, k: int) -> str:
    """Where each rank's state of the ``k``-th prepared model goes, inside a ``save_state`` folder."""
    return os.path.join(directory, "lowbit_rank_states", f"model_{k}")
