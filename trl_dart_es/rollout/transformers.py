"""Population rollouts with `transformers` `generate`: perturb the model in place, one batched call per member."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.utils import logging

from ..noise import Member
from ..perturb import EvolvedParameters
from ..precision import resolve_generation_dtype
from .base import Generation, member_columns
from .generation_copy import GenerationCopy
from .prompts import render_prompts

logger = logging.get_logger(__name__)


def build_generation_config(args, tokenizer, eos_token_ids: list[int]) -> GenerationConfig:
    """GRPO-style generation settings; temperature 0 means greedy decoding."""
    sample = args.temperature > 0
    kwargs: dict[str, Any] = dict(
        max_new_tokens=args.max_completion_length,
        do_sample=sample,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos_token_ids,
        repetition_penalty=args.repetition_penalty,
    )
    if sample:
        kwargs.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    else:
        kwargs.update(_GREEDY)
    kwargs.update(args.generation_kwargs or {})
    return GenerationConfig(**kwargs)


# Unset sampling knobs: a checkpoint's generation_config.json may carry them, and transformers warns
# when they sit beside do_sample=False.
_GREEDY: dict[str, Any] = dict(do_sample=False, temperature=None, top_p=None, top_k=None)


def greedy_generation_config(tokenizer, max_new_tokens: int, **overrides: Any) -> GenerationConfig:
    """Greedy decoding that stops at the tokenizer's EOS: the settings the benchmarks and parity tests share."""
    kwargs: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens,
        eos_token_id=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        **_GREEDY,
    )
    kwargs.update(overrides)
    return GenerationConfig(**kwargs)


def use_attention_that_soft_caps(model: torch.nn.Module) -> bool:
    """Switch a model whose attention soft-caps its logits (Gemma 2) from SDPA to eager attention; whether it did.

    transformers' SDPA attention ignores ``attn_logit_softcapping``: a Gemma 2 loaded with the default ``sdpa``
    computes attention without the cap its config (and vLLM, and the model's training) applies. The backends
    then evaluate different models: for a sigma = 0.5 member of a tiny Gemma 2, prompt log-probabilities differed
    by 6e-3 from vLLM's (4e-6 with eager) and the backends' completions differed (tests/test_architectures.py).
    Eager attention applies the cap, as transformers recommends for Gemma 2.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if getattr(config, "attn_logit_softcapping", None) is None:
        return False
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    logger.warning(
        "%s soft-caps its attention logits, which transformers' SDPA attention ignores: switching it to eager "
        "attention, so that every backend computes the model its config describes",
        type(base).__name__,
    )
    base.set_attn_implementation("eager")
    return True


class TransformersRollout:
    """Generates with the trainer's own model; members are applied by perturbing its parameters in place."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        generation_config: GenerationConfig,
        params: EvolvedParameters,
        *,
        batch_size: int | None = None,
        chat_template_kwargs: dict | None = None,
        sampling_seed: int = 0,
        generation_dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.params = params
        self.batch_size = batch_size
        self.chat_template_kwargs = chat_template_kwargs
        self.sampling_seed = sampling_seed
        self.eos_token_ids = set(generation_config.eos_token_id or [])
        self.last_perturb_time = 0.0
        # generation_dtype other than the model's: generate with a copy in that dtype (the model stays the master)
        model_dtype = next(model.parameters()).dtype
        self.copy = (
            GenerationCopy(model, generation_dtype)
            if generation_dtype is not None and generation_dtype != model_dtype
            else None
        )

    @property
    def dtype(self) -> torch.dtype:
        """The dtype generation runs in."""
        return self.copy.dtype if self.copy is not None else next(self.model.parameters()).dtype

    def generating_model(self) -> torch.nn.Module:
        """The module that generates: the model, or its generation copy refreshed from the model's weights."""
        if self.copy is None:
            return self.model
        self.copy.sync()
        return self.copy.model

    @classmethod
    def from_trainer(cls, trainer, generation_config: GenerationConfig):
        """The rollout of a `DartESTrainer` that generates with its own model (also `LowRankRollout`'s)."""
        args = trainer.args
        return cls(
            trainer.model,
            trainer.processing_class,
            generation_config,
            trainer.es_params,
            batch_size=args.generation_batch_size,
            chat_template_kwargs=args.chat_template_kwargs,
            sampling_seed=args.seed,
            generation_dtype=resolve_generation_dtype(
                args.generation_dtype,
                next(trainer.model.parameters()).dtype,
                on_cuda=next(trainer.model.parameters()).device.type == "cuda",
            ),
        )

    def _encode(self, prompts: Sequence[Any]) -> list[dict[str, torch.Tensor]]:
        texts = render_prompts(prompts, self.tokenizer, self.chat_template_kwargs)
        size = self.batch_size or len(texts)
        device = next(self.model.parameters()).device
        chunks = []
        for start in range(0, len(texts), size):
            enc = self.tokenizer(
                texts[start : start + size],
                return_tensors="pt",
                padding=True,
                padding_side="left",
                add_special_tokens=False,
            )
            chunks.append({k: v.to(device) for k, v in enc.items()})
        return chunks

    def _decode(self, sequences: torch.Tensor, prompt_len: int) -> Generation:
        texts, ids = [], []
        stops = self.generation_config.stop_strings
        stops = [stops] if isinstance(stops, str) else list(stops or [])
        for row in sequences[:, prompt_len:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in self.eos_token_ids), len(row))
            # A row that a stop string ended is padded (pad = EOS here) while the batch goes on: that EOS was never
            # generated. Generation stops at a stop string's first occurrence, so one before the EOS means padding.
            if stops and cut and row[cut - 1] in self.eos_token_ids:
                before = self.tokenizer.decode(row[: cut - 1], skip_special_tokens=True)
                cut -= any(stop in before for stop in stops)
            ids.append(row[:cut])
            texts.append(self.tokenizer.decode(row[:cut], skip_special_tokens=True))
        return Generation(texts=texts, token_ids=ids)

    @torch.no_grad()
    def _generate_encoded(self, chunks: list[dict[str, torch.Tensor]], seed: int | None) -> Generation:
        if seed is not None and self.generation_config.do_sample:
            torch.manual_seed(seed)  # sampling is reproducible per (step, member)
        texts, ids = [], []
        model = self.generating_model()
        for enc in chunks:
            # `tokenizer` lets users pass `stop_strings` through `generation_kwargs`.
            out = model.generate(**enc, generation_config=self.generation_config, tokenizer=self.tokenizer)
            gen = self._decode(out, enc["input_ids"].shape[1])
            texts += gen.texts
            ids += gen.token_ids
        return Generation(texts=texts, token_ids=ids)

    def generate(self, prompts: Sequence[Any]) -> Generation:
        if self.params.is_perturbed:
            raise RuntimeError("generate() must see unperturbed weights; a member is still applied")
        return self._generate_encoded(self._encode(prompts), seed=self.sampling_seed)

    def generate_population(
        self,
        prompts: Sequence[Any],
        members: Sequence[Member],
        columns: Sequence[Sequence[int]] | None = None,
    ) -> list[Generation]:
        cols = member_columns(len(prompts), len(members), columns)
        chunks: dict[tuple[int, ...], list] = {}  # tokenize each member's prompt set once
        out = []
        self.last_perturb_time = 0.0  # ES bookkeeping inside the population loop, logged as time/perturb
        try:
            for member, mine in zip(members, cols, strict=True):
                if mine not in chunks:
                    chunks[mine] = self._encode([prompts[i] for i in mine])
                t0 = time.perf_counter()
                self.params.perturb(member)  # straight from member n to n+1: no restore in between
                self.last_perturb_time += time.perf_counter() - t0
                out.append(self._generate_encoded(chunks[mine], seed=member.seed))
        finally:
            t0 = time.perf_counter()
            self.params.restore()
            self.last_perturb_time += time.perf_counter() - t0
        return out
