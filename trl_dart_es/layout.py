"""Population layouts: which of a step's B problems each of the N members scores.

* ``"shared"`` (the reference, DART-ES's own): every member scores all B problems, N x B rollouts per step, and
  fitness is normalised over the whole population.
* ``"grouped"`` (as in EGGROLL, arXiv:2511.16652): members form G = N / M groups of M consecutive members, the B
  problems split into G equal blocks of b = B / G, and group g scores block g only: N x b = M x B rollouts per
  step. Each member still has its own perturbation (antithetic pairs are consecutive, so with M even a pair never
  straddles two groups). Fitness is centred within each group and divided by the population's std of the centred
  values, so a member is compared only with members that saw the same problems. With b = 1 every group is "one
  prompt, M members", EGGROLL's layout.

Pure numpy: no model code, so the arithmetic is tested in milliseconds (tests/test_layout.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["POPULATION_LAYOUTS", "PopulationLayout", "centre_fitness", "matched_learning_rate"]

POPULATION_LAYOUTS = ("shared", "grouped")


@dataclass(frozen=True)
class PopulationLayout:
    """How N members share B problems (see the module docstring).

    Args:
        kind: "shared" or "grouped".
        members_per_group: M, the members that score each block of problems (grouped only).
    """

    kind: str = "shared"
    members_per_group: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in POPULATION_LAYOUTS:
            raise ValueError(f"population_layout must be one of {POPULATION_LAYOUTS}, got {self.kind!r}")
        m = self.members_per_group
        if self.kind == "grouped":
            if m is None or int(m) != m or m < 2:
                raise ValueError(f"a grouped layout needs members_per_group >= 2 (an integer), got {m!r}")
        elif m is not None:
            raise ValueError(
                f"members_per_group={m!r} is set but population_layout is 'shared', where every member scores "
                "every problem; set population_layout='grouped' to use it"
            )

    @property
    def grouped(self) -> bool:
        return self.kind == "grouped"

    def check(self, population_size: int, batch_size: int, antithetic: bool = False) -> None:
        """Raise a ValueError naming the value that does not fit N = `population_size`, B = `batch_size`."""
        if not self.grouped:
            return
        m = int(self.members_per_group)
        if population_size % m:
            raise ValueError(
                f"population_size={population_size} is not a multiple of members_per_group={m}: the members "
                "form groups of members_per_group"
            )
        groups = population_size // m
        if batch_size % groups:
            raise ValueError(
                f"per-step problems (batch size {batch_size}) do not split into {groups} equal blocks, one per "
                f"group (population_size {population_size} / members_per_group {m}): use a multiple of {groups}"
            )
        if antithetic and m % 2:
            raise ValueError(
                f"antithetic pairs must not straddle two groups: members_per_group must be even, got {m}"
            )

    def num_groups(self, population_size: int) -> int:
        return population_size // int(self.members_per_group) if self.grouped else 1

    def groups(self, population_size: int) -> np.ndarray:
        """The group of each member (length N): all zeros for "shared"."""
        if not self.grouped:
            return np.zeros(population_size, dtype=np.int64)
        return np.arange(population_size) // int(self.members_per_group)

    def columns(self, population_size: int, batch_size: int) -> list[list[int]]:
        """For each member, the batch columns (problem indices, ascending) it scores."""
        self.check(population_size, batch_size)
        if not self.grouped:
            return [list(range(batch_size)) for _ in range(population_size)]
        block = batch_size // self.num_groups(population_size)
        return [list(range(g * block, (g + 1) * block)) for g in self.groups(population_size).tolist()]

    def mask(self, population_size: int, batch_size: int) -> np.ndarray:
        """N x B bool: member n scores problem j."""
        mask = np.zeros((population_size, batch_size), dtype=bool)
        for n, cols in enumerate(self.columns(population_size, batch_size)):
            mask[n, cols] = True
        return mask

    def rollouts(self, population_size: int, batch_size: int) -> int:
        """Completions generated per step: N x B, or M x B in the grouped layout (each problem by M members)."""
        self.check(population_size, batch_size)
        return (int(self.members_per_group) if self.grouped else population_size) * batch_size


def centre_fitness(fitness, groups: np.ndarray | None = None) -> np.ndarray:
    """Fitness minus its group's mean (one group when `groups` is None); a group whose values are all equal
    is exactly zero (a float mean of equal values need not equal them)."""
    f = np.asarray(fitness, dtype=np.float64)
    g = np.zeros(f.size, dtype=np.int64) if groups is None else np.asarray(groups)
    if g.shape != f.shape:
        raise ValueError(f"groups must have one entry per member ({f.size}), got shape {g.shape}")
    out = np.zeros_like(f)
    for group in np.unique(g):
        idx = g == group
        values = f[idx]
        if not np.all(values == values[0]):
            out[idx] = values - values.mean()
    return out


def matched_learning_rate(
    learning_rate: float, population_size: int, reference_population_size: int
) -> float:
    """The learning rate at `population_size` whose update has the RMS of `learning_rate`'s at
    `reference_population_size`.

    The update ``(alpha / N) * sum_n z_n eps_n`` with z-scored fitness (sum z^2 = N) and independent directions
    has an RMS of about ``alpha / sqrt(N)`` per coordinate, so matching it scales alpha by
    ``sqrt(N / N_ref)``. Antithetic pairs change the constant, not the rate (tests/test_layout.py measures it).
    """
    for name, value in (
        ("population_size", population_size),
        ("reference_population_size", reference_population_size),
    ):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return float(learning_rate) * math.sqrt(population_size / reference_population_size)
