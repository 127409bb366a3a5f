"""Held-out metrics of the untrained model, cached where they cannot change.

Greedy evaluation of an embedded model (fixed weights shipped in a package) is deterministic, so the demo's
"before" column need not cost a full evaluation every run. The cache key holds everything that changes the
result: the model, its dtype, the evaluation rows, the generation settings, the reward functions and weights,
the batch size (padding) and the library versions. Anything else (hub models, several processes) is
evaluated as usual.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..digest import json_digest
from ..embedded import embedded_cache_dir, is_embedded

if TYPE_CHECKING:
    from datasets import Dataset

    from .dart_es_trainer import DartESTrainer


def baseline_cache_key(trainer: DartESTrainer, dataset: Dataset, model_name: str) -> str:
    """A hash of everything that changes the untrained model's greedy held-out metrics."""
    import torch
    import transformers

    args = trainer.args
    parts = {
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
        "versions": [torch.__version__, transformers.__version__],
    }
    return json_digest(parts, 24)


def evaluate_untrained(
    trainer: DartESTrainer, dataset: Dataset, model_name: str, *, cache_dir: str | Path | None = None
) -> tuple[dict[str, float], bool]:
    """`trainer.evaluate_dataset(dataset)` before training, read from the cache when it is safe to.

    Returns the metrics and whether they came from the cache. Call it before `train()`: the key describes
    the untrained model only.
    """
    if (
        not isinstance(model_name, str)
        or not is_embedded(model_name)
        or trainer.accelerator.num_processes > 1
    ):
        return trainer.evaluate_dataset(dataset), False
    folder = Path(cache_dir) if cache_dir is not None else embedded_cache_dir() / "baselines"
    path = folder / f"{baseline_cache_key(trainer, dataset, model_name)}.json"
    if path.is_file():
        return json.loads(path.read_text()), True
    metrics = trainer.evaluate_dataset(dataset)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(metrics, indent=1) + "\n")
    tmp.replace(path)  # atomic: a reader sees a whole file or none
    return metrics, False
