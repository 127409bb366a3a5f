"""Side-by-side benchmark: DART-ES, plain ES, GRPO and GRPO+LoRA on the same model, data and rollouts per step.

    python -m trl_dart_es.benchmark                          # short run (about 20 min on a 2-core CPU)
    python -m trl_dart_es.benchmark --full                   # more steps and evaluation prompts
    python -m trl_dart_es.benchmark --methods grpo,es --steps 4 --output-dir outputs/bench

Every method trains for `--steps` steps in its own subprocess, so that peak memory is the method's own. Each
method gets the same workload: the same model, train and held-out data, completion length, and the same number
of rollouts per step (population N x problems B for ES = num_generations x prompts for GRPO). The method's
other hyperparameters (sigma, learning rates, LoRA rank, ...) come from its recipe config in recipes/configs/.

Measured per method:
- `step_time_s_median`: median wall time of a training step after `--warmup-steps` steps (from a callback that
  timestamps the end of every optimizer step);
- `peak_mem_mb`: on CPU the peak RSS of the method's process tree (sampled by the parent, and the kernel's
  `ru_maxrss` of the child, whichever is larger); on CUDA `torch.cuda.max_memory_reserved`;
- `tokens_per_s`: completion tokens generated per second of training wall time (after warm-up);
- `acc_before` / `acc_after`: greedy held-out accuracy of the untrained and the trained model, on the same
  held-out prompts, computed by one function for every method (`evaluate_greedy`, DART-ES's own generation code).

Results go to `<output-dir>/latest.json` (one object per method), `latest.md` (a table) and `latest.png`.
A method that fails is reported with `status: "failed"` and the tail of its log; the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Only the standard library is imported at module level: the parent process stays small, and every heavy
# import happens in the child that runs a method.

__all__ = [
    "BenchMethod",
    "METHODS",
    "DEFAULT_METHODS",
    "Workload",
    "evaluate_greedy",
    "load_split",
    "parse_recipe_config",
    "task_reward_funcs",
    "run_benchmark",
    "summarize_run",
    "render_markdown",
    "plot_results",
    "main",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG_DIR = REPO_ROOT / "recipes" / "configs"
LAUNCH_CONFIG_DIR = REPO_ROOT / "recipes" / "accelerate_configs"
DEFAULT_OUTPUT_DIR = Path("docs") / "benchmarks"
ROW_KEYS = (
    "method", "status", "rollouts_per_step", "step_time_s_median", "peak_mem_mb", "tokens_per_s", "acc_before",
    "acc_after", "machine", "date", "command",
)  # fmt: skip


# ------------------------------------------------------------------------------------------------ methods
@dataclass(frozen=True)
class BenchMethod:
    """One row of the benchmark: a trainer kind, its recipe config, and the fields that make it this method.

    Args:
        name: the row's `method` key.
        kind: which runner trains it, a key of `RUNNERS` ("es": `DartESTrainer`, "grpo": TRL's `GRPOTrainer`).
        description: one line for the table.
        configs: recipe configs (file names in the config dir), the first that exists is used; none found means
            the trainer's defaults plus the workload.
        overrides: config fields set on top of the file (the workload is applied after these).
        default: part of the default `--methods` list. Optional methods (backends still in progress) are run only
            when named.
        requires: modules that must be importable, checked before a subprocess is spent on the method.
        launch: Accelerate configs (file names in recipes/accelerate_configs/) for a multi-process row, as
            (on CPU, on CUDA); the child then runs under `accelerate launch` with `processes` processes.
        processes: how many processes a `launch` row runs (the same total workload, split over them).
    """

    name: str
    kind: str
    description: str
    configs: tuple[str, ...] = ()
    overrides: dict[str, Any] = field(default_factory=dict)
    default: bool = True
    requires: tuple[str, ...] = ()
    launch: tuple[str, str] | None = None
    processes: int = 1


_ES_CONFIGS = ("quickstart.yaml", "es_quickstart.yaml")
_DART_ON = {"use_difficulty_reweighting": True, "use_targeted_replay": True}

METHODS: dict[str, BenchMethod] = {
    m.name: m
    for m in [
        BenchMethod(
            "dart-es", "es", "DART-ES, full-rank noise, transformers generate", _ES_CONFIGS, _DART_ON
        ),
        # Plain ES is DART-ES's config with the two switches off: the only difference is the method itself.
        BenchMethod(
            "es",
            "es",
            "plain ES (no reweighting, no replay)",
            _ES_CONFIGS,
            {"use_difficulty_reweighting": False, "use_targeted_replay": False},
        ),
        BenchMethod("grpo", "grpo", "TRL GRPOTrainer, full parameters", ("grpo_quickstart.yaml",)),
        BenchMethod(
            "grpo-lora", "grpo", "TRL GRPOTrainer + LoRA (r=16, all linear)", ("grpo_lora_quickstart.yaml",)
        ),
        BenchMethod(
            "dart-es-vllm",
            "es",
            "DART-ES, generation with vLLM (one weight push per member)",
            _ES_CONFIGS,
            {**_DART_ON, "use_vllm": True, "vllm_cpu_kvcache_space": 1},
            requires=("vllm",),
        ),
        # Every member a LoRA adapter of one vLLM engine: the whole population in one generate call.
        BenchMethod(
            "dart-es-vllm-lowrank",
            "es",
            "DART-ES, low-rank noise, vLLM: one LoRA adapter per member, one generate per population",
            _ES_CONFIGS,
            {**_DART_ON, "use_vllm": True, "perturbation": "lowrank", "vllm_cpu_kvcache_space": 1},
            requires=("vllm",),
        ),
        # vLLM's ceiling: the same N x B rows generated by the unperturbed model in one engine call.
        BenchMethod(
            "inference-vllm",
            "inference",
            "no training: the step's rollouts, unperturbed model, one vLLM generate",
            _ES_CONFIGS,
            {**_DART_ON, "use_vllm": True, "vllm_cpu_kvcache_space": 1},
            requires=("vllm",),
        ),
        BenchMethod(
            "dart-es-lowrank",
            "es",
            "DART-ES, low-rank noise, one batched generation per population",
            _ES_CONFIGS,
            {**_DART_ON, "perturbation": "lowrank"},
        ),
        # The ceiling for rollout throughput: the same N x B rows generated by the unperturbed model in one batch.
        BenchMethod(
            "inference",
            "inference",
            "no training: the step's rollouts, unperturbed model, one batched generate",
            _ES_CONFIGS,
            {**_DART_ON, "perturbation": "lowrank"},
        ),
        # The noise cache (N x parameters x 4 bytes) trades memory for not drawing the noise twice per step.
        BenchMethod(
            "dart-es-noise-cache",
            "es",
            "DART-ES with the noise cache on (more memory, no second noise draw)",
            _ES_CONFIGS,
            {**_DART_ON, "noise_cache": "on"},
            default=False,
        ),
        # Two processes, the same total workload: DART-ES splits the population (a full replica per process),
        # GRPO runs as it usually runs sharded, under DeepSpeed ZeRO-2 / ZeRO-3 (docs/scaling.md).
        BenchMethod(
            "dart-es-2proc",
            "es",
            "DART-ES, 2 processes (population split, full replica each)",
            _ES_CONFIGS,
            _DART_ON,
            default=False,
            launch=("cpu_2proc.yaml", "multi_gpu.yaml"),
            processes=2,
        ),
        BenchMethod(
            "grpo-zero2",
            "grpo",
            "TRL GRPOTrainer, 2 processes, DeepSpeed ZeRO-2",
            ("grpo_quickstart.yaml",),
            default=False,
            requires=("deepspeed",),
            launch=("deepspeed_zero2_cpu.yaml", "deepspeed_zero2.yaml"),
            processes=2,
        ),
        BenchMethod(
            "grpo-zero3",
            "grpo",
            "TRL GRPOTrainer, 2 processes, DeepSpeed ZeRO-3",
            ("grpo_quickstart.yaml",),
            default=False,
            requires=("deepspeed",),
            launch=("deepspeed_zero3_cpu.yaml", "deepspeed_zero3.yaml"),
            processes=2,
        ),
    ]
}


def _installed(modules: Sequence[str]) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in modules)


# Rows that need an optional package (vLLM) are default only where it is installed.
DEFAULT_METHODS: tuple[str, ...] = tuple(
    name for name, m in METHODS.items() if m.default and _installed(m.requires)
)


# ----------------------------------------------------------------------------------------------- workload
@dataclass
class Workload:
    """What every method is given: same model, data, rollouts per step, completion length and evaluation."""

    model: str = "embedded:smollm2-135m"
    dataset: str = "embedded:gsm8k"
    train_split: str = "train"
    test_split: str = "test"
    population: int = 8  # N for ES = num_generations for GRPO
    prompts: int = 8  # B for ES = prompts per step for GRPO
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

    @property
    def rollouts_per_step(self) -> int:
        return self.population * self.prompts

    def resolved(self) -> Workload:
        """This workload with every default that depends on the recipe configs filled in."""
        if self.max_completion_length is not None:
            return self
        length = 64
        path = _config_path(METHODS["dart-es"], self)
        if path is not None:
            import yaml

            length = (yaml.safe_load(Path(path).read_text()) or {}).get("max_completion_length", length)
        return replace(self, max_completion_length=int(length))

    def comparable(self) -> dict[str, Any]:
        """The fields two rows must share to sit in one table."""
        keys = ("model", "dataset", "population", "prompts", "max_completion_length", "steps", "warmup_steps",
                "eval_prompts", "seed", "dtype")  # fmt: skip
        return {k: getattr(self, k) for k in keys}


# Short: 8 x 8 = 64 rollouts per step, 3 steps: the four default methods finish in about 20 minutes on a
# 2-core CPU (GRPO full-parameter needs more than a minute per step there).
SHORT = Workload()
# Longer: the quickstart's 8 x 16 = 128 rollouts per step, more steps, a 4x larger held-out set.
FULL = replace(SHORT, prompts=16, steps=6, warmup_steps=1, eval_prompts=128)


# ------------------------------------------------------------------------------------- data and rewards
def load_split(name: str, split: str):
    """A split of a task (`trl_dart_es.tasks.load_task_dataset`), or of a `DatasetDict` saved to a local folder."""
    if os.path.isdir(name):
        from datasets import load_from_disk

        return load_from_disk(name)[split]
    from ..tasks import load_task_dataset

    return load_task_dataset(name, split)


def task_reward_funcs(dataset_name: str) -> list[Callable]:
    """The task's reward functions, primary (correctness) first; GSM8K's for a local dataset folder."""
    if not os.path.isdir(dataset_name):
        from ..tasks import get_task

        return list(get_task(dataset_name).reward_funcs)
    from ..rewards.gsm8k import gsm8k_accuracy_reward, gsm8k_format_reward

    return [gsm8k_accuracy_reward, gsm8k_format_reward]


# ---------------------------------------------------------------------------------------------- evaluation
class _Unperturbed:
    """Stands in for `EvolvedParameters` when generating with a model that is never perturbed."""

    is_perturbed = False


def evaluate_greedy(
    model,
    tokenizer,
    dataset,
    reward_funcs: Callable | Sequence[Callable],
    *,
    max_completion_length: int,
    batch_size: int = 32,
    reward_weights: Sequence[float] | None = None,
    primary_reward_index: int = 0,
    solved_threshold: float = 1.0,
    chat_template_kwargs: dict | None = None,
) -> dict[str, float]:
    """Greedy held-out metrics of any causal LM (plain, PEFT, ES- or GRPO-trained), with the generation and
    scoring code `DartESTrainer.evaluate` uses, so that every method is measured by the same function.

    Returns `accuracy` (fraction of rows whose primary reward reaches `solved_threshold`), `reward` (weighted
    sum of the rewards), `rewards/<name>/mean`, `completions/mean_length` and `tokens_per_s` (generation only).
    """
    import numpy as np
    import torch

    from ..rollout.prompts import as_completions
    from ..rollout.transformers import TransformersRollout, build_generation_config
    from ..scoring import RewardScorer

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tokenizer.eos_token_id not in eos:
        eos = [tokenizer.eos_token_id, *eos]
    # Greedy; the KV cache explicitly on (gradient checkpointing in a trainer may have turned it off).
    gen_args = SimpleNamespace(
        max_completion_length=max_completion_length, temperature=0.0, repetition_penalty=1.0,
        generation_kwargs={"use_cache": True},
    )  # fmt: skip
    rollout = TransformersRollout(
        model,
        tokenizer,
        build_generation_config(gen_args, tokenizer, eos),
        _Unperturbed(),
        batch_size=batch_size,
        chat_template_kwargs=chat_template_kwargs,
    )
    scorer = RewardScorer(reward_funcs, chat_template_kwargs=chat_template_kwargs)
    weights = np.asarray(reward_weights or [1.0] * len(scorer), dtype=np.float64)

    was_training = model.training
    model.eval()
    rewards, tokens, gen_time = [], 0, 0.0
    try:
        for start in range(0, len(dataset), batch_size):
            columns = dataset.select(range(start, min(start + batch_size, len(dataset)))).to_dict()
            t0 = time.perf_counter()
            with torch.no_grad():
                gen = rollout.generate(columns["prompt"])
            gen_time += time.perf_counter() - t0
            tokens += gen.num_tokens
            completions = as_completions(columns["prompt"], gen.texts)
            rewards.append(scorer(columns["prompt"], completions, gen.token_ids, columns))
    finally:
        model.train(was_training)
    r = np.concatenate(rewards, axis=1) if rewards else np.zeros((len(scorer), 0))
    solved = np.nan_to_num(r[primary_reward_index], nan=-np.inf) >= solved_threshold
    metrics = {
        "accuracy": float(solved.mean()) if solved.size else float("nan"),
        "reward": float(np.nansum(r * weights[:, None], axis=0).mean()) if r.size else float("nan"),
    }
    for k, name in enumerate(scorer.names):
        metrics[f"rewards/{name}/mean"] = float(np.nanmean(r[k])) if r.size else float("nan")
    metrics["completions/mean_length"] = tokens / max(1, r.shape[1])
    metrics["tokens_per_s"] = tokens / gen_time if gen_time > 0 else float("nan")
    return metrics


# --------------------------------------------------------------------------------- child: one method run
def _config_path(method: BenchMethod, workload: Workload) -> str | None:
    for name in method.configs:
        path = Path(workload.config_dir) / name
        if path.is_file():
            return str(path)
    return None


def _cli(values: dict[str, Any]) -> list[str]:
    out = []
    for key, value in values.items():
        if value is None:
            continue
        out += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def parse_recipe_config(config_cls: type, config: str | Path | None, values: dict[str, Any]) -> tuple:
    """(ScriptArguments, config, ModelConfig) exactly as a recipe's TrlParser builds them from `config` (a YAML
    file, or None for the defaults), with `values` applied on top as command-line overrides."""
    from trl import ModelConfig, ScriptArguments, TrlParser

    args = (["--config", str(config)] if config else []) + _cli(values)
    return TrlParser((ScriptArguments, config_cls, ModelConfig)).parse_args_and_config(args)


def _use_cuda(workload: Workload) -> bool:
    import torch

    if workload.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but CUDA is not available")
    return workload.device == "cuda" or (workload.device == "auto" and torch.cuda.is_available())


def _common_values(workload: Workload, output_dir: str) -> dict[str, Any]:
    return {
        "model_name_or_path": workload.model,
        "dtype": workload.dtype,
        "dataset_name": workload.dataset,
        "dataset_train_split": workload.train_split,
        "dataset_test_split": workload.test_split,
        "output_dir": output_dir,
        "max_completion_length": workload.max_completion_length,
        "max_steps": workload.steps,
        "seed": workload.seed,
        "use_cpu": not _use_cuda(workload),
        "logging_steps": 1,
        "save_strategy": "no",
        "eval_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }


def _micro_batch(total: int, preferred: int) -> int:
    """The largest divisor of `total` that is at most `preferred`: GRPO's per-device batch (in completions)."""
    return max(d for d in range(1, min(total, max(1, preferred)) + 1) if total % d == 0)


class _StepTimer:
    """Timestamps the end of every optimizer step, and tells the parent how far training is."""

    def __init__(self, progress: Callable[[str], None]):
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                timer.ends = [time.perf_counter()]
                progress(f"train 0/{state.max_steps}")

            def on_step_end(self, args, state, control, **kwargs):
                timer.ends.append(time.perf_counter())
                progress(f"train {state.global_step}/{state.max_steps}")

        self.ends: list[float] = []
        self.callback = Callback()

    @property
    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]


def _per_step(log_history: list[dict], key: str) -> list[float]:
    return [float(e[key]) for e in log_history if key in e and "step" in e and not math.isnan(float(e[key]))]


def _es_trainer(method: BenchMethod, workload: Workload, out: str, callbacks: list):
    from trl import get_peft_config

    from ..trainer import DartESConfig, DartESTrainer

    config = _config_path(method, workload)
    values = {
        **method.overrides,
        **_common_values(workload, out),
        "population_size": workload.population,
        "per_device_train_batch_size": workload.prompts,
        "per_device_eval_batch_size": workload.eval_batch_size,
    }
    script_args, args, model_args = parse_recipe_config(DartESConfig, config, values)
    args.model_init_kwargs = {"dtype": model_args.dtype or "float32", **(args.model_init_kwargs or {})}
    train = load_split(script_args.dataset_name, script_args.dataset_train_split)
    trainer = DartESTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=task_reward_funcs(script_args.dataset_name),
        args=args,
        train_dataset=train,
        peft_config=get_peft_config(model_args),
        callbacks=callbacks,
    )
    return trainer, config


def _run_es(method: BenchMethod, workload: Workload, progress: Callable[[str], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"bench-{method.name}-") as out:
        progress("loading")
        timer = _StepTimer(progress)
        trainer, config = _es_trainer(method, workload, out, [timer.callback])
        trainer.train()
        history = trainer.state.log_history
        return {
            "config": config,
            "trainer": trainer,
            "reward_weights": trainer.args.reward_weights,
            "step_times_s": timer.step_times,
            "completion_tokens": [
                m * workload.rollouts_per_step for m in _per_step(history, "completions/mean_length")
            ],
            "generation_tokens_per_s": _median_or_nan(
                _per_step(history, "tokens_per_s")[workload.warmup_steps :]
            ),
            "train_reward": _per_step(history, "reward"),
        }


def _run_inference(
    method: BenchMethod, workload: Workload, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Generate each step's N x B rollouts with the unperturbed model, as one batch (the trainer's own rollout)."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{method.name}-") as out:
        progress("loading")
        trainer, config = _es_trainer(method, workload, out, [])
        data = trainer.train_dataset
        times, tokens = [], []
        for step in range(workload.steps):
            progress(f"step {step + 1}/{workload.steps}")
            rows = range(step * workload.prompts, (step + 1) * workload.prompts)
            prompts = [data[i % len(data)]["prompt"] for i in rows] * workload.population
            started = time.perf_counter()
            gen = trainer.rollout.generate(prompts)
            times.append(time.perf_counter() - started)
            tokens.append(gen.num_tokens)
        return {"config": config, "trainer": None, "step_times_s": times, "completion_tokens": tokens}


def _run_grpo(method: BenchMethod, workload: Workload, progress: Callable[[str], None]) -> dict[str, Any]:
    from trl import GRPOConfig, GRPOTrainer, get_peft_config

    from ..embedded import resolve_model_path

    config = _config_path(method, workload)
    with tempfile.TemporaryDirectory(prefix=f"bench-{method.name}-") as out:
        # Peek at the config's micro-batch, then size gradient accumulation so that one optimizer step consumes
        # exactly one generation of prompts x num_generations completions.
        _, peek, _ = parse_recipe_config(GRPOConfig, config, {"output_dir": out, "bf16": False})
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
        script_args, args, model_args = parse_recipe_config(GRPOConfig, config, values)
        args.model_init_kwargs = {"dtype": model_args.dtype or "float32", **(args.model_init_kwargs or {})}
        rewards = task_reward_funcs(script_args.dataset_name)
        progress("loading")
        train = load_split(script_args.dataset_name, script_args.dataset_train_split)
        timer = _StepTimer(progress)
        trainer = GRPOTrainer(
            model=resolve_model_path(model_args.model_name_or_path),
            reward_funcs=rewards,
            args=args,
            train_dataset=train,
            peft_config=get_peft_config(model_args),
            callbacks=[timer.callback],
        )
        trainer.train()
        history = trainer.state.log_history
        return {
            "config": config,
            "trainer": trainer,
            "reward_weights": args.reward_weights,
            "micro_batch": micro,
            "gradient_accumulation_steps": total // (micro * processes),
            "step_times_s": timer.step_times,
            "completion_tokens": [
                m * workload.rollouts_per_step for m in _per_step(history, "completions/mean_length")
            ],
            "train_reward": _per_step(history, "reward"),
        }


# Runners train one method in the child process and return at least `step_times_s`, `completion_tokens` (per
# step) and the `trainer` (its model is evaluated afterwards; None: nothing was trained, no accuracy).
RUNNERS: dict[str, Callable[[BenchMethod, Workload, Callable[[str], None]], dict[str, Any]]] = {
    "es": _run_es,
    "grpo": _run_grpo,
    "inference": _run_inference,
}


def _eval_set(workload: Workload):
    data = load_split(workload.dataset, workload.test_split)
    return data.select(range(min(workload.eval_prompts, len(data))))


def _evaluate_model(model, tokenizer, workload: Workload, reward_weights=None) -> dict[str, float]:
    return evaluate_greedy(
        model,
        tokenizer,
        _eval_set(workload),
        task_reward_funcs(workload.dataset),
        max_completion_length=workload.max_completion_length,
        batch_size=workload.eval_batch_size,
        reward_weights=reward_weights,
    )


def _baseline(workload: Workload, progress: Callable[[str], None]) -> dict[str, Any]:
    """Held-out metrics of the untrained model: every row's `acc_before` (greedy, so one run serves all)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..embedded import resolve_model_path

    progress("loading")
    path = resolve_model_path(workload.model)
    device = "cuda" if _use_cuda(workload) else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, workload.dtype)).to(device)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    progress("evaluating")
    return {"eval": _evaluate_model(model, tokenizer, workload)}


def _peak_memory_mb() -> dict[str, float]:
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 / 2**20 if sys.platform == "darwin" else 1 / 1024
    out = {
        "peak_rss_self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale,
        "peak_rss_children_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale,
    }
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["peak_cuda_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
            out["peak_cuda_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    return out


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _gather_ranks(value: dict) -> list[dict]:
    """`value` from every process of a launched child (a list of one when the child runs alone)."""
    if _world_size() == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _child_main(spec_path: str) -> int:
    """Entry point of the subprocess that runs one method (or the baseline evaluation) and writes its result.

    Under `accelerate launch` (a `launch` row) every process runs this; only rank 0 reports progress and writes
    the result, which carries every process's peak memory (`ranks`).
    """
    spec = json.loads(Path(spec_path).read_text())
    workload = Workload(**spec["workload"])
    progress_path = Path(spec["progress_path"])
    rank = int(os.environ.get("RANK", "0"))

    def progress(text: str) -> None:
        if rank != 0:
            return
        with contextlib.suppress(OSError):
            progress_path.write_text(text)

    started = time.perf_counter()
    if spec["method"] == "_baseline":
        result = _baseline(workload, progress)
    else:
        method = METHODS[spec["method"]]
        result = RUNNERS[method.kind](method, workload, progress)
        trainer = result.pop("trainer")
        if trainer is not None:
            progress("evaluating")
            # Every process evaluates the same prompts (greedy, so the same number of forward passes): under
            # ZeRO-3 TRL's context gathers the partitioned parameters on all of them.
            from trl.models.utils import unwrap_model_for_generation

            with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
                result["eval"] = _evaluate_model(
                    model, trainer.processing_class, workload, result.pop("reward_weights")
                )
    result.pop("reward_weights", None)
    result.update(_peak_memory_mb())
    if _world_size() > 1:
        result["ranks"] = _gather_ranks(_peak_memory_mb())
        result["processes"] = len(result["ranks"])
        if rank != 0:
            return 0
    with contextlib.suppress(Exception):
        import torch

        result["device"] = (
            f"cuda ({torch.cuda.get_device_name(0)})"
            if _use_cuda(workload)
            else f"cpu ({torch.get_num_threads()} threads)"
        )
    result["wall_s"] = time.perf_counter() - started
    Path(spec["result_path"]).write_text(json.dumps(result, default=str))
    return 0


# ---------------------------------------------------------------------------------------------- summaries
def _median_or_nan(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def summarize_run(step_times: Sequence[float], completion_tokens: Sequence[float], warmup_steps: int) -> dict:
    """Median step time and rollout throughput over the steps after warm-up.

    With no step left after warm-up, every step counts (and `timed_steps` says how many did).
    """
    times = list(step_times)
    timed = times[warmup_steps:] if len(times) > warmup_steps else times
    first = len(times) - len(timed)
    tokens = list(completion_tokens)[first : first + len(timed)]
    rate = (
        sum(tokens) / sum(timed[: len(tokens)]) if tokens and sum(timed[: len(tokens)]) > 0 else float("nan")
    )
    return {"step_time_s_median": _median_or_nan(timed), "tokens_per_s": rate, "timed_steps": len(timed)}


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else what `platform` knows)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_description() -> str:
    """CPU model, cores, memory and OS (and the GPU when there is one): the `machine` of every row."""
    parts = [f"{cpu_model()}, {os.cpu_count()} cores"]
    with contextlib.suppress(Exception):
        import psutil

        parts.append(f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM")
    gpu = _gpu_name()
    if gpu:
        parts.append(gpu)
    parts.append(f"{platform.system()} {platform.release()}")
    return ", ".join(parts)


def _gpu_name() -> str | None:
    with contextlib.suppress(Exception):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        names = [n.strip() for n in out.stdout.splitlines() if n.strip()]
        if out.returncode == 0 and names:
            return f"{len(names)}x {names[0]}"
    return None


def _tree_rss(pid: int) -> tuple[int, int]:
    """RSS in bytes of a process and all its descendants, and of the largest single one of them ((0, 0) if
    it is gone)."""
    try:
        import psutil
    except ImportError:  # the child's own ru_maxrss still gives a peak
        return 0, 0
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    sizes = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            sizes.append(p.memory_info().rss)
    return sum(sizes), max(sizes, default=0)


def _tail(path: Path, lines: int = 25) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


# ------------------------------------------------------------------------------------------ parent: runs
def _spawn(name: str, workload: Workload, work_dir: Path, bar=None) -> tuple[dict | None, dict]:
    """Run one child to completion; return its result (None on failure) and what the parent observed."""
    work_dir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = work_dir / f"{name}.spec.json", work_dir / f"{name}.result.json"
    progress_path, log_path = work_dir / f"{name}.progress", work_dir / f"{name}.log"
    for path in (result_path, progress_path):
        path.unlink(missing_ok=True)
    spec = {"method": name, "workload": asdict(workload), "result_path": str(result_path),
            "progress_path": str(progress_path)}  # fmt: skip
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "trl_dart_es.benchmark", "--child", str(spec_path)]
    method = METHODS.get(name)
    if method is not None and method.launch is not None:
        cmd, launch_env = _launch_command(method, workload, cmd[1:])
        env.update(launch_env)
    started = time.monotonic()
    peak, peak_one, timed_out, shown = 0, 0, False, ""
    with open(log_path, "w") as log:
        # Its own session, so that a timeout can stop the child and its workers (and nothing else).
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while proc.poll() is None:
                total, largest = _tree_rss(proc.pid)
                peak, peak_one = max(peak, total), max(peak_one, largest)
                if bar is not None:
                    with contextlib.suppress(OSError):
                        text = progress_path.read_text().strip()
                        if text != shown:  # redraw only on change: logs of the bar stay short
                            bar.set_postfix_str(text, refresh=True)
                            shown = text
                if time.monotonic() - started > workload.timeout_s:
                    timed_out = True
                    _stop(proc)
                    break
                time.sleep(0.5)
        except BaseException:
            _stop(proc)
            raise
    observed = {"rc": proc.returncode, "wall_s": time.monotonic() - started, "peak_tree_rss_mb": peak / 2**20,
                "peak_process_rss_mb": peak_one / 2**20, "log": str(log_path), "timed_out": timed_out}  # fmt: skip
    if proc.returncode == 0 and result_path.is_file():
        return json.loads(result_path.read_text()), observed
    return None, observed


def _launch_command(method: BenchMethod, workload: Workload, child: list[str]) -> tuple[list[str], dict]:
    """`accelerate launch` of the child module with the method's Accelerate config (its CPU or its CUDA one)
    on `method.processes` processes, and the environment it needs (threads split over the processes, a
    persistent cache for DeepSpeed's compiled CPU op)."""
    import socket

    cpu_config, cuda_config = method.launch
    on_cuda = workload.device == "cuda" or (workload.device == "auto" and _gpu_name() is not None)
    with socket.socket() as s:  # a free port: other jobs on the machine may launch at the same time
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(LAUNCH_CONFIG_DIR / (cuda_config if on_cuda else cpu_config)),
        "--num_processes", str(method.processes), "--main_process_port", str(port), *child,
    ]  # fmt: skip
    env = {
        "TORCH_EXTENSIONS_DIR": os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".cache" / "torch_extensions")
        )
    }
    if not on_cuda:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // method.processes))
    return cmd, env


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)  # the group the child leads (start_new_session): only what we started
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)


def _missing_requirements(method: BenchMethod) -> list[str]:
    import importlib.util

    return [m for m in method.requires if importlib.util.find_spec(m) is None]


def _row(method: BenchMethod, workload: Workload, result: dict | None, observed: dict, context: dict) -> dict:
    row: dict[str, Any] = {
        "method": method.name,
        "description": method.description,
        "status": "ok",
        "rollouts_per_step": workload.rollouts_per_step,
        "step_time_s_median": None,
        "peak_mem_mb": None,
        "peak_mem_mb_max_process": None,
        "tokens_per_s": None,
        "acc_before": context["acc_before"],
        "acc_after": None,
        **{k: context[k] for k in ("machine", "date", "command")},
        "workload": workload.comparable(),
    }
    if result is None:
        row["status"] = "timeout" if observed.get("timed_out") else "failed"
        row["error"] = observed.get("error") or (_tail(Path(observed["log"])) if observed.get("log") else "")
        row["wall_s"] = observed.get("wall_s")
        return row
    summary = summarize_run(result["step_times_s"], result["completion_tokens"], workload.warmup_steps)
    cuda = result.get("peak_cuda_reserved_mb")
    cpu_peak = max(observed.get("peak_tree_rss_mb", 0.0), result.get("peak_rss_self_mb", 0.0),
                   result.get("peak_rss_children_mb", 0.0))  # fmt: skip
    # The largest single process (what one device must hold): the kernel's peak of each training process, or
    # the parent's samples of the largest process in the tree, whichever is larger.
    ranks = result.get("ranks") or [result]
    one_peak = max(
        [observed.get("peak_process_rss_mb", 0.0)] + [r.get("peak_rss_self_mb", 0.0) for r in ranks]
    )
    if cuda is not None:
        cuda_ranks = [r.get("peak_cuda_reserved_mb") or 0.0 for r in ranks]
        cuda, one_peak = sum(cuda_ranks), max(cuda_ranks)
    row.update(
        step_time_s_median=summary["step_time_s_median"],
        peak_mem_mb=cuda if cuda is not None else cpu_peak,
        peak_mem_mb_max_process=one_peak,
        processes=result.get("processes", 1),
        mem_kind="cuda_max_memory_reserved" if cuda is not None else "cpu_peak_rss",
        tokens_per_s=summary["tokens_per_s"],
        acc_after=result["eval"]["accuracy"] if "eval" in result else None,
        timed_steps=summary["timed_steps"],
        step_times_s=result["step_times_s"],
        peak_rss_mb=cpu_peak,
        eval=result.get("eval"),
        config=result.get("config"),
        device=result.get("device"),
        wall_s=observed["wall_s"],
    )
    for key in ("peak_cuda_allocated_mb", "generation_tokens_per_s", "micro_batch", "gradient_accumulation_steps",
                "train_reward"):  # fmt: skip
        if key in result:
            row[key] = result[key]
    return row


def _add_relative(rows: list[dict], reference: str = "grpo") -> None:
    """`step_time_vs_grpo` and `peak_mem_vs_grpo`: fractional change against GRPO (-0.3 = 30% less)."""
    ref = next((r for r in rows if r["method"] == reference and r["status"] == "ok"), None)
    for row in rows:
        for key, out in (("step_time_s_median", "step_time_vs_grpo"), ("peak_mem_mb", "peak_mem_vs_grpo")):
            ok = ref is not None and row.get(key) is not None and ref.get(key)
            row[out] = (row[key] / ref[key] - 1.0) if ok else None


def run_benchmark(
    methods: Sequence[str],
    workload: Workload,
    *,
    work_dir: str | Path,
    command: str = "",
    show_progress: bool = True,
) -> list[dict]:
    """Run the baseline evaluation and then each method in its own subprocess; return one row per method."""
    from tqdm.auto import tqdm

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; known: {sorted(METHODS)}")
    work_dir = Path(work_dir)
    workload = workload.resolved()
    context = {
        "machine": machine_description(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "acc_before": None,
    }
    rows = []
    with tqdm(total=len(methods) + 1, desc="baseline eval", unit="run", disable=not show_progress) as bar:
        result, observed = _spawn("_baseline", workload, work_dir, bar)
        if result is not None:
            context["acc_before"] = result["eval"]["accuracy"]
            context["baseline_eval"] = result["eval"]
        else:
            tqdm.write(f"baseline evaluation failed (rc {observed['rc']}); see {observed['log']}")
        bar.update()
        for name in methods:
            method = METHODS[name]
            bar.set_description(f"{name}")
            missing = _missing_requirements(method)
            if missing:
                result, observed = None, {"error": f"missing modules: {', '.join(missing)}", "wall_s": 0.0}
            else:
                result, observed = _spawn(name, workload, work_dir, bar)
            row = _row(method, workload, result, observed, context)
            rows.append(row)
            tqdm.write(_one_line(row))
            bar.update()
    _add_relative(rows)
    return rows


def _one_line(row: dict) -> str:
    if row["status"] != "ok":
        tail = (row.get("error") or "").strip().splitlines()
        return f"{row['method']:<16} {row['status'].upper()}: {tail[-1] if tail else ''}"
    return (
        f"{row['method']:<16} {row['step_time_s_median']:8.1f} s/step  {row['peak_mem_mb'] / 1024:6.2f} GB  "
        f"{row['tokens_per_s']:7.1f} tok/s  acc {_fmt_acc(row['acc_before'])} -> {_fmt_acc(row['acc_after'])}"
    )


# ------------------------------------------------------------------------------------------------ reports
def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _fmt_acc(value: float | None) -> str:
    return _fmt(None if value is None else 100 * value, ".1f") + ("%" if value is not None else "")


def _fmt_rel(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:+.0f}%"


def render_markdown(rows: Sequence[dict], workload: Workload | None = None) -> str:
    """The benchmark table (plus the workload, machine, date and command) as Markdown."""
    lines = ["# Benchmark: DART-ES vs ES vs GRPO", ""]
    if rows:
        lines += [f"- Machine: {rows[0]['machine']}", f"- Date: {rows[0]['date']}",
                  f"- Command: `{rows[0]['command']}`"]  # fmt: skip
    if workload is not None:
        lines.append(
            f"- Workload: `{workload.model}` ({workload.dtype}) on `{workload.dataset}`; "
            f"{workload.rollouts_per_step} rollouts per step ({workload.population} per problem x "
            f"{workload.prompts} problems), up to {workload.max_completion_length} completion tokens; "
            f"{workload.steps} steps, the first {workload.warmup_steps} not timed; greedy held-out accuracy on "
            f"{workload.eval_prompts} `{workload.test_split}` prompts."
        )
    lines += [
        "",
        "| method | status | rollouts/step | time/step (s) | vs GRPO | peak memory (GB) | vs GRPO | tokens/s "
        "| acc. before | acc. after |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        mem = None if r.get("peak_mem_mb") is None else r["peak_mem_mb"] / 1024
        lines.append(
            f"| {r['method']} | {r['status']} | {r['rollouts_per_step']} | {_fmt(r.get('step_time_s_median'), '.1f')} "
            f"| {_fmt_rel(r.get('step_time_vs_grpo'))} | {_fmt(mem, '.2f')} | {_fmt_rel(r.get('peak_mem_vs_grpo'))} "
            f"| {_fmt(r.get('tokens_per_s'), '.1f')} | {_fmt_acc(r.get('acc_before'))} | {_fmt_acc(r.get('acc_after'))} |"
        )
    kinds = {r.get("mem_kind") for r in rows if r.get("mem_kind")}
    lines += [
        "",
        "time/step: median wall time of one training step after warm-up. peak memory: "
        + (
            "peak RSS of the method's process tree (CPU)"
            if kinds <= {"cpu_peak_rss"}
            else "torch.cuda.max_memory_reserved (CUDA) / peak RSS (CPU)"
        )  # fmt: skip
        + ". tokens/s: completion tokens generated per second of training (`inference`: of generation). Accuracy: greedy, same prompts and "
        "evaluation code for every method. vs GRPO: change relative to the `grpo` row (negative = less).",
    ]
    lines += _throughput_lines(rows)
    lines += _memory_per_process_lines(rows)
    failed = [r for r in rows if r["status"] != "ok"]
    for r in failed:
        error = (r.get("error") or "").strip().splitlines()
        lines += ["", f"`{r['method']}` {r['status']}: `{error[-1] if error else 'no output'}`"]
    return "\n".join(lines) + "\n"


def _memory_per_process_lines(rows: Sequence[dict]) -> list[str]:
    """Peak memory of the whole process tree against the largest single process: memory per device."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("peak_mem_mb_max_process") is not None]
    if not ok:
        return []
    lines = [
        "",
        "Peak memory per process (the largest single process: what one device holds) against the whole tree:",
        "",
        "| method | processes | whole tree (GB) | largest process (GB) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in ok:
        lines.append(
            f"| {r['method']} | {r.get('processes', 1)} | {r['peak_mem_mb'] / 1024:.2f} "
            f"| {r['peak_mem_mb_max_process'] / 1024:.2f} |"
        )
    return lines


def _throughput_lines(rows: Sequence[dict]) -> list[str]:
    """How close each ES row's rollout throughput comes to pure batched inference of the same rollouts."""
    ok = {r["method"]: r for r in rows if r["status"] == "ok" and r.get("tokens_per_s")}
    lines: list[str] = []
    # vLLM rows are compared with vLLM's own batched inference, the others with transformers'.
    for reference, is_vllm in (("inference", False), ("inference-vllm", True)):
        if reference not in ok:
            continue
        ceiling = ok[reference]["tokens_per_s"]
        lines += [
            "",
            f"Rollout throughput against pure batched inference ({ceiling:.1f} tokens/s, the `{reference}` row):",
            "",
        ]
        for name, r in ok.items():
            if name.startswith("inference") or r.get("generation_tokens_per_s") is None:
                continue
            if ("vllm" in name) != is_vllm:
                continue
            lines.append(
                f"- `{name}`: whole ES step {r['tokens_per_s'] / ceiling:.0%}, generation phase only "
                f"{r['generation_tokens_per_s'] / ceiling:.0%}."
            )
    return lines


def plot_results(rows: Sequence[dict], path: str | Path) -> None:
    """Bars of time per step and peak memory, and accuracy before/after, one group per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["method"] for r in rows]
    x = list(range(len(rows)))

    def values(key: str, scale: float = 1.0) -> list[float]:
        return [(r[key] * scale) if r.get(key) is not None and r["status"] == "ok" else 0.0 for r in rows]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    palette = {"dart-es": "#4c72b0", "es": "#55a868", "grpo": "#c44e52", "grpo-lora": "#dd8452"}
    colors = [palette.get(n, "#4c72b0" if n.startswith("dart-es") else "#8172b3") for n in names]
    for ax, key, scale, title in (
        (axes[0], "step_time_s_median", 1.0, "time per step (s, median)"),
        (axes[1], "peak_mem_mb", 1 / 1024, "peak memory (GB)"),
    ):
        heights = values(key, scale)
        ax.bar(x, heights, color=colors)
        for i, (h, r) in enumerate(zip(heights, rows, strict=True)):
            ax.text(
                i, h, f"{h:.1f}" if r["status"] == "ok" else r["status"], ha="center", va="bottom", fontsize=8
            )
        ax.set_title(title)
    width = 0.38
    before, after = values("acc_before", 100), values("acc_after", 100)
    axes[2].bar([i - width / 2 for i in x], before, width, label="before", color="#bbbbbb")
    axes[2].bar([i + width / 2 for i in x], after, width, label="after", color=colors)
    for i, (h, r) in enumerate(zip(after, rows, strict=True)):
        label = f"{h:.0f}" if r.get("acc_after") is not None else "–"
        axes[2].text(i + width / 2, h, label, ha="center", va="bottom", fontsize=8)
    axes[2].set_ylim(0, max(10.0, *before, *after) * 1.2)
    axes[2].set_title("held-out accuracy (%), greedy")
    axes[2].legend(loc="upper left", fontsize=8)
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=9)
    if rows:
        fig.suptitle(f"{rows[0]['rollouts_per_step']} rollouts per step; {rows[0]['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(
    rows: list[dict], output_dir: str | Path, workload: Workload | None = None
) -> dict[str, Path]:
    """Write latest.json, latest.md and latest.png into `output_dir`; return their paths."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "latest.json", "md": out / "latest.md", "png": out / "latest.png"}
    paths["json"].write_text(json.dumps(rows, indent=2, default=str) + "\n")
    paths["md"].write_text(render_markdown(rows, workload))
    plot_results(rows, paths["png"])
    return paths


def merge_rows(new: list[dict], old: list[dict], workload: Workload) -> list[dict]:
    """Rows of `old` for methods not in `new`, kept only when they were measured on the same workload."""
    ran = {r["method"] for r in new}
    kept = [r for r in old if r["method"] not in ran and r.get("workload") == workload.comparable()]
    merged = kept + new
    order = {name: i for i, name in enumerate(METHODS)}
    merged.sort(key=lambda r: order.get(r["method"], len(order)))
    _add_relative(merged)
    return merged


# ---------------------------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trl_dart_es.benchmark",
        description="DART-ES vs ES vs GRPO vs GRPO+LoRA: time per step, peak memory, tokens/s, held-out accuracy.",
    )
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, from {', '.join(METHODS)} (or 'all'); default: %(default)s")  # fmt: skip
    p.add_argument(
        "--full", action="store_true", help="the longer workload: more steps, problems and eval prompts"
    )
    p.add_argument("--steps", type=int, help="training steps per method")
    p.add_argument("--warmup-steps", type=int, help="first steps left out of the timing")
    p.add_argument("--model", help="model for every method (hub id, local folder or embedded:<name>)")
    p.add_argument(
        "--dataset", help="task name for trl_dart_es.tasks.load_task_dataset, or a saved DatasetDict folder"
    )
    p.add_argument("--population", type=int, help="N: ES population = GRPO num_generations")
    p.add_argument("--prompts", type=int, help="B: problems per step (ES) = prompts per step (GRPO)")
    p.add_argument("--max-completion-length", type=int)
    p.add_argument("--eval-prompts", type=int, help="held-out prompts for the accuracy before/after")
    p.add_argument("--eval-batch-size", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--config-dir", help="folder of the recipe configs (default: recipes/configs of this checkout)"
    )
    p.add_argument(
        "--timeout", type=float, help="seconds per method before it is stopped and reported as timeout"
    )
    p.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR), help="where latest.{json,md,png} go")
    p.add_argument(
        "--work-dir", default=None, help="logs and intermediate files (default: a temporary folder)"
    )
    p.add_argument("--merge", action="store_true",
                   help="keep rows of methods not run now from an existing latest.json measured on the same workload")  # fmt: skip
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def workload_from_args(args: argparse.Namespace) -> Workload:
    workload = FULL if args.full else SHORT
    options = {
        "steps": args.steps, "warmup_steps": args.warmup_steps, "model": args.model, "dataset": args.dataset,
        "population": args.population, "prompts": args.prompts, "max_completion_length": args.max_completion_length,
        "eval_prompts": args.eval_prompts, "eval_batch_size": args.eval_batch_size, "seed": args.seed,
        "dtype": args.dtype, "device": args.device, "config_dir": args.config_dir, "timeout_s": args.timeout,
    }  # fmt: skip
    workload = replace(workload, **{k: v for k, v in options.items() if v is not None}).resolved()
    if workload.steps < 1 or workload.warmup_steps < 0:
        raise SystemExit("--steps must be >= 1 and --warmup-steps >= 0")
    if workload.steps <= workload.warmup_steps:
        print(
            f"note: {workload.steps} steps with {workload.warmup_steps} warm-up: every step is timed",
            file=sys.stderr,
        )
    return workload


def main(argv: Sequence[str] | None = None) -> list[dict] | None:
    args = _parser().parse_args(argv)
    if args.child:
        raise SystemExit(_child_main(args.child))
    methods = (
        list(METHODS) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    )
    workload = workload_from_args(args)
    command = "python -m trl_dart_es.benchmark" + "".join(
        f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv)
    )
    with contextlib.ExitStack() as stack:
        work_dir = args.work_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="trl-dart-es-bench-")
        )
        rows = run_benchmark(
            methods, workload, work_dir=work_dir, command=command, show_progress=not args.no_progress
        )
    latest = Path(args.output_dir) / "latest.json"
    if args.merge and latest.is_file():
        rows = merge_rows(rows, json.loads(latest.read_text()), workload)
    paths = write_reports(rows, args.output_dir, workload)
    print(render_markdown(rows, workload))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return rows


if __name__ == "__main__":  # the guard lets vLLM's spawned workers import this module safely
    main()
