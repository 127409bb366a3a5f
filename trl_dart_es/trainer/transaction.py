"""All-or-nothing ES steps, and resumes that refuse a changed trajectory.

A step that raises (Ctrl-C during generation, an engine or reward error, a lost process) is rolled back: the
strategy's state (difficulty, replay buffer, planner, fitness scale), the random number generators, the step's
metrics and the noise cache are put back as they were before the step, so a retry gives the same result as a
clean step. The rollouts restore the weights and clean up their engine themselves. The one write that cannot be
undone cheaply is the ES update itself: Ctrl-C is held back while it runs (the step then completes and training
stops at the step boundary), and any other error inside it marks the trainer as torn.
"""

from __future__ import annotations

import copy
import random
import signal
import threading
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["StepSnapshot", "check_resume_settings", "held_interrupt", "trajectory_settings"]


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    python, numpy_state, torch_state, cuda = state
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


@dataclass
class StepSnapshot:
    """What an ES step may change besides the weights, taken before the step."""

    strategy: dict[str, Any]
    rng: tuple
    metric_lengths: dict[str, int]

    @classmethod
    def take(cls, strategy: Any, metrics: Mapping[str, list]) -> StepSnapshot:
        # The strategy is pure Python and NumPy (ids, pass rates, a planner): a deep copy costs milliseconds.
        return cls(copy.deepcopy(vars(strategy)), _rng_state(), {k: len(v) for k, v in metrics.items()})

    def restore(self, strategy: Any, metrics: dict[str, list]) -> None:
        vars(strategy).clear()
        vars(strategy).update(copy.deepcopy(self.strategy))
        _set_rng_state(self.rng)
        for key in list(metrics):
            if key not in self.metric_lengths:
                del metrics[key]
            else:
                del metrics[key][self.metric_lengths[key] :]


@contextmanager
def held_interrupt() -> Iterator[list[int]]:
    """Hold back SIGINT (Ctrl-C) inside the block; yields a list that records the signals that arrived.

    Only the main thread can install signal handlers; elsewhere the block runs unprotected (and the list stays
    empty).
    """
    arrived: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield arrived
        return
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, lambda signum, frame: arrived.append(signum))
    try:
        yield arrived
    finally:
        signal.signal(signal.SIGINT, previous)


# Settings that change which tensors evolve, the noise, the population or the batches: a resume under other
# values would silently continue a different run. (Others, such as the learning rate, only warn.)
REFUSED_ON_RESUME = (
    "perturbation",
    "sigma",
    "perturbation_rank",
    "population_size",
    "antithetic",
    "seed",
    "per_device_train_batch_size",
    "fitness_shaping",
    "population_layout",
    "members_per_group",
    "use_difficulty_reweighting",
    "use_targeted_replay",
    "exact_restore",
)
WARNED_ON_RESUME = (
    "learning_rate",
    "momentum",
    "lr_scheduler_type",
    "max_completion_length",
    "temperature",
    "reward_weights",
    "primary_reward_index",
    "solved_threshold",
    "replay_ratio",
    "difficulty_ema_decay",
    "difficulty_weight_floor",
    "difficulty_weight_exponent",
    "replay_pass_threshold",
    "max_replays_per_epoch",
    "replay_cooldown",
    "zero_pass_patience",
    "generation_dtype",
)


def trajectory_settings(args: Any, evolved: list[str]) -> dict[str, Any]:
    """The settings saved with a checkpoint and checked on resume, with the names of the evolved tensors."""
    settings = {key: _jsonable(getattr(args, key)) for key in (*REFUSED_ON_RESUME, *WARNED_ON_RESUME)}
    settings["evolved_tensors"] = list(evolved)
    return settings


def check_resume_settings(
    saved: Mapping[str, Any] | None, current: Mapping[str, Any], checkpoint: str
) -> None:
    """Refuse a resume whose trajectory settings differ from the checkpoint's; warn on the softer ones.

    ``saved`` is None for a checkpoint written before these settings were saved: nothing to compare.
    """
    if not saved:
        return

    def differs(key: str) -> bool:
        return key in saved and _jsonable(saved[key]) != _jsonable(current[key])

    refused = [k for k in REFUSED_ON_RESUME if differs(k)]
    lines = [f"{k}: checkpoint {saved[k]!r}, now {current[k]!r}" for k in refused]
    if differs("evolved_tensors"):
        before, now = set(saved["evolved_tensors"]), set(current["evolved_tensors"])
        lines.append(
            "evolved tensors (perturbation, lowrank_targets, lowrank_target_modules, use_vllm with "
            f"lowrank_targets='auto'): {len(before - now)} no longer evolve (e.g. {sorted(before - now)[:3]}), "
            f"{len(now - before)} newly evolve (e.g. {sorted(now - before)[:3]})"
        )
    if lines:
        raise ValueError(
            f"cannot resume from {checkpoint}: these settings change the training trajectory and differ from the "
            "checkpoint's:\n  "
            + "\n  ".join(lines)
            + "\nResume with the checkpoint's settings, or start a new "
            "run from its weights (model=<checkpoint folder>, without resume_from_checkpoint)."
        )
    softer = [f"{k}: checkpoint {saved[k]!r}, now {current[k]!r}" for k in WARNED_ON_RESUME if differs(k)]
    if softer:
        warnings.warn(
            f"resuming from {checkpoint} with changed settings (the run continues under the new values):\n  "
            + "\n  ".join(softer),
            stacklevel=3,
        )


def _jsonable(value: Any) -> Any:
    # Saved settings went through JSON: compare the current ones the same way (tuples become lists).
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return getattr(value, "value", value)  # enums (lr_scheduler_type) by their value
