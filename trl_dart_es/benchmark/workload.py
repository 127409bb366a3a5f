"""The workload every method is given (model, data, rollouts per step, completion length, held-out set), and
the data and rewards it names (imported on call: the harness's parent process stays small)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .methods import METHODS, BenchMethod

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG_DIR = REPO_ROOT / "recipes" / "configs"
LAUNCH_CONFIG_DIR = REPO_ROOT / "recipes" / "accelerate_configs"
DEFAULT_OUTPUT_DIR = Path("results")


@dataclass
class Workload:
    """What every method is given: same model, data, rollouts per step, completion length and evaluation."""

    model: str = "embedded:smollm2-135m"
    dataset: str = "embedded:gsm8k"
    train_split: str = "train"
    test_split: str = "test"
    population: int | None = 8  # N for ES = num_generations for GRPO; None: the DART-ES config's
    prompts: int | None = 8  # B for ES = prompts per step for GRPO; None: the DART-ES config's
    max_completion_length: int | None = None  # None: the DART-ES config's (quickstart.yaml), else 64
    steps: int = 3
    warmup_steps: int = 1
    eval_prompts: int = 32
    eval_batch_size: int = 32
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"  # "auto", "cpu" or "cuda"
    config_dir: str = str(DEFAULT_CONFIG_DIR)
    timeout_s: float = 3600.0  # per method
    # The task's prompt style (trl_dart_es.tasks.gsm8k.PROMPT_STYLES, train and held-out prompts alike) and the
    # offline task's generator version (the recipes' `task_version`); None: the DART-ES config's if it sets
    # one, else the task's default.
    prompt_style: str | None = None
    task_version: int | None = None

    @property
    def rollouts_per_step(self) -> int:
        return self.population * self.prompts

    def resolved(self) -> Workload:
        """This workload with every default that depends on the recipe configs filled in: the DART-ES config
        (quickstart.yaml, the demo) sets what is left open, so that every method sees the demo's workload."""
        config: dict[str, Any] = {}
        path = _config_path(METHODS["dart-es"], self)
        if path is not None:
            import yaml

            config = yaml.safe_load(Path(path).read_text()) or {}
        fill = {
            "max_completion_length": int(config.get("max_completion_length", 64)),
            "population": int(config.get("population_size", 8)),
            "prompts": int(config.get("per_device_train_batch_size", 8)),
            "prompt_style": config.get("prompt_style"),
            "task_version": config.get("task_version"),
        }
        return replace(self, **{k: v for k, v in fill.items() if getattr(self, k) is None})

    def comparable(self) -> dict[str, Any]:
        """The fields two rows must share to sit in one table."""
        keys = ("model", "dataset", "population", "prompts", "max_completion_length", "steps", "warmup_steps",
                "eval_prompts", "seed", "dtype")  # fmt: skip
        # prompt_style and task_version only when set: rows measured before these fields existed still merge.
        keys += tuple(k for k in ("prompt_style", "task_version") if getattr(self, k) is not None)
        return {k: getattr(self, k) for k in keys}

    def data_options(self) -> dict[str, Any]:
        """Keyword arguments of `load_split` for this workload's train and held-out prompts."""
        options = {"prompt_style": self.prompt_style, "version": self.task_version}
        return {k: v for k, v in options.items() if v is not None}


# Short: 8 x 8 = 64 rollouts per step, 3 steps: the four default methods finish in about 20 minutes on a
# 2-core CPU (GRPO full-parameter needs more than a minute per step there).
SHORT = Workload()
# Longer: the quickstart's 8 x 16 = 128 rollouts per step, more steps, a 4x larger held-out set.
FULL = replace(SHORT, prompts=16, steps=6, warmup_steps=1, eval_prompts=128)


# ------------------------------------------------------------------------------------- data and rewards
def load_split(name: str, split: str, **options: Any):
    """A split of a task (`trl_dart_es.tasks.load_task_dataset`, which gets `options`, e.g. `prompt_style` or
    `num_examples`), or of a `DatasetDict` saved to a local folder (where `options` do not apply)."""
    if os.path.isdir(name):
        from datasets import load_from_disk

        return load_from_disk(name)[split]
    from ..tasks import load_task_dataset

    return load_task_dataset(name, split, **options)


def held_out_set(workload: Workload):
    """The first `workload.eval_prompts` prompts of the test split, the same for every method and mode. An
    offline (`embedded:`) task generates exactly that many (its generator is sequential: a smaller set is a
    prefix of a larger one), so the set can be larger than the task's default split size."""
    options = workload.data_options()
    if workload.dataset.startswith("embedded:") and not os.path.isdir(workload.dataset):
        options["num_examples"] = workload.eval_prompts
    data = load_split(workload.dataset, workload.test_split, **options)
    return data.select(range(min(workload.eval_prompts, len(data))))


def task_reward_funcs(dataset_name: str) -> list[Callable]:
    """`trl_dart_es.tasks.task_reward_funcs`, imported on call: this module imports only the standard library."""
    from ..tasks import task_reward_funcs as reward_funcs

    return reward_funcs(dataset_name)


def _config_path(method: BenchMethod, workload: Workload) -> str | None:
    for name in method.configs:
        path = Path(workload.config_dir) / name
        if path.is_file():
            return str(path)
    return None
