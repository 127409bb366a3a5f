"""Per-problem difficulty state of DART-ES: pass-rate EMA, zero-pass streaks, the replay buffer, weights.

Spec steps 4-7 (docs/method.md): after every ES step, for each problem ``j`` in the batch

* ``p_j`` = fraction of the population that solved it, ``c_j`` = number of members that solved it;
* ``pbar_j <- p_j`` on the first visit, else ``ema_decay * pbar_j + (1 - ema_decay) * p_j``;
* ``zero_streak_j <- zero_streak_j + 1`` if ``c_j == 0`` else ``0``;
* replay buffer, first matching rule: ``pbar_j >= tau`` -> remove (mastered); ``c_j == 0`` and
  ``zero_streak_j >= patience`` -> remove (currently unsolvable); ``c_j > 0`` -> add (rare solvable);
  otherwise leave as is;
* weight ``w_j = weight_floor + exp(-weight_exponent * pbar_j)`` from the updated EMA.

Problems outside the batch are untouched. The state is keyed by the problems' string ids.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["DifficultyState", "difficulty_weight"]


def difficulty_weight(pass_rate, weight_floor: float = 0.8, weight_exponent: float = 3.0):
    """``weight_floor + exp(-weight_exponent * pass_rate)``: 1 + floor at pass rate 0, decreasing in it."""
    return weight_floor + np.exp(-weight_exponent * np.asarray(pass_rate, dtype=np.float64))


def _check_ids(ids: Sequence[str]) -> list[str]:
    ids = list(ids)
    seen: set[str] = set()
    for i in ids:
        if not isinstance(i, str):
            raise TypeError(f"problem ids must be str, got {type(i).__name__} {i!r}")
        if i in seen:
            raise ValueError(f"duplicate problem id {i!r} in one batch")
        seen.add(i)
    return ids


class DifficultyState:
    """Pass-rate EMA, zero-pass streaks and replay buffer of every problem seen so far.

    Args:
        ema_decay: lambda in ``pbar <- lambda * pbar + (1 - lambda) * p`` (0: keep only the last visit).
        weight_floor: w_floor, the weight of a problem every member always solves (plus ``exp(-kappa)``).
        weight_exponent: kappa, how sharply weights fall with the pass rate (also used to sample replays).
        replay_pass_threshold: tau; a problem with ``pbar >= tau`` is mastered and leaves the buffer.
        zero_pass_patience: P; a problem nobody solved on ``P`` visits in a row leaves the buffer.
    """

    def __init__(
        self,
        ema_decay: float = 0.7,
        weight_floor: float = 0.8,
        weight_exponent: float = 3.0,
        replay_pass_threshold: float = 0.5,
        zero_pass_patience: int = 2,
    ) -> None:
        if not 0.0 <= ema_decay <= 1.0:
            raise ValueError(f"ema_decay must be in [0, 1], got {ema_decay}")
        if not (math.isfinite(weight_floor) and weight_floor >= 0):
            raise ValueError(f"weight_floor must be >= 0, got {weight_floor}")
        if not (math.isfinite(weight_exponent) and weight_exponent >= 0):
            raise ValueError(f"weight_exponent must be >= 0, got {weight_exponent}")
        if not 0.0 <= replay_pass_threshold <= 1.0:
            raise ValueError(f"replay_pass_threshold must be in [0, 1], got {replay_pass_threshold}")
        if int(zero_pass_patience) != zero_pass_patience or zero_pass_patience < 1:
            raise ValueError(f"zero_pass_patience must be an integer >= 1, got {zero_pass_patience}")
        self.ema_decay = float(ema_decay)
        self.weight_floor = float(weight_floor)
        self.weight_exponent = float(weight_exponent)
        self.replay_pass_threshold = float(replay_pass_threshold)
        self.zero_pass_patience = int(zero_pass_patience)
        self._ema: dict[str, float] = {}
        self._zero_streak: dict[str, int] = {}
        self._visits: dict[str, int] = {}
        self._buffer: set[str] = set()

    # -------------------------------------------------------------------------------------------- update
    def update(self, ids: Sequence[str], solved, evaluated=None) -> np.ndarray:
        """Record one ES step's outcomes and return the batch's weights (aligned with ``ids``).

        Args:
            ids: the batch's problem ids (unique).
            solved: N x B array of 0/1 (population x batch, columns in the order of ``ids``).
            evaluated: N x B bool, the members that scored each problem (a grouped layout); None: all of them.
                The pass rate p_j and the count c_j are over the members that scored j.
        """
        ids = _check_ids(ids)
        a = np.asarray(solved)
        if a.ndim != 2 or a.shape[1] != len(ids) or a.shape[0] < 1:
            raise ValueError(
                f"solved must have shape (population, {len(ids)}) for {len(ids)} ids, got shape {a.shape}"
            )
        if a.dtype != bool and not np.isin(a, (0, 1)).all():
            bad = a[~np.isin(a, (0, 1))].ravel()[:3].tolist()
            raise ValueError(f"solved must contain only 0 and 1, found {bad}")
        a = a.astype(np.int64)
        if evaluated is None:
            counts = a.sum(axis=0)
            rates = counts / a.shape[0]
        else:
            e = np.asarray(evaluated, dtype=bool)
            if e.shape != a.shape:
                raise ValueError(f"evaluated must have the shape of solved {a.shape}, got {e.shape}")
            scorers = e.sum(axis=0)
            if (scorers == 0).any():
                raise ValueError(
                    f"no member scored problem(s) {[ids[j] for j in np.flatnonzero(scorers == 0)][:5]}"
                )
            counts = (a * e).sum(axis=0)
            rates = counts / scorers
        lam, tau = self.ema_decay, self.replay_pass_threshold
        for pid, c, p in zip(ids, counts.tolist(), rates.tolist(), strict=True):
            # Step 5: EMA (first visit: the observed rate) and zero-pass streak.
            ema = p if pid not in self._ema else lam * self._ema[pid] + (1.0 - lam) * p
            self._ema[pid] = ema
            self._zero_streak[pid] = self._zero_streak.get(pid, 0) + 1 if c == 0 else 0
            self._visits[pid] = self._visits.get(pid, 0) + 1
            # Step 6: buffer rules, first match wins.
            if ema >= tau:
                self._buffer.discard(pid)
            elif c == 0 and self._zero_streak[pid] >= self.zero_pass_patience:
                self._buffer.discard(pid)
            elif c > 0:
                self._buffer.add(pid)
        return self.weights(ids)

    # --------------------------------------------------------------------------------------------- reads
    def weights(self, ids: Sequence[str]) -> np.ndarray:
        """``w_floor + exp(-kappa * pbar)`` for visited problems (KeyError for a problem never seen)."""
        missing = [i for i in ids if i not in self._ema]
        if missing:
            raise KeyError(f"no pass rate yet for problem(s) {missing[:5]}: they have never been in a batch")
        pbar = np.array([self._ema[i] for i in ids], dtype=np.float64)
        return difficulty_weight(pbar, self.weight_floor, self.weight_exponent)

    def pass_rate(self, pid: str) -> float | None:
        """The pass-rate EMA ``pbar`` of a problem, or None if it was never in a batch."""
        return self._ema.get(pid)

    def zero_streak(self, pid: str) -> int:
        """Consecutive visits on which no member solved the problem (0 if never visited)."""
        return self._zero_streak.get(pid, 0)

    def visits(self, pid: str) -> int:
        return self._visits.get(pid, 0)

    @property
    def replay_buffer(self) -> frozenset[str]:
        return frozenset(self._buffer)

    @property
    def num_seen(self) -> int:
        return len(self._ema)

    def __len__(self) -> int:
        return len(self._ema)

    # -------------------------------------------------------------------------------------- checkpoints
    def _config(self) -> dict[str, Any]:
        return {
            "ema_decay": self.ema_decay,
            "weight_floor": self.weight_floor,
            "weight_exponent": self.weight_exponent,
            "replay_pass_threshold": self.replay_pass_threshold,
            "zero_pass_patience": self.zero_pass_patience,
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (``json`` writes floats with ``repr``, so they round-trip exactly)."""
        return {
            "config": self._config(),
            "pass_rate_ema": dict(self._ema),
            "zero_streak": dict(self._zero_streak),
            "visits": dict(self._visits),
            "replay_buffer": sorted(self._buffer),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore per-problem state. Hyperparameters stay this object's own (a warning if they differ)."""
        if state.get("config") and state["config"] != self._config():
            warnings.warn(
                f"loading a difficulty state saved with {state['config']} into one configured with "
                f"{self._config()}; keeping the current hyperparameters",
                stacklevel=2,
            )
        ema = {str(k): float(v) for k, v in state["pass_rate_ema"].items()}
        buffer = {str(k) for k in state["replay_buffer"]}
        unknown = buffer - ema.keys()
        if unknown:
            raise ValueError(f"replay buffer holds problems without a pass rate: {sorted(unknown)[:5]}")
        self._ema = ema
        self._zero_streak = {str(k): int(v) for k, v in state["zero_streak"].items()}
        self._visits = {str(k): int(v) for k, v in state.get("visits", {}).items()}
        self._buffer = buffer

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seen={len(self._ema)}, buffer={len(self._buffer)}, {self._config()})"
