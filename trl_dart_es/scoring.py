"""Calling reward functions exactly as TRL's GRPOTrainer does, and collecting an K×M reward matrix."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel
from trl.data_utils import is_conversational, maybe_apply_chat_template

from .fitness import solved_matrix


def reward_func_name(func: Any) -> str:
    if isinstance(func, nn.Module):
        return str(getattr(func.config, "_name_or_path", type(func).__name__)).rstrip("/").split("/")[-1]
    return getattr(func, "__name__", type(func).__name__)


def _is_async(func: Any) -> bool:
    # An object whose __call__ is `async def` is async too.
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


class RewardScorer:
    """Holds the reward functions (callables or sequence-classification models) and scores completions.

    Callables receive `prompts`, `completions`, `completion_ids`, every dataset column, and whatever extra
    keyword arguments the caller passes (`trainer_state`, `log_extra`, `log_metric`), as in GRPO. `None`
    rewards become NaN. Async reward functions run concurrently on a background event loop.
    """

    def __init__(
        self,
        reward_funcs: Callable | str | PreTrainedModel | Sequence[Callable | str | PreTrainedModel],
        reward_processing_classes=None,
        *,
        model_init_kwargs: dict | None = None,
        chat_template_kwargs: dict | None = None,
        device: torch.device | str = "cpu",
    ):
        if reward_funcs is None:
            raise ValueError("reward_funcs is required: ES needs at least one reward function")
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ValueError("reward_funcs is empty: ES needs at least one reward function")
        if reward_processing_classes is None:
            reward_processing_classes = [None] * len(funcs)
        elif not isinstance(reward_processing_classes, (list, tuple)):
            reward_processing_classes = [reward_processing_classes]
        if len(reward_processing_classes) != len(funcs):
            raise ValueError(
                f"got {len(reward_processing_classes)} reward_processing_classes for {len(funcs)} reward functions"
            )
        self.funcs, self.processing_classes = [], []
        for func, proc in zip(funcs, reward_processing_classes, strict=True):
            if isinstance(func, str):
                func = AutoModelForSequenceClassification.from_pretrained(
                    func, num_labels=1, **(model_init_kwargs or {})
                )
            if isinstance(func, nn.Module):
                func = func.to(device).eval()
                if proc is None:
                    proc = AutoTokenizer.from_pretrained(func.config._name_or_path)
                if proc.pad_token_id is None:
                    proc.pad_token = proc.eos_token
                func.config.pad_token_id = proc.pad_token_id
            elif not callable(func):
                raise TypeError(f"reward function {func!r} is neither callable, a model id, nor a model")
            self.funcs.append(func)
            self.processing_classes.append(proc)
        self.names = [reward_func_name(f) for f in self.funcs]
        self.chat_template_kwargs = chat_template_kwargs or {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self.funcs)

    def _async_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, daemon=True).start()
        return self._loop

    @torch.no_grad()
    def _model_scores(self, model: nn.Module, proc, prompts, completions) -> list[float]:
        if is_conversational({"prompt": prompts[0]}):
            texts = [
                maybe_apply_chat_template({"messages": p + c}, proc, **self.chat_template_kwargs)["text"]
                for p, c in zip(prompts, completions, strict=True)
            ]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        enc = proc(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        enc = {k: v.to(model.device) for k, v in enc.items()}
        return model(**enc).logits[:, 0].float().tolist()

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[list[int]],
        columns: dict[str, list[Any]],
        **extra: Any,
    ) -> np.ndarray:
        """Rewards as a float64 array of shape (num_reward_funcs, len(completions)); None → NaN."""
        m = len(completions)
        out = np.full((len(self.funcs), m), np.nan)
        kwargs = {k: v for k, v in columns.items() if k not in ("prompt", "completion", "completion_ids")}
        kwargs.update(extra)
        call = dict(prompts=list(prompts), completions=list(completions), completion_ids=list(completion_ids))
        pending = []
        for k, func in enumerate(self.funcs):
            if isinstance(func, nn.Module):
                out[k] = self._model_scores(func, self.processing_classes[k], prompts, completions)
            elif _is_async(func):
                pending.append((k, func(**call, **kwargs)))
            else:
                out[k] = self._check(k, func(**call, **kwargs), m)
        if pending:

            async def _gather():
                return await asyncio.gather(*(coro for _, coro in pending))

            results = asyncio.run_coroutine_threadsafe(_gather(), self._async_loop()).result()
            for (k, _), values in zip(pending, results, strict=True):
                out[k] = self._check(k, values, m)
        return out

    def _check(self, k: int, values: Sequence[float | None], m: int) -> list[float]:
        values = list(values)
        if len(values) != m:
            raise ValueError(
                f"The reward function '{self.names[k]}' returned {len(values)} rewards, but {m} were expected "
                "(one per completion)."
            )
        return [np.nan if v is None else float(v) for v in values]


# Dataset columns whose values split held-out accuracy (the offline tasks have them): column -> metric label,
# e.g. accuracy/level2, accuracy/wording_held_out.
ACCURACY_GROUPS: dict[str, str] = {"level": "level", "wording": "wording_", "template": "template_"}


def accuracy_by_group(solved: np.ndarray, columns: dict[str, Sequence[Any]]) -> dict[str, float]:
    """Accuracy per value of each `ACCURACY_GROUPS` column in `columns` (one value per row of `solved`):
    `{"accuracy/level1": ..., "accuracy/wording_seen": ...}`; other columns are ignored."""
    metrics = {}
    for column, label in ACCURACY_GROUPS.items():
        if column not in columns:
            continue
        values = np.asarray(columns[column])
        for value in sorted(set(values.tolist())):
            metrics[f"accuracy/{label}{value}"] = float(solved[values == value].mean())
    return metrics


def held_out_metrics(
    rewards: np.ndarray,
    names: Sequence[str],
    weights: np.ndarray,
    *,
    primary_reward_index: int,
    solved_threshold: float,
    tokens: int,
    clipped: int,
    groups: dict[str, Sequence[Any]],
) -> dict[str, float]:
    """The held-out metrics of one greedy evaluation, written once for the trainer (`evaluate_dataset`) and the
    benchmark harness (`evaluate_greedy`), so that both measure the same thing.

    `rewards` is (num_reward_funcs, rows); `tokens` and `clipped` count the rows' completion tokens and the rows
    that hit the length limit before an EOS; `groups` holds the `ACCURACY_GROUPS` columns of the rows. Returns
    `reward` (weighted sum of the rewards), `rewards/<name>/mean`, `accuracy` (rows whose primary reward reaches
    `solved_threshold`), `completions/mean_length`, `completions/clipped_ratio` and `accuracy/<group><value>`.
    """
    empty = rewards.shape[1] == 0  # no rows: NaN, not a mean-of-empty warning
    total = np.nansum(rewards * weights[:, None], axis=0)
    metrics = {"reward": float("nan") if empty else float(total.mean())}
    for k, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = float("nan") if empty else float(np.nanmean(rewards[k]))
    solved = solved_matrix(rewards[None, primary_reward_index], solved_threshold)[0].astype(bool)
    metrics["accuracy"] = float("nan") if empty else float(solved.mean())
    rows = max(1, rewards.shape[1])
    metrics["completions/mean_length"] = tokens / rows
    metrics["completions/clipped_ratio"] = clipped / rows
    # Accuracy per difficulty level and per wording (seen in training or held out), where the rows say.
    metrics.update(accuracy_by_group(solved, groups))
    return metrics
