"""Trainers built the way the recipes build them: a method's recipe config, parsed by TRL's parser, with the
workload (and any per-run overrides) applied on top. Every mode of the harness trains through these builders."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .methods import BenchMethod
from .workload import Workload, _config_path, load_split


def _cli(values: dict[str, Any]) -> list[str]:
    out = []
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, list | tuple):  # a list field (nargs="+"): one argument per item
            out += [f"--{key}", *map(str, value)]
        else:
            out += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def parse_recipe_config(config_cls: type, config: str | Path | None, values: dict[str, Any]) -> tuple:
    """(TaskArguments, config, ModelConfig) exactly as a recipe's TrlParser builds them from `config` (a YAML
    file, or None for the defaults), with `values` applied on top as command-line overrides. `TaskArguments` is
    the recipes' own (ScriptArguments plus `prompt_style`, `eval_num_examples`), so every recipe config parses."""
    from trl import ModelConfig, TrlParser

    from ..tasks.arguments import TaskArguments  # here, not at module level: TRL is a heavy import

    args = (["--config", str(config)] if config else []) + _cli(values)
    return TrlParser((TaskArguments, config_cls, ModelConfig)).parse_args_and_config(args)


def _use_cuda(workload: Workload) -> bool:
    import torch

    if workload.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but CUDA is not available")
    return workload.device == "cuda" or (workload.device == "auto" and torch.cuda.is_available())


def _common_values(workload: Workload, output_dir: str) -> dict[str, Any]:
    """The recipe-config fields that every method shares: the workload's model, data, length, steps, seed."""
    # The demo config logs completions; a benchmark times training alone.
    return {
        "model_name_or_path": workload.model, "dtype": workload.dtype, "dataset_name": workload.dataset,
        "dataset_train_split": workload.train_split, "dataset_test_split": workload.test_split,
        "output_dir": output_dir, "max_completion_length": workload.max_completion_length,
        "max_steps": workload.steps, "seed": workload.seed, "use_cpu": not _use_cuda(workload), "logging_steps": 1,
        "save_strategy": "no", "eval_strategy": "no", "report_to": "none", "log_completions": False,
        "disable_tqdm": True,
    }  # fmt: skip


def _micro_batch(total: int, preferred: int) -> int:
    """The largest divisor of `total` that is at most `preferred`: GRPO's per-device batch (in completions)."""
    return max(d for d in range(1, min(total, max(1, preferred)) + 1) if total % d == 0)


def _per_step(log_history: list[dict], key: str) -> list[float]:
    return [float(e[key]) for e in log_history if key in e and "step" in e and not math.isnan(float(e[key]))]


def es_trainer(
    method: BenchMethod,
    workload: Workload,
    out: str,
    callbacks: list,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[Any, str | None]:
    """A `DartESTrainer` for `method` on `workload` (and `overrides`, recipe-config fields applied last), and the
    recipe config it was built from."""
    from ..trainer import DartESConfig, DartESTrainer

    config = _config_path(method, workload)
    values = {
        **method.overrides,
        **_common_values(workload, out),
        "population_size": workload.population,
        "per_device_train_batch_size": workload.prompts,
        "per_device_eval_batch_size": workload.eval_batch_size,
        **(overrides or {}),
    }
    parsed = parse_recipe_config(DartESConfig, config, values)
    _, args, model_args = parsed
    for key, value in method.overrides.items():  # a row's None pins the field's default over the YAML's value
        if value is None and (overrides or {}).get(key) is None:
            setattr(args, key, None)
    return _trainer(DartESTrainer, model_args.model_name_or_path, parsed, workload, callbacks), config


def grpo_trainer(
    method: BenchMethod,
    workload: Workload,
    out: str,
    callbacks: list,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[Any, str | None, dict[str, Any]]:
    """TRL's `GRPOTrainer` for `method` on `workload`, with gradient accumulation sized so that one optimizer
    step consumes exactly one generation of N x B completions (the ES step's rollouts); returns the trainer, its
    recipe config and the batch sizes chosen (`micro_batch`, `gradient_accumulation_steps`)."""
    from trl import GRPOConfig, GRPOTrainer

    from ..embedded import resolve_model_path

    config = _config_path(method, workload)
    overrides = dict(overrides or {})
    # Peek at the config's micro-batch, then size gradient accumulation so that one optimizer step consumes
    # exactly one generation of prompts x num_generations completions.
    _, peek, _ = parse_recipe_config(GRPOConfig, config, {"output_dir": out, "bf16": False, **overrides})
    total = workload.rollouts_per_step
    # On P processes (a `launch` row) each process takes total / P completions per optimizer step.
    processes = _world_size()
    micro = _micro_batch(total // processes, peek.per_device_train_batch_size)
    values = {
        **method.overrides,
        **_common_values(workload, out),
        "num_generations": workload.population,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": total // (micro * processes),
    }
    if not _use_cuda(workload):
        values["bf16"] = False  # GRPOConfig turns bf16 on by default; on CPU it is ~4x slower than fp32
    overrides.pop("per_device_train_batch_size", None)  # already in `micro`
    parsed = parse_recipe_config(GRPOConfig, config, {**values, **overrides})
    _, args, model_args = parsed
    trainer = _trainer(
        GRPOTrainer, resolve_model_path(model_args.model_name_or_path), parsed, workload, callbacks
    )
    return (
        trainer,
        config,
        {"micro_batch": micro, "gradient_accumulation_steps": args.gradient_accumulation_steps},
    )


def _trainer(cls: type, model: str, parsed: tuple, workload: Workload, callbacks: list):
    """`cls` (DART-ES's or TRL's trainer) as a recipe builds it from its parsed config, on the workload's data."""
    from trl import get_peft_config

    script_args, args, model_args = parsed
    args.model_init_kwargs = {"dtype": model_args.dtype or "float32", **(args.model_init_kwargs or {})}
    train = load_split(script_args.dataset_name, script_args.dataset_train_split, **workload.data_options())
    return cls(model=model, reward_funcs=script_args.load_reward_funcs(), args=args, train_dataset=train,
               peft_config=get_peft_config(model_args), callbacks=callbacks)  # fmt: skip


def build_trainer(
    method: BenchMethod,
    workload: Workload,
    out: str,
    callbacks: list,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[Any, str | None, dict[str, Any]]:
    """The trainer of an ES or GRPO method: (trainer, its recipe config, GRPO's batch sizes or {})."""
    if method.kind == "es":
        return (*es_trainer(method, workload, out, callbacks, overrides), {})
    if method.kind == "grpo":
        return grpo_trainer(method, workload, out, callbacks, overrides)
    raise ValueError(f"{method.name} ({method.kind}) trains nothing")


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
