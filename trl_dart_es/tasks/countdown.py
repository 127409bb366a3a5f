"""Countdown: reach a target by combining the given numbers with + - * /, each number used exactly once.

Every problem is solvable by construction: the target is the value of a random expression over the numbers
(the `solution` column). Offline and deterministic in (seed, split).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from datasets import Dataset

COUNTDOWN_SYSTEM_PROMPT = (
    "Solve the puzzle in a few short steps. Then write the final equation, using only the given numbers, "
    "inside <answer> </answer> tags, for example <answer> (6 - 2) * 5 </answer>."
)

_SPLIT_BUCKETS = {"test": range(0, 1), "validation": range(1, 2), "train": range(2, 10)}
_OPS = ("+", "-", "*", "/")


def format_countdown_prompt(
    numbers: list[int], target: int, *, conversational: bool = True
) -> list[dict[str, str]] | str:
    """The prompt for one puzzle: system + user messages, or one plain string for the standard format."""
    user = (
        f"Using the numbers {numbers}, create an equation that equals {target}. "
        "You can use +, -, * and /, and each number exactly once."
    )
    if conversational:
        return [{"role": "system", "content": COUNTDOWN_SYSTEM_PROMPT}, {"role": "user", "content": user}]
    return f"{COUNTDOWN_SYSTEM_PROMPT}\n\n{user}\nAnswer:"


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[str, int] | None:
    """Combine the numbers (in the given order) into a random binary tree; None if a step is not an integer."""
    # Each item: (text, value, is_atom). Merging random neighbours gives every tree shape.
    items: list[tuple[str, int, bool]] = [(str(n), n, True) for n in numbers]
    while len(items) > 1:
        i = rng.randrange(len(items) - 1)
        (lt, lv, la), (rt, rv, ra) = items[i], items[i + 1]
        op = rng.choice(_OPS)
        if op == "/" and (rv == 0 or lv % rv != 0):
            return None
        value = {"+": lv + rv, "-": lv - rv, "*": lv * rv, "/": lv // rv if rv else 0}[op]
        left = lt if la else f"({lt})"
        right = rt if ra else f"({rt})"
        items[i : i + 2] = [(f"{left} {op} {right}", value, False)]
    return items[0][0], items[0][1]


def make_countdown(
    num_examples: int,
    *,
    split: str = "train",
    seed: int = 0,
    num_numbers: int = 3,
    max_number: int = 20,
    max_target: int = 100,
    conversational: bool = True,
) -> Dataset:
    """Solvable Countdown puzzles in TRL's format.

    Columns: `prompt`, `numbers` (list of ints, shuffled), `target` (int in 1..max_target), `id`, `solution`
    (one expression over all the numbers that equals the target). Splits own disjoint slices of the
    (sorted numbers, target) hash space, so no puzzle appears in two splits.
    """
    if split not in _SPLIT_BUCKETS:
        raise ValueError(f"Unknown split {split!r} for Countdown; choose from {sorted(_SPLIT_BUCKETS)}.")
    if not 2 <= num_numbers <= 6:
        raise ValueError(f"num_numbers must be between 2 and 6, got {num_numbers}.")
    rng = random.Random(f"trl_dart_es/countdown/{split}/{seed}/{num_numbers}")
    rows: list[dict[str, Any]] = []
    seen: set[tuple[tuple[int, ...], int]] = set()
    attempts = 0
    while len(rows) < num_examples:
        attempts += 1
        if attempts > 1000 * num_examples + 1000:
            raise RuntimeError("Could not generate enough distinct puzzles; widen max_number or max_target.")
        numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
        built = _random_expression(rng, numbers)
        if built is None:
            continue
        expression, target = built
        key = (tuple(sorted(numbers)), target)
        if not 1 <= target <= max_target or key in seen:
            continue
        bucket = int(hashlib.sha256(repr(key).encode()).hexdigest()[:8], 16) % 10
        if bucket not in _SPLIT_BUCKETS[split]:
            continue
        seen.add(key)
        shown = numbers[:]
        rng.shuffle(shown)  # do not reveal the solution's order
        index = len(rows)
        rows.append(
            {
                "prompt": format_countdown_prompt(shown, target, conversational=conversational),
                "numbers": shown,
                "target": target,
                "id": f"countdown-{split}-s{seed}-n{num_numbers}-{index:05d}",
                "solution": expression,
            }
        )
    return Dataset.from_list(rows)
