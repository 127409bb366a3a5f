"""Held-out metrics of the untrained model, cached where they cannot change.

Greedy evaluation of an embedded model (fixed weights shipped in a package) is deterministic, so the demo's
"before" column need not cost a full evaluation every run. The cache key holds everything that changes the
result: the model, its dtype, the evaluation rows, the generation settings, the reward functions and weights,
the batch size (padding) and the library versions. Anything else (hub models, several processes) is
evaluated as usual. One cache for every caller: the recipe's before/after table and the study key it by the
trainer's own evaluation (`baseline_cache_parts`), the benchmark harness by its greedy evaluation
(`trl_dart_es.benchmark.curves`), both through `untrained_cache_file`, `read_cached` and `write_cached`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..digest import json_digest
from ..embedded import embedded_cache_dir, is_embedded
from ..precision import cpu_bf16_flags

if TYPE_CHECKING:
    from datasets import Dataset

    from .dart_es_trainer import DartESTrainer


def baseline_cache_parts(trainer: DartESTrainer, dataset: Dataset, model_name: str) -> dict[str, Any]:
    """Everything besides the library versions that changes the untrained model's greedy held-out metrics."""
    args = trainer.args
    return {
        "model": model_name,
        "dtype": str(next(trainer.model.parameters()).dtype),
        "rows": json_digest(dataset.to_dict()),
        "max_completion_length": args.max_completion_length,
        "generation_kwargs": args.generation_kwargs,
        "chat_template_kwargs": args.chat_template_kwargs,
        "eval_batch_size": args.per_device_eval_batch_size,
        "use_vllm": args.use_vllm,
        "rewards": trainer.reward_func_names,
        "reward_weights": [float(w) for w in trainer.reward_weights],
        "solved_threshold": args.solved_threshold,
        "primary_reward_index": args.primary_reward_index,
        **generation_precision(trainer),
    }


def generation_precision(trainer: DartESTrainer) -> dict[str, str]:
    """The engine's precision when `generation_dtype` sets one ({} otherwise, so that keys made before the
    option existed still match): bf16 generation scores differently from fp32."""
    rollout = getattr(trainer, "rollout", None)
    # the vLLM engine's dtype, or the transformers rollouts' (their generation copy's)
    dtype = getattr(getattr(rollout, "engine", None), "dtype", None) or getattr(rollout, "dtype", None)
    if getattr(trainer.args, "generation_dtype", None) is None or dtype is None:
        return {}
    parts = {"generation_dtype": str(dtype)}
    device = getattr(getattr(trainer, "accelerator", None), "device", None)
    if "bfloat16" in str(dtype) and getattr(device, "type", "cpu") == "cpu":
        # CPU bf16 kernels round differently with AMX than with AVX512-BF16 alone (untrained, 21.7% against 20.5%
        # on 512 prompts): a cache shared by hosts of both kinds must not hand one's score to the other.
        parts["cpu_bf16"] = "+".join(cpu_bf16_flags()) or "emulated"
    return parts


def baseline_cache_key(trainer: DartESTrainer, dataset: Dataset, model_name: str) -> str:
    """A hash of everything that changes the untrained model's greedy held-out metrics."""
    return cache_key(baseline_cache_parts(trainer, dataset, model_name))


def cache_key(parts: Mapping[str, Any]) -> str:
    """A hash of `parts` and of the library versions (which every key needs: they change generation)."""
    import torch
    import transformers

    return json_digest({**parts, "versions": [torch.__version__, transformers.__version__]}, 24)


def untrained_cache_file(
    model_name: Any, parts: Mapping[str, Any], *, prefix: str = "", cache_dir: str | Path | None = None
) -> Path | None:
    """The file that holds the untrained model's metrics under the key `parts` (which must name everything that
    changes them besides the model's weights and the library versions), or None where they may change: a model
    that is not embedded (hub weights can be updated), or several processes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not isinstance(model_name, str) or not is_embedded(model_name) or world > 1:
        return None
    folder = Path(cache_dir) if cache_dir is not None else embedded_cache_dir() / "baselines"
    return folder / f"{prefix}{cache_key(parts)}.json"


def read_cached(path: Path | None) -> dict[str, float] | None:
    """The metrics stored at `path`, or None (no cache, or nothing stored yet)."""
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def write_cached(path: Path | None, metrics: Mapping[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dict(metrics), indent=1) + "\n")
    tmp.replace(path)  # atomic: a reader sees a whole file or none


# The rows' solved flags ride in the cached metrics file under this key (see `evaluate_untrained`).
_SOLVED_KEY = "solved_rows"


def evaluate_untrained(
    trainer: DartESTrainer,
    dataset: Dataset,
    model_name: str,
    *,
    cache_dir: str | Path | None = None,
    return_solved: bool = False,
) -> tuple[dict[str, float], bool] | tuple[dict[str, float], np.ndarray, bool]:
    """`trainer.evaluate_dataset(dataset)` before training, read from the cache when it is safe to.

    Returns the metrics and whether they came from the cache; with `return_solved`, the metrics, the rows'
    solved flags (`evaluate_dataset(..., return_solved=True)`) and whether they came from the cache. Call it
    before `train()`: the key describes the untrained model only.
    """
    path = None
    if trainer.accelerator.num_processes == 1:
        path = untrained_cache_file(
            model_name, baseline_cache_parts(trainer, dataset, model_name), cache_dir=cache_dir
        )
    cached = read_cached(path)
    # The rows' flags ride in the same file, as one '0'/'1' string; a file written before they were stored is
    # a miss only for a caller that needs them.
    flags = cached.pop(_SOLVED_KEY, None) if cached is not None else None
    if cached is not None and (flags is not None or not return_solved):
        solved = np.array([c == "1" for c in flags or ""], dtype=bool)
        return (cached, solved, True) if return_solved else (cached, True)
    metrics, solved = trainer.evaluate_dataset(dataset, return_solved=True)
    write_cached(path, {**metrics, _SOLVED_KEY: "".join("1" if x else "0" for x in solved)})
    return (metrics, solved, False) if return_solved else (metrics, False)
