"""DART-ES as an ask/tell strategy (in the style of evosax): batches, seeds and fitness, no model code.

::

    strategy = DartES(train_ids, population_size=8, batch_size=16)
    params = EvolvedParameters(model, sigma=1e-3)
    for _ in range(steps):
        batch, members = strategy.ask()
        rewards = ...  # K x N x B: reward function x member x problem, member n evaluated at theta + sigma eps_n
        result = strategy.tell(batch, rewards)
        if result.z is not None:  # None: every member had the same fitness, no signal, skip
            params.update(members, result.z, lr)

Plain ES (Qiu et al. 2025) is ``use_difficulty_reweighting=False, use_targeted_replay=False``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .difficulty import DifficultyState
from .fitness import FITNESS_SHAPING, dart_fitness, shape_fitness, solved_matrix
from .layout import PopulationLayout, centre_fitness
from .noise import Member, derive_step_seed, population
from .replay import BatchPlanner, PlannedBatch

__all__ = ["DartES", "TellResult"]


@dataclass
class TellResult:
    """What one ES step produced.

    Attributes:
        z: shaped fitness (length N), the coefficients of the update; None when there was no signal.
        weights: the B problem weights used (ones without reweighting).
        fitness: the N raw fitness values.
        solved: N x B 0/1 matrix.
        pass_rate: the B per-problem pass rates p_j of this step.
        metrics: scalar metrics for logging.
    """

    z: np.ndarray | None
    weights: np.ndarray
    fitness: np.ndarray
    solved: np.ndarray
    pass_rate: np.ndarray
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def skipped(self) -> bool:
        return self.z is None


class DartES:
    """Ask/tell DART-ES: plans each step's batch and population, turns rewards into update coefficients.

    Args:
        train_ids: stable string ids of the train problems.
        population_size: N.
        batch_size: problems per ES step, B.
        antithetic: members in (+eps, -eps) pairs (N must be even).
        seed: seeds member noise (with the step), epoch permutations and replay draws.
        reward_weights: beta, one per reward function (K values).
        primary_index: the correctness reward; defines "solved" and gets the difficulty weights.
        solved_threshold: a member solves a problem when its primary reward is >= this.
        fitness_shaping: "zscore" (reference), "rank", or "running-zscore" (centred fitness over the mean
            fitness std of the steps so far, this one included; see :func:`~trl_dart_es.fitness.shape_fitness`).
        use_difficulty_reweighting: off -> w = 1.
        use_targeted_replay: off -> no replay slots (R = 0).
        ema_decay, weight_floor, weight_exponent, replay_pass_threshold, zero_pass_patience: see
            :class:`~trl_dart_es.difficulty.DifficultyState`.
        replay_ratio, max_replays_per_epoch, replay_cooldown: see :class:`~trl_dart_es.replay.BatchPlanner`.
        population_layout: "shared" (reference: every member scores every problem) or "grouped" (groups of
            ``members_per_group`` members each score their own block of the batch, fitness centred per group);
            see :mod:`~trl_dart_es.layout`.
        members_per_group: M of the grouped layout.
    """

    def __init__(
        self,
        train_ids: Sequence[str],
        *,
        population_size: int,
        batch_size: int,
        antithetic: bool = False,
        seed: int = 0,
        reward_weights: Sequence[float] = (1.0,),
        primary_index: int = 0,
        solved_threshold: float = 1.0,
        fitness_shaping: str = "zscore",
        use_difficulty_reweighting: bool = True,
        use_targeted_replay: bool = True,
        ema_decay: float = 0.7,
        weight_floor: float = 0.8,
        weight_exponent: float = 3.0,
        replay_pass_threshold: float = 0.5,
        zero_pass_patience: int = 2,
        replay_ratio: float = 0.2,
        max_replays_per_epoch: int = 2,
        replay_cooldown: int = 1,
        population_layout: str = "shared",
        members_per_group: int | None = None,
    ) -> None:
        if int(population_size) != population_size or population_size < 2:
            raise ValueError(f"population_size must be an integer >= 2, got {population_size!r}")
        if antithetic and population_size % 2:
            raise ValueError(f"antithetic sampling needs an even population_size, got {population_size}")
        if fitness_shaping not in FITNESS_SHAPING:
            raise ValueError(f"fitness_shaping must be one of {FITNESS_SHAPING}, got {fitness_shaping!r}")
        self.layout = PopulationLayout(population_layout, members_per_group)
        self.layout.check(int(population_size), int(batch_size), bool(antithetic))
        if self.layout.grouped and fitness_shaping == "rank":
            raise ValueError(
                "fitness_shaping='rank' is not defined for population_layout='grouped' (fitness is centred per "
                "group): use 'zscore' or 'running-zscore'"
            )
        self.reward_weights = np.asarray(reward_weights, dtype=np.float64)
        if self.reward_weights.ndim != 1 or self.reward_weights.size == 0:
            raise ValueError(f"reward_weights must be a non-empty list, got {reward_weights!r}")
        if not 0 <= primary_index < self.reward_weights.size:
            raise ValueError(
                f"primary_index={primary_index} is out of range for {self.reward_weights.size} reward functions"
            )
        self.population_size = int(population_size)
        self.antithetic = bool(antithetic)
        self.seed = int(seed)
        self.primary_index = int(primary_index)
        self.solved_threshold = float(solved_threshold)
        self.fitness_shaping = fitness_shaping
        self.use_difficulty_reweighting = bool(use_difficulty_reweighting)
        self.use_targeted_replay = bool(use_targeted_replay)
        self.difficulty = DifficultyState(
            ema_decay=ema_decay,
            weight_floor=weight_floor,
            weight_exponent=weight_exponent,
            replay_pass_threshold=replay_pass_threshold,
            zero_pass_patience=zero_pass_patience,
        )
        self.planner = BatchPlanner(
            train_ids,
            batch_size,
            replay_ratio=replay_ratio,
            max_replays_per_epoch=max_replays_per_epoch,
            replay_cooldown=replay_cooldown,
            seed=seed,
            use_replay=use_targeted_replay,
        )
        self.step = 0
        # running-zscore: sum and count of the per-step fitness stds (steps with any signal)
        self._fitness_std_sum = 0.0
        self._fitness_std_count = 0
        self._pending: tuple[PlannedBatch, list[Member]] | None = None
        self._planner_before_pending: dict[str, Any] = {}

    @property
    def num_reward_funcs(self) -> int:
        return self.reward_weights.size

    def members(self, step: int) -> list[Member]:
        """The population of ES step ``step`` (a pure function of ``seed`` and ``step``)."""
        return population(derive_step_seed(self.seed, step), self.population_size, self.antithetic)

    def columns(self, batch: PlannedBatch) -> list[list[int]]:
        """For each member, the columns of `batch` it scores (all of them in the shared layout)."""
        return self.layout.columns(self.population_size, len(batch.ids))

    def ask(self) -> tuple[PlannedBatch, list[Member]]:
        """The current step's batch and population. Asking again before :meth:`tell` returns the same."""
        if self._pending is None:
            self._planner_before_pending = self.planner.state_dict()
            batch = self.planner.next_batch(self.difficulty)
            self._pending = (batch, self.members(self.step))
        batch, members = self._pending
        return batch, list(members)

    def tell(self, batch: PlannedBatch, rewards) -> TellResult:
        """Record the rewards of the batch from :meth:`ask` and compute the update coefficients.

        Args:
            batch: the batch returned by the last :meth:`ask`.
            rewards: K x N x B rewards (reward function x member x problem, columns in ``batch.ids``
                order). NaN marks a missing reward (left out of that member's means; never "solved"). In a
                grouped layout a member's rewards outside its :meth:`columns` are not read.
        """
        if self._pending is None or batch is not self._pending[0]:
            raise RuntimeError("tell() needs the batch returned by the last ask()")
        r = np.asarray(rewards, dtype=np.float64)
        expected = (self.num_reward_funcs, self.population_size, len(batch.ids))
        if r.shape != expected:
            raise ValueError(f"rewards must have shape (K, N, B) = {expected}, got {r.shape}")

        scored = None
        if self.layout.grouped:
            scored = self.layout.mask(self.population_size, len(batch.ids))
            r = np.where(scored[None], r, np.nan)
        solved = solved_matrix(r[self.primary_index], self.solved_threshold)
        pass_rate = solved.mean(axis=0) if scored is None else solved.sum(axis=0) / scored.sum(axis=0)
        # always tracked: it drives replay and logs
        difficulty_w = self.difficulty.update(batch.ids, solved, scored)
        weights = difficulty_w if self.use_difficulty_reweighting else np.ones(len(batch.ids))
        fitness = dart_fitness(r, weights, self.reward_weights, primary_index=self.primary_index)
        z = self._shape(fitness)

        metrics = {
            "dart/pass_rate_mean": float(pass_rate.mean()),
            "dart/frac_solved_by_none": float((pass_rate == 0).mean()),
            "dart/frac_solved_by_all": float((pass_rate == 1).mean()),
            "dart/buffer_size": float(len(self.difficulty.replay_buffer)),
            "dart/num_replayed": float(batch.num_replayed),
            "dart/weight_mean": float(weights.mean()),
            "dart/weight_max": float(weights.max()),
            "fitness/mean": float(fitness.mean()),
            "fitness/std": float(fitness.std()),
            "es/skipped": float(z is None),
            "dart/epoch": float(self.planner.epoch_progress),
        }
        self.step += 1
        self._pending = None
        return TellResult(
            z=z, weights=weights, fitness=fitness, solved=solved, pass_rate=pass_rate, metrics=metrics
        )

    def _shape(self, fitness: np.ndarray) -> np.ndarray | None:
        groups = self.layout.groups(self.population_size) if self.layout.grouped else None
        if self.fitness_shaping != "running-zscore":
            return shape_fitness(fitness, self.fitness_shaping, groups=groups)
        std = float(fitness.std() if groups is None else centre_fitness(fitness, groups).std())
        scale = (self._fitness_std_sum + std) / (self._fitness_std_count + 1)  # this step included
        z = shape_fitness(fitness, "running-zscore", scale=scale, groups=groups)
        # Counted only once shape_fitness accepted it: a step with no signal (z None) is skipped and left out of
        # the scale, and non-finite fitness raises before it can enter the saved state.
        if z is not None:
            self._fitness_std_sum += std
            self._fitness_std_count += 1
        return z

    # -------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state of the whole strategy (step, difficulty state, planner, fitness stds).

        A step that was asked but not told is not part of the state: after a resume it is planned again.
        """
        # With a step asked but not told, save the planner as it was before that ask: the resumed run
        # re-plans the same batch.
        planner = self.planner.state_dict() if self._pending is None else self._planner_before_pending
        return {
            "version": 1,
            "step": self.step,
            "config": self._config(),
            "difficulty": self.difficulty.state_dict(),
            "planner": planner,
            "fitness_std": [self._fitness_std_sum, self._fitness_std_count],
        }

    def _config(self) -> dict[str, Any]:
        return {
            "population_size": self.population_size,
            "antithetic": self.antithetic,
            "seed": self.seed,
            "use_difficulty_reweighting": self.use_difficulty_reweighting,
            "use_targeted_replay": self.use_targeted_replay,
            "fitness_shaping": self.fitness_shaping,
            "population_layout": self.layout.kind,
            "members_per_group": self.layout.members_per_group,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Keys a state saved by an older version lacks are not a mismatch.
        saved, current = state.get("config") or {}, self._config()
        changed = {
            key: (saved[key], value) for key, value in current.items() if key in saved and saved[key] != value
        }
        if changed:
            warnings.warn(
                f"resuming a DART-ES state under a different config (saved, now): {changed}", stacklevel=2
            )
        self.difficulty.load_state_dict(state["difficulty"])
        self.planner.load_state_dict(state["planner"])
        self.step = int(state["step"])
        # "fitness_std" is absent from states saved before running-zscore existed
        std_sum, std_count = state.get("fitness_std", (0.0, 0))
        self._fitness_std_sum, self._fitness_std_count = float(std_sum), int(std_count)
        self._pending = None
        if self.planner.step != self.step:
            raise ValueError(
                f"inconsistent state: strategy step {self.step}, planner step {self.planner.step}"
            )
