"""Tasks as TRL-format datasets, with the reward functions that score them.

`load_task_dataset(name, split)` is the single entry point:

- `"openai/gsm8k"`: the real GSM8K from the Hugging Face Hub (needs network);
- `"embedded:gsm8k"`: offline GSM8K-style word problems (`make_synthetic_gsm8k`);
- `"embedded:countdown"`: offline Countdown puzzles (`make_countdown`);
- a local folder: GSM8K in the Hub's layout, MATH-style problems or rows in TRL's format (`load_local_dataset`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from datasets import Dataset

from ..rewards import (
    countdown_accuracy_reward,
    countdown_format_reward,
    gsm8k_accuracy_reward,
    gsm8k_format_reward,
)
from .countdown import COUNTDOWN_SYSTEM_PROMPT, format_countdown_prompt, make_countdown
from .gsm8k import (
    GSM8K_HUB_ID,
    GSM8K_SYSTEM_PROMPT,
    extract_gsm8k_answer,
    format_gsm8k_prompt,
    load_gsm8k,
    make_synthetic_gsm8k,
    to_trl_format,
)
from .local import MATH_SYSTEM_PROMPT, format_math_prompt, load_local_dataset, local_reward_funcs

# Synthetic split sizes when the caller does not pass `num_examples`.
DEFAULT_NUM_EXAMPLES = {"train": 1000, "validation": 128, "test": 128}


@dataclass(frozen=True)
class TaskSpec:
    """A named task: how to load it and how to score it (primary correctness reward first)."""

    name: str
    description: str
    load: Callable[..., Dataset]
    reward_funcs: tuple[Callable[..., list[float | None]], ...]
    # The reference run's weights: correctness 1.0, format 0.1.
    reward_weights: tuple[float, ...] = (1.0, 0.1)


def _load_hub_gsm8k(split: str, *, conversational: bool = True, **kw: Any) -> Dataset:
    return load_gsm8k(split, conversational=conversational, **kw)


def _load_synthetic_gsm8k(
    split: str, *, conversational: bool = True, num_examples: int | None = None, **kw: Any
):
    n = num_examples if num_examples is not None else DEFAULT_NUM_EXAMPLES.get(split, 128)
    return make_synthetic_gsm8k(n, split=split, conversational=conversational, **kw)


def _load_countdown(split: str, *, conversational: bool = True, num_examples: int | None = None, **kw: Any):
    n = num_examples if num_examples is not None else DEFAULT_NUM_EXAMPLES.get(split, 128)
    return make_countdown(n, split=split, conversational=conversational, **kw)


TASKS: dict[str, TaskSpec] = {
    GSM8K_HUB_ID: TaskSpec(
        name=GSM8K_HUB_ID,
        description="GSM8K grade-school math (Hugging Face Hub, config 'main')",
        load=_load_hub_gsm8k,
        reward_funcs=(gsm8k_accuracy_reward, gsm8k_format_reward),
    ),
    "embedded:gsm8k": TaskSpec(
        name="embedded:gsm8k",
        description="offline GSM8K-style word problems with 1-3 arithmetic steps",
        load=_load_synthetic_gsm8k,
        reward_funcs=(gsm8k_accuracy_reward, gsm8k_format_reward),
    ),
    "embedded:countdown": TaskSpec(
        name="embedded:countdown",
        description="offline Countdown puzzles (reach a target with + - * /, each number once)",
        load=_load_countdown,
        reward_funcs=(countdown_accuracy_reward, countdown_format_reward),
    ),
}


def get_task(name: str) -> TaskSpec:
    """The task registered under `name`; a ValueError lists the known names otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"Unknown task {name!r}. Known tasks: {', '.join(sorted(TASKS))}.") from None


def task_reward_funcs(dataset_name: str, column_names: Sequence[str] | None = None) -> list[Callable]:
    """The task's reward functions, primary (correctness) first. For a local dataset folder they follow its
    columns (`column_names`, `local_reward_funcs`): GSM8K's, or TRL's `accuracy_reward` for MATH-style rows."""
    if os.path.isdir(dataset_name):
        return local_reward_funcs(column_names)
    return list(get_task(dataset_name).reward_funcs)


def load_task_dataset(
    name: str, split: str = "train", *, conversational: bool = True, **kwargs: Any
) -> Dataset:
    """Load task `name`'s `split` in TRL's format: conversational prompts (default) or plain strings.

    Extra keyword arguments go to the task's loader (e.g. `num_examples`, `seed`, `levels` for the
    synthetic tasks; `load_dataset` options for the hub task). A local folder loads with `load_local_dataset`.
    """
    if os.path.isdir(name):  # as in `datasets.load_dataset`, a local folder wins over a hub id of that name
        return load_local_dataset(name, split, conversational=conversational, **kwargs)
    return get_task(name).load(split, conversational=conversational, **kwargs)


__all__ = [
    "COUNTDOWN_SYSTEM_PROMPT",
    "DEFAULT_NUM_EXAMPLES",
    "GSM8K_HUB_ID",
    "GSM8K_SYSTEM_PROMPT",
    "MATH_SYSTEM_PROMPT",
    "TASKS",
    "TaskSpec",
    "extract_gsm8k_answer",
    "format_countdown_prompt",
    "format_gsm8k_prompt",
    "format_math_prompt",
    "get_task",
    "load_gsm8k",
    "load_local_dataset",
    "local_reward_funcs",
    "load_task_dataset",
    "make_countdown",
    "make_synthetic_gsm8k",
    "task_reward_funcs",
    "to_trl_format",
]
