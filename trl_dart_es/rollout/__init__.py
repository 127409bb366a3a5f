"""Generation backends: each turns prompts and population members into completions (`PopulationRollout`).

:func:`build` picks the backend a `DartESTrainer`'s config asks for; scripts that need a rollout outside a
training run use it too, so they measure exactly what training runs.
"""

from __future__ import annotations

from typing import Any

from transformers import GenerationConfig

from .base import Generation, PopulationRollout

__all__ = ["Generation", "PopulationRollout", "build"]


def build(trainer: Any, generation_config: GenerationConfig | None = None) -> PopulationRollout:
    """The rollout for ``trainer`` (a `DartESTrainer`): vLLM or transformers, full rank or low rank.

    ``generation_config`` defaults to the one the config describes (:func:`~.transformers.build_generation_config`).
    With vLLM it starts (or reuses) this process's engine.
    """
    from .transformers import TransformersRollout, build_generation_config, use_attention_that_soft_caps

    # Every backend must evaluate the model its config describes (Gemma 2's capped attention, not SDPA's).
    use_attention_that_soft_caps(trainer.model)
    args = trainer.args
    if generation_config is None:
        generation_config = build_generation_config(args, trainer.processing_class, trainer.eos_token_ids)
    if args.use_vllm and args.perturbation == "lowrank":
        from .vllm_lowrank import VLLMLowRankRollout

        return VLLMLowRankRollout.from_trainer(trainer, generation_config)
    if args.use_vllm:
        from .vllm import VLLMRollout

        return VLLMRollout.from_trainer(trainer, generation_config)
    if args.perturbation == "lowrank":
        from .lowrank import LowRankRollout

        return LowRankRollout.from_trainer(trainer, generation_config)
    return TransformersRollout.from_trainer(trainer, generation_config)
