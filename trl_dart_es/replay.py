"""Batch planning for DART-ES: an epoch-shuffled pass over the train set plus targeted replay.

Spec step 1 and the replay eligibility rules (docs/method.md). Each ES step gets ``R = round(rho * B)``
replay slots (Python's ``round``; at most ``B - 1``; 0 without replay) and ``B - R`` fresh problems from
the current epoch's permutation. Replays are drawn without replacement, with probability proportional to
``exp(-kappa * pbar)``, among the buffered problems that are eligible at step ``t``:

* not among this step's fresh problems;
* replayed fewer than ``max_replays_per_epoch`` times in the current epoch;
* ``t - last_replay_step > replay_cooldown`` (never replayed: eligible);
* ``pbar < tau``.

Too few eligible problems: fresh problems fill the remaining slots. The batch is then shuffled.

Randomness is a pure function of ``seed`` and the epoch (permutations) or the step (replay draws and
the final shuffle), so the planner's state is a few counters and resuming it continues the exact same
sequence of batches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .difficulty import DifficultyState

__all__ = ["BatchPlanner", "PlannedBatch"]

_PERMUTATION, _REPLAY = 0, 1  # stream tags for the seeded generators


@dataclass
class PlannedBatch:
    """One ES step's problems. ``replayed[i]`` tells whether ``ids[i]`` came from the replay buffer."""

    ids: list[str]
    replayed: list[bool]
    step: int
    epoch: int
    num_replayed: int = field(default=0)

    def __len__(self) -> int:
        return len(self.ids)


class BatchPlanner:
    """Plans the problems of every ES step: ``B - R`` fresh ones plus up to ``R`` targeted replays.

    Args:
        ids: the train set's problem ids (unique strings; their order only matters through ``seed``).
        batch_size: problems per ES step, B.
        replay_ratio: rho in [0, 1); ``R = min(round(rho * B), B - 1)`` replay slots.
        max_replays_per_epoch: how often one problem may be replayed within an epoch.
        replay_cooldown: a problem replayed at step s is eligible again from step ``s + cooldown + 1``.
        seed: seeds the epoch permutations, replay draws and batch shuffles.
        use_replay: False gives R = 0 (plain ES batches).
    """

    def __init__(
        self,
        ids: Sequence[str],
        batch_size: int,
        *,
        replay_ratio: float = 0.2,
        max_replays_per_epoch: int = 2,
        replay_cooldown: int = 1,
        seed: int = 0,
        use_replay: bool = True,
    ) -> None:
        ids = list(ids)
        index: dict[str, int] = {}
        for i, pid in enumerate(ids):
            if not isinstance(pid, str):
                raise TypeError(f"problem ids must be str, got {type(pid).__name__} {pid!r} at position {i}")
            if pid in index:
                raise ValueError(f"duplicate problem id {pid!r} (positions {index[pid]} and {i})")
            index[pid] = i
        if not ids:
            raise ValueError("BatchPlanner needs at least one problem id")
        if int(batch_size) != batch_size or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if batch_size > len(ids):
            raise ValueError(f"batch_size={batch_size} is larger than the train set ({len(ids)} problems)")
        if not 0.0 <= replay_ratio < 1.0:
            raise ValueError(f"replay_ratio must be in [0, 1), got {replay_ratio}")
        if int(max_replays_per_epoch) != max_replays_per_epoch or max_replays_per_epoch < 0:
            raise ValueError(f"max_replays_per_epoch must be an integer >= 0, got {max_replays_per_epoch}")
        if int(replay_cooldown) != replay_cooldown or replay_cooldown < 0:
            raise ValueError(f"replay_cooldown must be an integer >= 0, got {replay_cooldown}")
        if int(seed) != seed or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        self.ids = ids
        self._index = index
        self.batch_size = int(batch_size)
        self.replay_ratio = float(replay_ratio)
        self.max_replays_per_epoch = int(max_replays_per_epoch)
        self.replay_cooldown = int(replay_cooldown)
        self.seed = int(seed)
        self.use_replay = bool(use_replay)
        self.num_replay_slots = (
            min(round(self.replay_ratio * self.batch_size), self.batch_size - 1) if use_replay else 0
        )

        self.step = 0
        self.epoch = 0
        self._order: list[int] = self._permutation(0)  # remaining fresh problems of the current epoch
        self._replays_this_epoch: dict[str, int] = {}
        self._last_replay_step: dict[str, int] = {}

    # ------------------------------------------------------------------------------------------ helpers
    @property
    def num_fresh(self) -> int:
        return self.batch_size - self.num_replay_slots

    @property
    def steps_per_epoch(self) -> int:
        """``ceil(len(ids) / (B - R))``: steps per pass over the train set when every replay slot is used."""
        return math.ceil(len(self.ids) / self.num_fresh)

    @property
    def epoch_progress(self) -> float:
        """Epochs completed so far, with the fraction of the current one (1.5 = halfway through epoch 2)."""
        return self.epoch + 1.0 - len(self._order) / len(self.ids)

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence([self.seed, *key]))

    def _permutation(self, epoch: int) -> list[int]:
        return self._rng(_PERMUTATION, epoch).permutation(len(self.ids)).tolist()

    def _take_fresh(self, k: int, taken: set[str]) -> list[str]:
        """The next ``k`` fresh ids not in ``taken``, rolling over into a new epoch when this one runs out.

        Ids already in the batch are skipped but stay at the front of the epoch, for the next batch.
        """
        out: list[str] = []
        while len(out) < k:
            if not self._order:
                self.epoch += 1
                self._order = self._permutation(self.epoch)
                self._replays_this_epoch = {}
            skipped: list[int] = []
            pos = 0
            while pos < len(self._order) and len(out) < k:
                idx = self._order[pos]
                pid = self.ids[idx]
                if pid in taken:
                    skipped.append(idx)
                else:
                    out.append(pid)
                    taken.add(pid)
                pos += 1
            self._order = skipped + self._order[pos:]
            if len(out) < k and len(self._order) == len(skipped):
                # What is left of this epoch is already in the batch (e.g. as a replay): it counts as
                # visited; finish the epoch and go on with the next one.
                self._order = []
        return out

    def _eligible(self, difficulty: DifficultyState, fresh: set[str]) -> list[str]:
        tau = difficulty.replay_pass_threshold
        out = []
        for pid in difficulty.replay_buffer:
            if pid not in self._index or pid in fresh:
                continue
            if self._replays_this_epoch.get(pid, 0) >= self.max_replays_per_epoch:
                continue
            last = self._last_replay_step.get(pid)
            if last is not None and self.step - last <= self.replay_cooldown:
                continue
            pbar = difficulty.pass_rate(pid)
            if pbar is None or pbar >= tau:
                continue
            out.append(pid)
        # Sets iterate in a per-process order (string hashing): sort so every process draws the same.
        out.sort(key=self._index.__getitem__)
        return out

    # --------------------------------------------------------------------------------------------- plan
    def next_batch(self, difficulty: DifficultyState) -> PlannedBatch:
        """Plan the next step's batch. Replay needs the difficulty state (buffer, pbar, kappa, tau)."""
        taken: set[str] = set()
        fresh = self._take_fresh(self.num_fresh, taken)
        replays: list[str] = []
        rng = self._rng(_REPLAY, self.step)
        if self.num_replay_slots:
            eligible = self._eligible(difficulty, set(fresh))
            k = min(self.num_replay_slots, len(eligible))
            if k:
                pbar = np.array([difficulty.pass_rate(pid) for pid in eligible], dtype=np.float64)
                logits = -difficulty.weight_exponent * pbar
                p = np.exp(logits - logits.max())
                chosen = rng.choice(len(eligible), size=k, replace=False, p=p / p.sum())
                replays = [eligible[i] for i in chosen.tolist()]
                for pid in replays:
                    self._replays_this_epoch[pid] = self._replays_this_epoch.get(pid, 0) + 1
                    self._last_replay_step[pid] = self.step
            taken.update(replays)
            if k < self.num_replay_slots:  # too few eligible: fresh problems fill the slots
                fresh += self._take_fresh(self.num_replay_slots - k, taken)
        ids = fresh + replays
        flags = [False] * len(fresh) + [True] * len(replays)
        perm = rng.permutation(len(ids)).tolist()
        batch = PlannedBatch(
            ids=[ids[i] for i in perm],
            replayed=[flags[i] for i in perm],
            step=self.step,
            epoch=self.epoch,
            num_replayed=len(replays),
        )
        self.step += 1
        return batch

    # -------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable planner state; all randomness is re-derived from ``seed``, epoch and step."""
        return {
            "seed": self.seed,
            "num_ids": len(self.ids),
            "step": self.step,
            "epoch": self.epoch,
            "order": list(self._order),
            "replays_this_epoch": dict(self._replays_this_epoch),
            "last_replay_step": dict(self._last_replay_step),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_ids"] != len(self.ids):
            raise ValueError(
                f"planner state is for a train set of {state['num_ids']} problems, this one has {len(self.ids)}"
            )
        if state["seed"] != self.seed:
            raise ValueError(
                f"planner state was saved with seed={state['seed']}, this planner has seed={self.seed}"
            )
        order = [int(i) for i in state["order"]]
        if any(not 0 <= i < len(self.ids) for i in order) or len(set(order)) != len(order):
            raise ValueError("planner state has an invalid epoch order")
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self._order = order
        self._replays_this_epoch = {str(k): int(v) for k, v in state["replays_this_epoch"].items()}
        self._last_replay_step = {str(k): int(v) for k, v in state["last_replay_step"].items()}
