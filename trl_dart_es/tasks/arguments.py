"""The recipes' script arguments: TRL's `ScriptArguments` plus the task options of `load_task_dataset`."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from datasets import Dataset
from trl import ScriptArguments


@dataclass
class TaskArguments(ScriptArguments):
    """`ScriptArguments` (dataset name and splits) plus what the offline tasks let a recipe choose."""

    prompt_style: str | None = field(
        default=None,
        metadata={
            "help": "System prompt of the GSM8K tasks: a key of trl_dart_es.tasks.gsm8k.PROMPT_STYLES ('steps', "
            "'answer', ...). None: the task's default ('steps')."
        },
    )
    task_version: int | None = field(
        default=None,
        metadata={
            "help": "Version of the offline task's generator: for embedded:gsm8k 1 (the default; every number "
            "measured so far) or 2 (a wider task: many templates per operation, question forms, names, objects and "
            "distractor sentences, with whole templates held out of train; docs/tasks.md). None: the default. "
            "Ignored for a local folder."
        },
    )
    eval_num_examples: int | None = field(
        default=None,
        metadata={
            "help": "Held-out prompts to generate (offline tasks; for a local folder the first rows of the test "
            "split). None: the task's default (128; a local folder's whole split)."
        },
    )

    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions, the primary (correctness) one first, as TRL's GRPO script takes them: names "
            "from trl_dart_es.rewards (e.g. 'gsm8k_accuracy_reward', 'gsm8k_format_reward', 'gsm8k_step_reward'), "
            "TRL's own (trl.rewards: 'accuracy_reward', 'think_format_reward', 'get_soft_overlong_punishment', "
            "'get_repetition_penalty_reward', ...; the math ones need the `math` extra) or dotted import paths "
            "('my_lib.rewards.custom_reward'). None: the task's own (correctness, format); for a local folder "
            "GSM8K's, or accuracy_reward for MATH-style rows."
        },
    )

    def load_reward_funcs(
        self, column_names: Sequence[str] | None = None, max_completion_length: int | None = None
    ) -> list[Callable]:
        """`reward_funcs` resolved to functions; the task's own when unset (for a local folder, chosen by the
        dataset's `column_names`). `max_completion_length` sizes TRL's length-based reward factories."""
        from .. import rewards
        from . import task_reward_funcs

        if not self.reward_funcs:
            return task_reward_funcs(self.dataset_name, column_names)
        known = sorted(n for n in rewards.__all__ if n.endswith("_reward"))
        funcs = []
        for name in self.reward_funcs:
            if name in known:
                funcs.append(getattr(rewards, name))
            elif name in rewards.TRL_REWARD_NAMES:
                funcs.append(rewards.trl_reward_func(name, max_completion_length=max_completion_length))
            elif "." in name:
                module, attr = name.rsplit(".", 1)
                if os.getcwd() not in sys.path:  # as TRL's script: a rewards module in the working directory
                    sys.path.insert(0, os.getcwd())
                funcs.append(getattr(importlib.import_module(module), attr))
            else:
                raise ValueError(
                    f"Unknown reward function {name!r}: expected one of {known}, TRL's "
                    f"{list(rewards.TRL_REWARD_NAMES)} or a dotted import path."
                )
        return funcs

    def load_split(self, split: str) -> Dataset:
        """`split` of `dataset_name` in TRL's format, with the options that are set (held-out size: test only)."""
        from . import load_task_dataset

        options: dict[str, Any] = {}
        local = os.path.isdir(self.dataset_name)
        if self.prompt_style is not None:
            options["prompt_style"] = self.prompt_style
        if self.task_version is not None and not local:  # the generator's option: a folder's rows are fixed
            options["version"] = self.task_version
        if self.eval_num_examples and split == self.dataset_test_split:
            options["num_examples"] = self.eval_num_examples
        if self.dataset_config is not None and local:  # the folder's subfolder
            options["config"] = self.dataset_config
        return load_task_dataset(self.dataset_name, split, **options)
