"""Countdown rewards, with TRL's reward-function calling convention (see `trl_dart_es.rewards.gsm8k`).

The answer expression is evaluated by the restricted walker in `trl_dart_es.rewards.arithmetic`, never by
eval/exec.
"""

from __future__ import annotations

import re
from typing import Any

from .arithmetic import ExpressionRejected, evaluate_arithmetic, uses_numbers_exactly_once
from .gsm8k import completion_text

_OPEN, _CLOSE = "<answer>", "</answer>"
_EXPRESSION_CHARS = re.compile(r"[\d\s+\-*/().×÷−]+")


def extract_countdown_expression(text: str) -> str | None:
    """The answer expression: the content of the last `<answer>...</answer>`, else the rest of the line after
    the last `####`; None if neither is present. A trailing `= <result>` is dropped ("(6 - 2) * 5 = 20")."""
    # str.rfind keeps this linear on hostile input; a non-greedy regex over many unclosed tags is quadratic.
    end = text.rfind(_CLOSE)
    start = text.rfind(_OPEN, 0, end) if end != -1 else -1
    if start != -1:
        expression = text[start + len(_OPEN) : end]
    else:
        marker = text.rfind("####")
        if marker == -1:
            return None
        expression = text[marker + 4 :].split("\n", 1)[0]
    expression = expression.split("=", 1)[0].strip()
    return expression or None


def countdown_accuracy_reward(
    completions: list[Any], numbers: list[list[int]], target: list[int], **kwargs: Any
) -> list[float]:
    """1.0 when the answer expression uses every given number exactly once and equals the target, else 0.0.

    Expressions outside the allowed grammar (numbers, + - * /, unary minus, parentheses) or its size limits,
    and divisions by zero, score 0.0.
    """
    rewards: list[float] = []
    for completion, nums, goal in zip(completions, numbers, target, strict=True):
        expression = extract_countdown_expression(completion_text(completion))
        if expression is None:
            rewards.append(0.0)
            continue
        try:
            evaluation = evaluate_arithmetic(expression)
        except ExpressionRejected:
            rewards.append(0.0)
            continue
        ok = evaluation.value == goal and uses_numbers_exactly_once(evaluation, nums)
        rewards.append(1.0 if ok else 0.0)
    return rewards


def countdown_format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Format credit for Countdown answers.

    - 1.0: reasoning, then `<answer> expression </answer>` at the end, with an arithmetic-only expression;
    - 0.5: an answer (tags or a `####` line) that is not in that layout or not arithmetic-only;
    - 0.0: no answer at all.
    """
    rewards: list[float] = []
    for completion in completions:
        text = completion_text(completion).strip()
        expression = extract_countdown_expression(text)
        if expression is None:
            rewards.append(0.0)
            continue
        start = text.rfind(_OPEN)
        well_placed = text.endswith(_CLOSE) and start > 0 and bool(text[:start].strip())
        arithmetic_only = len(expression) <= 200 and _EXPRESSION_CHARS.fullmatch(expression) is not None
        rewards.append(1.0 if well_placed and arithmetic_only else 0.5)
    return rewards
