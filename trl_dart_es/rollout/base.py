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

    def generate_population(
        self,
        prompts: Sequence[Any],
        members: Sequence[Member],
        columns: Sequence[Sequence[int]] | None = None,
    ) -> list[Generation]:
        """One `Generation` per member, each for all `prompts` (or, with `columns`, for member n's prompts
        `columns[n]`, in that order: a grouped population layout); weights are unperturbed on return."""


def member_columns(
    num_prompts: int, num_members: int, columns: Sequence[Sequence[int]] | None
) -> list[tuple[int, ...]]:
    """Each member's prompt indices: all of them without `columns`; else `columns`, checked."""
    if columns is None:
        return [tuple(range(num_prompts))] * num_members
    out = [tuple(int(i) for i in cols) for cols in columns]
    if len(out) != num_members:
        raise ValueError(f"columns has {len(out)} entries for {num_members} members")
    bad = sorted({i for cols in out for i in cols if not 0 <= i < num_prompts})
    if bad:
        raise ValueError(f"columns {bad[:5]} are out of range for {num_prompts} prompts")
    return out


def check_population(
    generations: Sequence[Generation], num_members: int, num_prompts: int | Sequence[int]
) -> None:
    """Raise unless a rollout returned one `Generation` per member with one completion per prompt (`num_prompts`:
    one count for every member, or one per member): a short or shifted result would score a member on another
    member's (or another call's) completions."""
    if len(generations) != num_members:
        raise RuntimeError(f"the rollout returned {len(generations)} generations for {num_members} members")
    counts = [num_prompts] * num_members if isinstance(num_prompts, int) else list(num_prompts)
    for n, (gen, num_prompts) in enumerate(zip(generations, counts, strict=True)):
        if len(gen.texts) != num_prompts or len(gen.token_ids) != num_prompts:
            raise RuntimeError(
                f"the rollout returned {len(gen.texts)} texts and {len(gen.token_ids)} token rows for member "
                f"{n}, expected {num_prompts} (one per prompt)"
            )
