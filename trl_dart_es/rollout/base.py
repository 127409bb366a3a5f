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
    """Generates for the unperturbed model and for each member of a population.

    ``last_perturb_time``: seconds the last `generate_population` spent applying members (perturbing and
    restoring weights, pushing them to an engine, building adapters): ES bookkeeping, logged as
    ``time/perturb`` and not counted as generation.
    """

    last_perturb_time: float

    def generate(self, prompts: Sequence[Any]) -> Generation:
        """Greedy/sampled completions of the current (unperturbed) weights."""

    def generate_population(self, prompts: Sequence[Any], members: Sequence[Member]) -> list[Generation]:
        """One `Generation` per member, each for all `prompts`; weights are unperturbed on return."""


def check_population(generations: Sequence[Generation], num_members: int, num_prompts: int) -> None:
    """Raise unless a rollout returned one `Generation` per member with one completion per prompt: a short or
    shifted result would score a member on another member's (or another call's) completions."""
    if len(generations) != num_members:
        raise RuntimeError(f"the rollout returned {len(generations)} generations for {num_members} members")
    for n, gen in enumerate(generations):
        if len(gen.texts) != num_prompts or len(gen.token_ids) != num_prompts:
            raise RuntimeError(
                f"the rollout returned {len(gen.texts)} texts and {len(gen.token_ids)} token rows for member "
                f"{n}, expected {num_prompts} (one per prompt)"
            )
