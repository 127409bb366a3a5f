"""A study-only reward: partial credit for a final answer numerically close to the reference.

`python -m trl_dart_es.benchmark --curves --preset demo-close` (from the repository's root) names it by import
path (`benchmarks.closeness_reward.gsm8k_closeness_reward`), as a TRL user names a reward of their own. Not in `trl_dart_es.rewards`: the study
found it does not help (results/study.md, variant demo-close), and a reward that pays wrong answers invites reward hacking.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from trl_dart_es.rewards.gsm8k import score_final_numbers


def gsm8k_closeness_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float | None]:
    """1 / (1 + |final - answer| / max(1, |answer|)): 1.0 when right, 0.5 at a relative error of 1; 0.0 without
    a number; None when the reference is not a number. Same final-number rule as `gsm8k_accuracy_reward`."""

    def closeness(predicted: str, gold: str) -> float:
        p, g = Decimal(predicted), Decimal(gold)
        return float(1 / (1 + abs(p - g) / max(Decimal(1), abs(g))))

    return score_final_numbers(completions, answer, closeness)
