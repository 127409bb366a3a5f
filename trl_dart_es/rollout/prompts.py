"""Prompt rendering shared by the generation backends."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trl.data_utils import is_conversational, maybe_apply_chat_template


def render_prompts(prompts: Sequence[Any], tokenizer, chat_template_kwargs: dict | None = None) -> list[str]:
    """Text of each prompt: conversational prompts go through the tokenizer's chat template (TRL's helper)."""
    kwargs = chat_template_kwargs or {}
    return [maybe_apply_chat_template({"prompt": p}, tokenizer, **kwargs)["prompt"] for p in prompts]


def as_completions(prompts: Sequence[Any], texts: Sequence[str]) -> list[Any]:
    """Completions in the dataset's format: assistant messages for conversational prompts, else strings."""
    if len(prompts) and is_conversational({"prompt": prompts[0]}):
        return [[{"role": "assistant", "content": t}] for t in texts]
    return list(texts)
