"""One held-out evaluation for every method and mode: greedy generation with DART-ES's own rollout code, scored
by the task's rewards (`evaluate_greedy`), on the workload's held-out set."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace

from .workload import Workload, held_out_set, task_reward_funcs


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
    """Greedy held-out metrics of any causal LM (plain, PEFT, ES- or GRPO-trained) by the generation and scoring
    code of `DartESTrainer.evaluate`: `scoring.held_out_metrics`'s keys (those of `evaluate_dataset` without
    `eval_`), and `tokens_per_s` (generation only)."""
    import numpy as np
    import torch

    from ..rollout.prompts import as_completions
    from ..rollout.transformers import TransformersRollout, build_generation_config
    from ..scoring import ACCURACY_GROUPS, RewardScorer, held_out_metrics

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
    config = build_generation_config(gen_args, tokenizer, eos)
    rollout = TransformersRollout(
        model,
        tokenizer,
        config,
        _Unperturbed(),
        batch_size=batch_size,
        chat_template_kwargs=chat_template_kwargs,
    )
    scorer = RewardScorer(reward_funcs, chat_template_kwargs=chat_template_kwargs)
    weights = np.asarray(reward_weights or [1.0] * len(scorer), dtype=np.float64)

    was_training = model.training
    model.eval()
    rewards, tokens, gen_time, clipped = [], 0, 0.0, 0
    groups: dict[str, list] = {c: [] for c in ACCURACY_GROUPS if c in dataset.column_names}
    try:
        for start in range(0, len(dataset), batch_size):
            columns = dataset.select(range(start, min(start + batch_size, len(dataset)))).to_dict()
            t0 = time.perf_counter()
            with torch.no_grad():
                gen = rollout.generate(columns["prompt"])
            gen_time += time.perf_counter() - t0
            tokens += gen.num_tokens
            clipped += gen.num_clipped(max_completion_length, eos)
            for column, values in groups.items():
                values.extend(columns[column])
            completions = as_completions(columns["prompt"], gen.texts)
            rewards.append(scorer(columns["prompt"], completions, gen.token_ids, columns))
    finally:
        model.train(was_training)
    metrics = held_out_metrics(
        np.concatenate(rewards, axis=1) if rewards else np.zeros((len(scorer), 0)),
        scorer.names,
        weights,
        primary_reward_index=primary_reward_index,
        solved_threshold=solved_threshold,
        tokens=tokens,
        clipped=clipped,
        groups=groups,
    )
    metrics["tokens_per_s"] = tokens / gen_time if gen_time > 0 else float("nan")
    return metrics


def evaluate_workload(
    model, tokenizer, workload: Workload, reward_weights: Sequence[float] | None = None, dataset=None
) -> dict[str, float]:
    """`evaluate_greedy` on the workload's held-out set (or `dataset`, that set already loaded)."""
    return evaluate_greedy(
        model,
        tokenizer,
        held_out_set(workload) if dataset is None else dataset,
        task_reward_funcs(workload.dataset),
        max_completion_length=workload.max_completion_length,
        batch_size=workload.eval_batch_size,
        reward_weights=reward_weights,
    )


def evaluate_trainer(
    trainer, workload: Workload, dataset=None, *, vllm_path: bool = False
) -> dict[str, float]:
    """Held-out metrics of a trainer's current model (DART-ES's unperturbed weights, GRPO's policy, a PEFT
    model) by `evaluate_workload`, the same function for every method. With `vllm_path`, a `DartESTrainer` on
    vLLM evaluates through its engine instead (`evaluate_dataset`: the same greedy decoding and scoring, much
    faster there), keys without `eval_`."""
    from trl.models.utils import unwrap_model_for_generation

    if getattr(trainer, "es_params", None) is not None:
        if vllm_path and getattr(trainer.args, "use_vllm", False):
            data = held_out_set(workload) if dataset is None else dataset
            return {k.removeprefix("eval_"): v for k, v in trainer.evaluate_dataset(data).items()}
        if trainer.es_params.is_perturbed:  # never evaluate a population member
            trainer.es_params.restore()
    # Every process evaluates the same prompts (greedy, so the same number of forward passes): under ZeRO-3
    # TRL's context gathers the partitioned parameters on all of them.
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
        return evaluate_workload(
            model, trainer.processing_class, workload, trainer.args.reward_weights, dataset
        )
