"""GSM8K rewards, with TRL's reward-function calling convention.

`fn(completions, <dataset column>, **kwargs) -> list[float | None]`: `completions` are strings (standard
format) or message lists (conversational); the trainer also passes `prompts`, `completion_ids` and every
other dataset column as keyword arguments, which these functions ignore. Only completions are scored,
never prompts (the prompt's worked example contains a `####` line).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

# A number as models and GSM8K write them: optional sign (not a minus between two operands),
# optional "$", thousands separators in groups of three, optional decimals.
_NUMBER = r"(?:(?<![\d)])-)?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_HASH_NUMBER_RE = re.compile(r"####\s*(" + _NUMBER + ")")
_FINAL_LINE_RE = re.compile(r"####\s*" + _NUMBER + r"\s*\.?")
_MAX_NUMBER_CHARS = 40  # longer digit runs are not answers (and would be slow to convert)


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as is, or the assistant content of a message list."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    parts: list[str] = []
    for message in completion:
        if message.get("role", "assistant") != "assistant":
            continue
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # multimodal-style content parts
            parts.extend(part.get("text", "") for part in content if isinstance(part, dict))
    return "\n".join(parts)


def normalize_number(text: str | None) -> str | None:
    """Canonical form of a number string: "$1,234.0" -> "1234", "-0.50" -> "-0.5"; None if not a number."""
    if text is None:
        return None
    cleaned = str(text).strip().replace(",", "").replace("$", "").rstrip(".")
    if not cleaned or len(cleaned) > _MAX_NUMBER_CHARS:
        return None
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_final_number(text: str) -> str | None:
    """The final answer in `text`, normalised (see `normalize_number`), or None if it has no number.

    The number right after the last `####` wins; without a `#### <number>`, the last number anywhere in the
    text is used instead (the fallback).
    """
    marked = _HASH_NUMBER_RE.findall(text)
    if marked:
        return normalize_number(marked[-1])
    last = None
    for match in _NUMBER_RE.finditer(text):
        last = match.group(0)
    return normalize_number(last)


def gsm8k_accuracy_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's final number equals the reference answer, else 0.0.

    The final number is the one after the last `####`; when the completion has no `#### <number>`, the last
    number anywhere in it is used (so "... she has 19 pens." still counts). A completion with no number at
    all scores 0.0. Numbers compare by value: "18", "18.0" and "$18" all match 18, and "1,800" matches 1800.
    A reference answer that is not a number gives None, which TRL skips.
    """
    return score_final_numbers(completions, answer, lambda predicted, gold: float(predicted == gold))


def score_final_numbers(
    completions: list[Any], answer: list[str], score: Callable[[str, str], float]
) -> list[float | None]:
    """`score(final, reference)` per completion, both normalised numbers (see `extract_final_number`): None
    where the reference is not a number (TRL skips it), 0.0 where the completion has no number."""
    rewards: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        gold_value = normalize_number(gold)
        if gold_value is None:
            rewards.append(None)
            continue
        predicted = extract_final_number(completion_text(completion))
        rewards.append(0.0 if predicted is None else score(predicted, gold_value))
    return rewards


def gsm8k_format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """The reference run's format reward, adapted to prompts without `<think>` tags.

    - 1.0: reasoning (at least one non-empty line, without `####`) followed by a last line that is just
      `#### <number>`;
    - 0.5: a `#### <number>` answer, but no reasoning before it, more text after it, or several `####`;
    - 0.1: no `#### <number>`, but the completion contains a number (an answer the fallback can read);
    - 0.0: otherwise.
    """
    rewards: list[float] = []
    for completion in completions:
        lines = [line for line in completion_text(completion).splitlines() if line.strip()]
        reasoning = lines[:-1]
        if (
            reasoning
            and _FINAL_LINE_RE.fullmatch(lines[-1].strip())
            and not any("####" in line for line in reasoning)  # one answer, not a stutter of "#### N" lines
        ):
            rewards.append(1.0)
        elif any(_HASH_NUMBER_RE.search(line) for line in lines):
            rewards.append(0.5)
        elif any(_NUMBER_RE.search(line) for line in lines):
            rewards.append(0.1)
        else:
            rewards.append(0.0)
    return rewards


# "= 14" in a worked solution ("26 - 12 = 14.") or a GSM8K calculator annotation ("<<26-12=14>>14").
_RESULT_RE = re.compile(r"=\s*(" + _NUMBER + ")")


def equation_results(text: str) -> list[str]:
    """The normalised numbers that `text` writes right after an `=`: the results of its worked steps."""
    results = (normalize_number(m) for m in _RESULT_RE.findall(text))
    return [r for r in results if r is not None]


def gsm8k_step_reward(completions: list[Any], solution: list[str], **kwargs: Any) -> list[float | None]:
    """Partial credit for the reference's intermediate results: a dense companion to `gsm8k_accuracy_reward`.

    The reference results are the numbers after each `=` of the worked `solution` (GSM8K's calculator
    annotations included); the completion's are the numbers it writes after an `=`. The score is the size of
    their multiset intersection over the larger of the two lists, in [0, 1]: every reference step computed, and
    no extra equations (so writing many guesses does not pay). A multi-step problem that no member solves
    still tells members apart by how many of its steps they get right, where the 0/1 correctness cannot.
    `None` (skipped) when the solution has no `= N` step.
    """
    rewards: list[float | None] = []
    for completion, reference in zip(completions, solution, strict=True):
        wanted = equation_results(reference or "")
        if not wanted:
            rewards.append(None)
            continue
        written = equation_results(completion_text(completion))
        matched = sum((Counter(wanted) & Counter(written)).values())  # multiset intersection
        rewards.append(matched / max(len(wanted), len(written)))
    return rewards
