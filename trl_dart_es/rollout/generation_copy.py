"""The transformers rollouts' generation precision: a copy of the model in `generation_dtype` that generates,
while ES perturbs and updates the model itself (its fp32 master).

The copy is refreshed from the model whenever a parameter changed since the last refresh (:class:`WeightSignal`:
version counters, never values), rounded to the copy's dtype, so rounding never accumulates across steps. A
full-rank member is perturbed in the master and copied over; a low-rank population's hooks go on the copy
(`LowRankParameters.batched(..., model=copy)`), so the rank-r term is computed beside the rounded base weight and
bf16's resolution does not swallow sigma.
"""

from __future__ import annotations

import copy

import torch

from .weight_signal import WeightSignal, is_peft_model

__all__ = ["GenerationCopy"]


class GenerationCopy:
    """`source` in `dtype`, for generation only (no gradients, eval mode), refreshed by :meth:`sync`."""

    def __init__(self, source: torch.nn.Module, dtype: torch.dtype) -> None:
        if is_peft_model(source):
            raise NotImplementedError(
                "generation_dtype with a PEFT model on the transformers backends is not supported: use "
                "use_vllm=True (the engine gets the merged weights) or leave generation_dtype None"
            )
        self.source = source
        self.dtype = dtype
        self.model = copy.deepcopy(source).to(dtype).eval()
        self.model.requires_grad_(False)
        copied = dict(self.model.named_parameters())
        self._pairs = [(name, p, copied[name]) for name, p in source.named_parameters()]
        self._held: WeightSignal | None = WeightSignal.of(source)
        self.syncs = 0

    def sync(self, force: bool = False) -> bool:
        """Copy the parameters that changed since the last sync (all of them with `force`); whether any did."""
        signal = WeightSignal.of(
            self.source
        )  # read before copying: a write during the copy shows up next time
        changed = None if force or self._held is None else signal.changed_since(self._held)
        if changed is not None and not changed:
            return False
        with torch.no_grad():
            for name, src, dst in self._pairs:
                if changed is None or name in changed:
                    dst.copy_(src)
        self._held = signal
        self.syncs += 1
        return True
