"""Datasets from a local folder: GSM8K in the Hub's layout, MATH-style problems, or rows already in TRL's format.

A folder is read the way `datasets.load_dataset` reads a Hub repository (parquet, JSON or CSV files named by
split), so a downloaded snapshot of `openai/gsm8k` (`main/train-*.parquet`, `main/test-*.parquet`) trains as the
Hub id does. A folder written by `Dataset(Dict).save_to_disk` loads with `load_from_disk`. Rows are mapped by
their columns:

- `prompt`: already TRL's format, kept as they are;
- `problem` (+ `solution` with a `\\boxed{}` answer, as MATH stores it): a prompt asking for a boxed answer, the
  rows TRL's `accuracy_reward` scores;
- `question` + `answer` ending in `#### N` (GSM8K): `to_trl_format`, the Hub task's mapping.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from datasets import Dataset

from ..rewards import gsm8k_accuracy_reward, gsm8k_format_reward
from .gsm8k import to_trl_format

# The instruction TRL's math rewards need: `accuracy_reward` reads the answer from `\boxed{}` first.
MATH_SYSTEM_PROMPT = (
    "Solve the math problem step by step. Write the final answer inside \\boxed{}, e.g. \\boxed{42}."
)


def format_math_prompt(problem: str, *, conversational: bool = True) -> list[dict[str, str]] | str:
    """The prompt for one MATH-style problem: system + user messages, or one plain string."""
    if conversational:
        return [
            {"role": "system", "content": MATH_SYSTEM_PROMPT},
            {"role": "user", "content": problem.strip()},
        ]
    return f"{MATH_SYSTEM_PROMPT}\n\nProblem: {problem.strip()}\nSolution:"


def local_format(column_names: Sequence[str]) -> str:
    """What a local dataset's columns say it is: "trl" (a `prompt` column), "math" (`problem`) or "gsm8k"
    (`question` + `answer`); a ValueError names the columns otherwise."""
    columns = set(column_names)
    if "prompt" in columns:
        return "trl"
    if "problem" in columns:
        return "math"
    if {"question", "answer"} <= columns:
        return "gsm8k"
    raise ValueError(
        f"Cannot tell how to prompt with the columns {sorted(columns)}: expected `prompt` (TRL's format), "
        "`problem` (MATH-style, with `solution`) or `question` + `answer` (GSM8K)."
    )


def _read(path: str, split: str, config: str | None) -> Dataset:
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):  # DatasetDict.save_to_disk
        from datasets import load_from_disk

        return load_from_disk(path)[split]
    if os.path.isfile(os.path.join(path, "state.json")):  # Dataset.save_to_disk: one split
        from datasets import load_from_disk

        return load_from_disk(path)
    from datasets import load_dataset

    # The Hub's GSM8K keeps its "main" config in a folder of that name; `data_dir` finds it with or without the
    # README that declares the configs (a bare copy of the parquet files has none).
    if config is None and os.path.isdir(os.path.join(path, "main")):
        config = "main"
    return load_dataset(path, data_dir=config, split=split)


def load_local_dataset(
    path: str,
    split: str = "train",
    *,
    conversational: bool = True,
    prompt_style: str | None = None,
    num_examples: int | None = None,
    config: str | None = None,
) -> Dataset:
    """`split` of the dataset in folder `path`, in TRL's format (module docstring).

    Args:
        path: a local folder.
        split: the split's name (from the file names, e.g. `main/test-00000-of-00001.parquet` is "test").
        conversational: messages (default) or one plain-string prompt, for the rows this maps.
        prompt_style: the GSM8K system prompt (`trl_dart_es.tasks.gsm8k.PROMPT_STYLES`); GSM8K rows only.
        num_examples: keep the first rows only (the recipe's `eval_num_examples`).
        config: the subfolder to read (TRL's `dataset_config`); default "main" where the folder has one.
    """
    raw = _read(path, split, config)
    if num_examples is not None:
        raw = raw.select(range(min(num_examples, len(raw))))
    kind = local_format(raw.column_names)
    if prompt_style is not None and kind != "gsm8k":
        raise ValueError(f"prompt_style applies to GSM8K rows (`question`, `answer`), not to {path!r}.")
    if kind == "gsm8k":
        return to_trl_format(
            raw, split=split, conversational=conversational, prompt_style=prompt_style or "steps"
        )
    if kind == "math":

        def convert(row: dict[str, Any], index: int) -> dict[str, Any]:
            return {
                "prompt": format_math_prompt(row["problem"], conversational=conversational),
                "id": f"math-{split}-{index:05d}",
            }

        return raw.map(convert, with_indices=True)
    return raw


def local_reward_funcs(column_names: Sequence[str] | None = None) -> list[Callable]:
    """Default rewards of a local dataset, primary first: GSM8K's for an `answer` column (and when the columns are
    unknown), TRL's `accuracy_reward` (math-verify) for MATH-style rows (`problem`, or `solution` alone)."""
    columns = set(column_names or ())
    if column_names is None or ("answer" in columns and "problem" not in columns):
        return [gsm8k_accuracy_reward, gsm8k_format_reward]
    if "solution" in columns:
        from ..rewards.trl_rewards import trl_reward_func

        return [trl_reward_func("accuracy_reward")]
    raise ValueError(
        f"No default reward for the columns {sorted(columns)}: set `reward_funcs` (e.g. accuracy_reward with a "
        "`solution` column, gsm8k_accuracy_reward with an `answer` column)."
    )
