"""What every generation backend returns, and the interface the trainer drives."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..noise import Member


@dataclass
class Generation:
    """Completions for one list of prompts: decoded text and token ids (up to and including EOS)."""

    texts: list[str]
    token_ids: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)

    def num_clipped(self, max_tokens: int, eos_token_ids: Sequence[int]) -> int:
        """Completions that hit the `max_tokens` limit before an EOS (TRL's "clipped" completions)."""
        eos = set(eos_token_ids)
        return sum(len(ids) >= max_tokens and (not ids or ids[-1] not in eos) for ids in self.token_ids)


class PopulationRollout(Protocol):
    """Generates for the unperturbed model and for each member of a population."""

    def generate(self, prompts: Sequence[Any]) -> Generation:
        """Greedy/sampled completions of the current (unperturbed) weights."""

    def generate_population(self, prompts: Sequence[Any], members: Sequence[Member]) -> list[Generation]:
        """One `Generation` per member, each for all `prompts`; weights are unperturbed on return."""
