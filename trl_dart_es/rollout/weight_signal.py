"""What a copy of a model's weights depends on (:class:`WeightSignal`), read without touching the values: a vLLM
engine's weights and the transformers rollouts' generation copy are refreshed only when it changed."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

__all__ = ["WeightSignal", "is_peft_model"]


def is_peft_model(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _signal_entry(param: torch.Tensor) -> tuple:
    # The tensor object itself (weakly: a new model never matches an old one's address), its storage, shape,
    # dtype and autograd version counter, which every in-place write bumps (``param.data`` writes excepted).
    return (weakref.ref(param), param.data_ptr(), tuple(param.shape), param.dtype, param._version)


def _same_entry(now: tuple, held: tuple) -> bool:
    alive = now[0]()
    return alive is not None and alive is held[0]() and now[1:] == held[1:]


@dataclass(frozen=True)
class WeightSignal:
    """What the engine's copy of a model depends on, read without touching the values.

    Every in-place write to a parameter (an ES perturb, restore or update, ``load_state_dict``, an optimizer
    step, ``param.detach().add_()``) bumps its version counter; a new tensor has a new storage or identity. So
    a change cannot be missed, whatever the values are (a checksum misses changes that keep the sum: a ±1-ulp
    pair, permuted rows). One exception: writes through ``param.data`` bypass the counter (that is what
    ``.data`` is for); after such a write call ``rollout.sync_weights(force=True)``.

    LoRA `PeftModel`s are pushed merged, so any change (or a change of the active adapters) pushes everything.
    """

    entries: dict[str, tuple]
    merged: bool = False
    adapters: tuple = ()

    @classmethod
    def of(cls, model: torch.nn.Module) -> WeightSignal:
        entries = {name: _signal_entry(p) for name, p in model.named_parameters()}
        if not is_peft_model(model):
            return cls(entries)
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        state = (
            tuple(model.active_adapters),
            tuple(m.disable_adapters for m in layers),
            tuple(tuple(m.merged_adapters) for m in layers),
        )
        return cls(entries, merged=True, adapters=state)

    def changed_since(self, held: WeightSignal) -> set[str] | None:
        """Names whose tensors changed since ``held`` was read; None when everything must be pushed."""
        if (
            held.merged != self.merged
            or held.adapters != self.adapters
            or held.entries.keys() != self.entries.keys()
        ):
            return None
        changed = {n for n, e in self.entries.items() if not _same_entry(e, held.entries[n])}
        return None if changed and self.merged else changed
