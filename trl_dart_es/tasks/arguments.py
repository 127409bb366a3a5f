"""The recipes' script arguments: TRL's `ScriptArguments` plus the task options of `load_task_dataset`."""

from __future__ import annotations

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
    eval_num_examples: int | None = field(
        default=None,
        metadata={
            "help": "Held-out prompts to generate (offline tasks only). None: the task's default (128)."
        },
    )

    def load_split(self, split: str) -> Dataset:
        """`split` of `dataset_name` in TRL's format, with the options that are set (held-out size: test only)."""
        from . import load_task_dataset

        options: dict[str, Any] = {}
        if self.prompt_style is not None:
            options["prompt_style"] = self.prompt_style
        if self.eval_num_examples and split == self.dataset_test_split:
            options["num_examples"] = self.eval_num_examples
        return load_task_dataset(self.dataset_name, split, **options)
