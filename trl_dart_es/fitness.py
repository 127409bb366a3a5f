"""Fitness of ES population members from their rewards (spec steps 4, 8 and 9)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .layout import centre_fitness

__all__ = ["FITNESS_SHAPING", "dart_fitness", "shape_fitness", "solved_matrix"]

FITNESS_SHAPING = ("zscore", "rank", "running-zscore")


def dart_fitness(rewards, weights, reward_weights: Sequence[float], *, primary_index: int = 0) -> np.ndarray:
    """DART-ES fitness of every member.

    ``F_n = beta_p * (1/B') * sum_j w_j r_p[n, j]  +  sum_{k != p} beta_k * (1/B') * sum_j r_k[n, j]``

    where ``p = primary_index``, ``beta = reward_weights`` and the difficulty weights ``w`` multiply the
    primary reward only. It is a plain mean over problems, *not* divided by ``sum(w)``.

    Missing rewards: a NaN ``r_k[n, j]`` is left out of member ``n``'s mean for function ``k`` (``B'`` is
    the number of non-NaN values of that member and function, so ``B' = B`` without NaNs). A member with
    no value at all for a function gets 0 from that function.

    Args:
        rewards: K x N x B array (reward function x member x problem).
        weights: B problem weights (all ones for plain ES).
        reward_weights: K weights beta.
        primary_index: which reward function is the primary (correctness) one.

    Returns:
        N fitness values (float64).
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 3:
        raise ValueError(
            f"rewards must be K x N x B (reward function x member x problem), got shape {r.shape}"
        )
    k, _, b = r.shape
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (b,):
        raise ValueError(f"weights must have shape ({b},) to match rewards {r.shape}, got {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("weights must be finite")
    beta = np.asarray(reward_weights, dtype=np.float64)
    if beta.shape != (k,):
        raise ValueError(
            f"reward_weights must have {k} values (one per reward function), got shape {beta.shape}"
        )
    if not -k <= primary_index < k:
        raise ValueError(f"primary_index={primary_index} is out of range for {k} reward functions")
    if np.isinf(r).any():
        raise ValueError("rewards must be finite or NaN (missing), found inf")
    scale = np.ones((k, 1, b))
    scale[primary_index, 0] = w
    present = ~np.isnan(r)
    total = np.where(present, r * scale, 0.0).sum(axis=2)  # K x N
    count = present.sum(axis=2)
    mean = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
    return beta @ mean


def shape_fitness(
    fitness, method: str = "zscore", *, scale: float | None = None, groups=None
) -> np.ndarray | None:
    """Normalise fitness into the coefficients ``z`` of the ES update.

    * ``"zscore"`` (reference): ``(F - mean F) / (std F + 1e-8)`` with the population std (ddof 0).
    * ``"rank"``: centred ranks in [-0.5, 0.5], ties get their average rank.
    * ``"running-zscore"``: ``(F - mean F) / (scale + 1e-8)``, with ``scale`` given by the caller (the
      strategy passes the mean fitness std over the run's steps so far). Unlike a per-step z-score, a step
      whose members differ by one problem moves the weights less than one where they differ by ten.

    With ``groups`` (one group id per member, a grouped population layout) fitness is centred within each
    group instead of over the population, and divided by the std of the centred values (``"zscore"``) or by
    ``scale`` (``"running-zscore"``); ranks are not defined across groups.

    Returns None when every fitness value is equal (with ``groups``: equal within every group): there is no
    signal and the update should be skipped.
    """
    if method not in FITNESS_SHAPING:
        raise ValueError(f"fitness shaping must be one of {FITNESS_SHAPING}, got {method!r}")
    f = np.asarray(fitness, dtype=np.float64)
    if f.ndim != 1 or f.size == 0:
        raise ValueError(f"fitness must be a non-empty 1-D array, got shape {f.shape}")
    if not np.isfinite(f).all():
        raise ValueError(f"fitness must be finite, got {f.tolist()}")
    if groups is not None:
        if method == "rank":
            raise ValueError(
                "rank shaping is not defined for a grouped layout: use 'zscore' or 'running-zscore'"
            )
        centred = centre_fitness(f, groups)
        if not centred.any():
            return None
        if method == "running-zscore":
            _check_scale(scale)
            return centred / (scale + 1e-8)
        return centred / (centred.std() + 1e-8)
    if np.all(f == f[0]):
        return None
    if method == "running-zscore":
        _check_scale(scale)
        return (f - f.mean()) / (scale + 1e-8)
    if method == "zscore":
        return (f - f.mean()) / (f.std() + 1e-8)
    return _average_ranks(f) / (f.size - 1) - 0.5


def _check_scale(scale: float | None) -> None:
    if scale is None or not math.isfinite(scale) or scale < 0:
        raise ValueError(f"running-zscore needs a finite scale >= 0, got {scale!r}")


def _average_ranks(f: np.ndarray) -> np.ndarray:
    """0-based ranks; tied values share the mean of the ranks they span."""
    order = np.argsort(f, kind="stable")
    sorted_f = f[order]
    ranks = np.empty(f.size, dtype=np.float64)
    start = 0
    for end in range(1, f.size + 1):
        if end == f.size or sorted_f[end] != sorted_f[start]:
            ranks[order[start:end]] = (start + end - 1) / 2.0
            start = end
    return ranks


def solved_matrix(primary_rewards, threshold: float = 1.0) -> np.ndarray:
    """N x B 0/1 matrix: member n solved problem j when its primary reward is >= threshold (NaN: not)."""
    r = np.asarray(primary_rewards, dtype=np.float64)
    if r.ndim != 2:
        raise ValueError(f"primary rewards must be N x B (member x problem), got shape {r.shape}")
    with np.errstate(invalid="ignore"):
        return ((r >= threshold) & ~np.isnan(r)).astype(np.int64)
