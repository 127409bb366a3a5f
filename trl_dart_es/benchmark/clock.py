"""The step clock every measurement uses: how long each optimizer step took, and when to stop.

It keeps two readings of the same steps: `step_times` / `train_seconds`, each step from `on_step_begin` to
`on_step_end` (what happens between steps left out: the training time of a budget, `--curves` and the study),
and `wall_step_times`, from one step's end to the next (from `train()`'s start for the first: what a step costs
end to end, the side-by-side benchmark's `step_time_s_median`). `callback()` builds the `TrainerCallback` on
first use: the harness's parent process never imports transformers.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class StepClock:
    """Times optimizer steps; with `budget_s`, `step_end` says when the training seconds are spent."""

    def __init__(self, budget_s: float | None = None, progress: Callable[[str], None] | None = None):
        self.budget_s = None if budget_s is None else float(budget_s)
        self.progress = progress or (lambda text: None)
        self.max_steps: int | None = None
        self.train_seconds = 0.0
        self.step_times: list[float] = []
        self.ends: list[float] = []  # perf_counter at train() start, then at every step end
        self.at_step: dict[int, float] = {}  # training seconds at the end of each step, by global step
        self._step_started: float | None = None

    def train_begin(self, max_steps: int | None = None) -> None:
        self.max_steps = max_steps
        self.ends = [time.perf_counter()]
        self.progress(f"train 0/{max_steps}")

    def step_begin(self) -> None:
        self._step_started = time.perf_counter()

    def _count(self, step: int) -> None:
        """Add the step that just ended to both readings."""
        now = time.perf_counter()
        if self._step_started is not None:
            duration = now - self._step_started
            self._step_started = None
            self.train_seconds += duration
            self.step_times.append(duration)
        self.ends.append(now)
        self.at_step[int(step)] = self.train_seconds

    def spent(self) -> bool:
        return self.budget_s is not None and self.train_seconds >= self.budget_s

    def step_end(self, step: int) -> bool:
        """Count the step just ended; True when the budget is spent (training should stop)."""
        self._count(step)
        self.progress(f"train {step}/{self.max_steps}")
        return self.spent()

    @property
    def wall_step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]

    def callback(self, *, evaluate_last: bool = False):
        """This clock as a TrainerCallback. It stops training when the budget is spent; with `evaluate_last`, it
        also asks the trainer to evaluate the last step, whether the clock or the step count ends the run."""
        from transformers import TrainerCallback

        clock = self

        class StepClockCallback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                clock.train_begin(state.max_steps)

            def on_step_begin(self, args, state, control, **kwargs):
                clock.step_begin()

            def on_step_end(self, args, state, control, **kwargs):
                if clock.step_end(state.global_step):
                    control.should_training_stop = True
                if evaluate_last and (control.should_training_stop or state.global_step >= state.max_steps):
                    control.should_evaluate = True
                return control

        return StepClockCallback()
