"""A study-only reward: partial credit for a final answer numerically close to the reference.

`python benchmarks/study.py --variants demo-close` names it by import path (`benchmarks.closeness_reward.
gsm8k_closeness_reward`), as a TRL user names a reward of their own. Not in `trl_dart_es.rewards`: the study
found it does not help (docs/benchmarks.md), and a reward that pays wrong answers invites reward hacking.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from trl_dart_es.rewards.gsm8k import completion_text, extract_final_number, normalize_number


def gsm8k_closeness_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float | None]:
    """1 / (1 + |final - answer| / max(1, |answer|)): 1.0 when right, 0.5 at a relative error of 1; 0.0 without
    a number; None when the reference is not a number. Same final-number rule as `gsm8k_accuracy_reward`."""
    scores: list[float | None] = []
    for completion, ref in zip(completions, answer, strict=True):
        gold = normalize_number(ref)
        if gold is None:
            scores.append(None)
            continue
        pred = extract_final_number(completion_text(completion))
        if pred is None:
            scores.append(0.0)
            continue
        g, p = Decimal(gold), Decimal(pred)
        scores.append(float(1 / (1 + abs(p - g) / max(Decimal(1), abs(g)))))
    return scores
