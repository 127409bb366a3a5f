"""Low-rank population rollouts: the whole population in one batched `transformers` `generate` call.

With low-rank perturbations (EGGROLL) the members share the base weights, so N members x B prompts are N*B
rows of ONE `generate` call: row i belongs to member i // B, and forward hooks (see
`LowRankParameters.batched`) add each member's rank-r term to the shared layer outputs. The weights are never
written during generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig

from ..lowrank import LowRankParameters
from ..noise import Member, tensor_seed
from .base import Generation, member_columns
from .prompts import render_prompts
from .transformers import TransformersRollout


class LowRankRollout(TransformersRollout):
    """Generates with the trainer's own model; a population runs as one batched `generate` over N*B rows.

    Args:
        model: the causal LM.
        tokenizer: its tokenizer (left padding is used).
        generation_config: GRPO-style settings from `build_generation_config`.
        params: the model's `LowRankParameters`.
        batch_size: at most this many rows per `generate` call (default: all N*B rows at once). Calls hold
            whole members (``batch_size // B`` of them) when ``batch_size >= B``, else slices of one member's
            prompts, so that every call is a member-major block.
        chat_template_kwargs: extra arguments for the chat template.
        sampling_seed: seed of `generate(prompts)` when sampling.
        generation_dtype: generate with a copy of the model in this dtype (the hooks go on the copy).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        generation_config: GenerationConfig,
        params: LowRankParameters,
        *,
        batch_size: int | None = None,
        chat_template_kwargs: dict | None = None,
        sampling_seed: int = 0,
        generation_dtype: torch.dtype | None = None,
    ):
        if not isinstance(params, LowRankParameters):
            raise TypeError(f"LowRankRollout needs LowRankParameters, got {type(params).__name__}")
        params.check_batchable()  # fail at set-up, not in the middle of the first step
        super().__init__(
            model,
            tokenizer,
            generation_config,
            params,
            batch_size=batch_size,
            chat_template_kwargs=chat_template_kwargs,
            sampling_seed=sampling_seed,
            generation_dtype=generation_dtype,
        )

    def plan(self, num_prompts: int, num_members: int) -> list[tuple[slice, slice]]:
        """``(members, prompts)`` slices of each `generate` call, in order."""
        size = self.batch_size
        if size is None or size >= num_prompts:
            per_call = num_members if size is None else max(1, size // num_prompts)
            return [
                (slice(m, min(m + per_call, num_members)), slice(0, num_prompts))
                for m in range(0, num_members, per_call)
            ]
        return [
            (slice(m, m + 1), slice(p, min(p + size, num_prompts)))
            for m in range(num_members)
            for p in range(0, num_prompts, size)
        ]

    @torch.no_grad()
    def generate_population(
        self,
        prompts: Sequence[Any],
        members: Sequence[Member],
        columns: Sequence[Sequence[int]] | None = None,
    ) -> list[Generation]:
        """One `Generation` per member for its prompts (all, or `columns[n]`: equally many per member), from
        batched `generate` calls over member-major rows."""
        if self.params.is_perturbed:
            raise RuntimeError("generate_population() needs the base weights; a member is still applied")
        members = list(members)
        if not members:
            return []
        cols = member_columns(len(prompts), len(members), columns)
        if len({len(mine) for mine in cols}) > 1:
            raise ValueError("the batched low-rank rollout needs equally many prompts per member")
        texts = render_prompts(prompts, self.tokenizer, self.chat_template_kwargs)
        device = next(self.model.parameters()).device
        shared = columns is None
        encoded: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        out_texts: list[list[str]] = [[] for _ in members]
        out_ids: list[list[list[int]]] = [[] for _ in members]
        for call, (mslice, pslice) in enumerate(self.plan(len(cols[0]), len(members))):
            group = members[mslice]
            if shared:  # the same prompts for every member: tokenize each slice once, repeat per member
                key = (pslice.start, pslice.stop)
                if key not in encoded:
                    encoded[key] = self._tokenize(texts[pslice], device)
                enc = encoded[key]
                rows = {k: v.repeat(len(group), *([1] * (v.dim() - 1))) for k, v in enc.items()}
            else:  # each member its own prompts, member-major
                rows = self._tokenize([texts[i] for mine in cols[mslice] for i in mine[pslice]], device)
            if self.generation_config.do_sample:  # reproducible per (population, call)
                torch.manual_seed(tensor_seed(group[0].seed, f"lowrank-rollout/{call}"))
            model = self.generating_model()  # the model, or its generation copy (hooked by path)
            with self.params.batched(group, model=None if model is self.model else model):
                # `tokenizer`: stop strings from `generation_kwargs`, as on every other backend.
                sequences = model.generate(
                    **rows, generation_config=self.generation_config, tokenizer=self.tokenizer
                )
            gen = self._decode(sequences, rows["input_ids"].shape[1])
            per_member = len(gen.texts) // len(group)  # num_return_sequences/beams keep member blocks whole
            for g in range(len(group)):
                block = slice(g * per_member, (g + 1) * per_member)
                out_texts[mslice.start + g] += gen.texts[block]
                out_ids[mslice.start + g] += gen.token_ids[block]
        return [Generation(texts=t, token_ids=i) for t, i in zip(out_texts, out_ids, strict=True)]

    def _tokenize(self, texts: list[str], device) -> dict[str, torch.Tensor]:
        enc = self.tokenizer(
            texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
        )
        return {k: v.to(device) for k, v in enc.items()}
