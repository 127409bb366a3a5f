"""GSM8K in TRL's dataset formats, plus an offline generator of GSM8K-style word problems.

Rows carry `prompt` (conversational messages by default, or a plain string in TRL's "standard" format),
`answer` (the final integer as a string, the column `gsm8k_accuracy_reward` reads) and a stable `id`
(the key of DART-ES's per-problem difficulty state).
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

from datasets import Dataset

from . import word_problems

GSM8K_HUB_ID = "openai/gsm8k"

# Chosen by measurement on the embedded 135M model (docs/tasks.md): a short system instruction with the
# question alone as the user turn. A one-shot worked example made the model copy the "Question: ..."
# pattern after its answer and lowered its pass rate; longer instructions also did worse.
GSM8K_SYSTEM_PROMPT = (
    "Solve the math problem in a few short steps. "
    "Write the final answer on the last line as #### followed by the number."
)
# What the system prompt asks for (`prompt_style`); the learning study (results/study.md) compares
# them. "steps" is GSM8K_SYSTEM_PROMPT; the others ask for shorter completions, which a small completion
# budget cuts off less often.
_ANSWER = "Give only the final answer, written as #### followed by the number. Do not explain."
PROMPT_STYLES: dict[str, str] = {
    "steps": GSM8K_SYSTEM_PROMPT,
    "brief": (
        "Solve the math problem with one short equation per step. "
        "Then write #### followed by the final number."
    ),
    "equation": "Write one equation that solves the problem, then #### followed by the final number.",
    "answer": _ANSWER,
    "direct": "Give only the final answer: one number.",
    # "answer" behind one short sentence: with SmolLM2's chat template every prompt then shares exactly 32
    # tokens, one whole block of vLLM's CPU prefix cache (`vllm_enable_prefix_caching`), so each member
    # computes that prefix once per call instead of once per prompt.
    "answer-math": "You are good at math. " + _ANSWER,
    # "answer" plus one sentence after it: 35 shared tokens (one block), and untrained the same accuracy and
    # completion length as "answer" (results/prompt_probe_block.md).
    "answer-once": _ANSWER + " Write the answer line once, then stop.",
}
# Styles whose prompt also starts the assistant's turn: the model continues after this text (TRL's chat
# helper continues a final assistant message), so a "direct" completion is just the number.
ASSISTANT_PREFIXES: dict[str, str] = {"direct": "####"}


def format_gsm8k_prompt(
    question: str, *, conversational: bool = True, style: str = "steps"
) -> list[dict[str, str]] | str:
    """The prompt for one question: system + user messages, or one plain string for the standard format.

    `style` picks the system prompt from `PROMPT_STYLES`.
    """
    if style not in PROMPT_STYLES:
        raise ValueError(f"Unknown prompt style {style!r}; choose from {sorted(PROMPT_STYLES)}.")
    system, prefix = PROMPT_STYLES[style], ASSISTANT_PREFIXES.get(style)
    if conversational:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question.strip()}]
        return messages + ([{"role": "assistant", "content": prefix}] if prefix else [])
    return f"{system}\n\nQuestion: {question.strip()}\nAnswer:" + (f" {prefix}" if prefix else "")


_HASH_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def extract_gsm8k_answer(solution: str) -> str:
    """The final answer of a GSM8K reference solution: the text after `####`, commas stripped."""
    match = _HASH_ANSWER.search(solution)
    if match is None:
        raise ValueError(f"GSM8K solution has no '####' answer: {solution[-80:]!r}")
    return match.group(1).replace(",", "").replace("$", "").strip()


def to_trl_format(
    dataset: Dataset,
    *,
    split: str,
    conversational: bool = True,
    id_prefix: str = "gsm8k",
    prompt_style: str = "steps",
) -> Dataset:
    """Map rows shaped like `openai/gsm8k` (`question`, `answer` = worked solution) to TRL's format.

    `prompt` is added, `answer` becomes the bare final number, the worked solution moves to `solution`,
    `id` is `"{id_prefix}-{split}-{index:05d}"`, and all other columns are kept.
    """

    def convert(row: dict[str, Any], index: int) -> dict[str, Any]:
        return {
            "prompt": format_gsm8k_prompt(row["question"], conversational=conversational, style=prompt_style),
            "answer": extract_gsm8k_answer(row["answer"]),
            "solution": row["answer"],
            "id": f"{id_prefix}-{split}-{index:05d}",
        }

    return dataset.map(convert, with_indices=True)


def load_gsm8k(
    split: str = "train",
    *,
    conversational: bool = True,
    prompt_style: str = "steps",
    **load_dataset_kwargs: Any,
) -> Dataset:
    """The real GSM8K (`openai/gsm8k`, config "main") from the Hugging Face Hub, in TRL's format."""
    from datasets import load_dataset

    raw = load_dataset(GSM8K_HUB_ID, "main", split=split, **load_dataset_kwargs)
    return to_trl_format(raw, split=split, conversational=conversational, prompt_style=prompt_style)


# ----------------------------------------------------------------------------------------------------------
# Synthetic GSM8K-style problems (offline)
# ----------------------------------------------------------------------------------------------------------

_FRIENDS = ["a friend", "a neighbour", "a classmate", "a cousin", "a teacher", "a brother", "a sister"]
_OBJECTS = [
    "apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps", "shells", "cards", "beads",
    "eggs", "balloons", "coins", "flowers", "candies", "crayons", "buttons", "oranges", "rocks", "toy cars",
]  # fmt: skip
_CONTAINERS = ["boxes", "bags", "jars", "baskets", "packs"]

# Splits own disjoint slices of question-text hash space, so no question text can ever appear in two
# splits, whatever the seeds and sizes.
_SPLIT_BUCKETS = {"test": range(0, 1), "validation": range(1, 2), "train": range(2, 10)}

# Per level (= number of arithmetic operations): the largest starting amount and added/removed amount.
# Tuned on the embedded model (docs/tasks.md) so that the default mix spans solved, borderline and
# unsolved problems.
DEFAULT_LEVEL_RANGES: dict[int, tuple[int, int]] = {1: (10, 9), 2: (12, 9), 3: (20, 10)}
# Level 1 is drawn twice as often: the 135M model solves few level-2 and almost no level-3 problems, and
# ES only learns from problems that some population member solves.
DEFAULT_LEVEL_WEIGHTS: dict[int, float] = {1: 2.0, 2: 1.0, 3: 1.0}


# Phrasings that never appear in the train split: accuracy on test problems worded with them
# (`wording == "held_out"`) shows whether a gain is skill or the generator's wording.
HELD_OUT_PHRASES: tuple[str, ...] = (" finds ", " for a school project")


def wording_of(question: str) -> str:
    """Return "held_out" if the question uses a phrasing kept out of the train split, else "seen"."""
    return "held_out" if any(phrase in question for phrase in HELD_OUT_PHRASES) else "seen"


def _split_of(question: str) -> str:
    bucket = int(hashlib.sha256(question.encode()).hexdigest()[:8], 16) % 10
    return next(name for name, buckets in _SPLIT_BUCKETS.items() if bucket in buckets)


def _generate_problem(rng: random.Random, level: int, max_start: int, max_delta: int) -> dict[str, Any]:
    """One templated word problem with exactly `level` operations, integer results and no negative amounts."""
    name, he, his = rng.choice(word_problems.NAMES_V1)
    obj = rng.choice(_OBJECTS)
    He = he.capitalize()
    ops_left = level
    if rng.random() < 0.35:  # start from "k containers with n each" (a multiplication)
        k, n = rng.randint(2, 6), rng.randint(2, max(3, max_start // 3))
        container = rng.choice(_CONTAINERS)
        x = k * n
        story = [f"{name} has {k} {container} with {n} {obj} in each."]
        steps = [f"{name} starts with {k} * {n} = {x} {obj}."]
        ops_left -= 1
    else:
        x = rng.randint(3, max_start)
        story = [f"{name} has {x} {obj}."]
        steps = []
    while ops_left > 0:
        op = rng.choice(word_problems.allowed_operations(x, smallest_change=1))
        if op == "add":
            b = rng.randint(1, max_delta)
            friend = rng.choice(_FRIENDS)
            story.append(
                rng.choice(
                    [f"{He} buys {b} more {obj}.", f"{friend.capitalize()} gives {name} {b} {obj}.",
                     f"{He} finds {b} more {obj}."]
                )
            )  # fmt: skip
            steps.append(f"{He} gets {b} more, so {x} + {b} = {x + b}.")
            x += b
        elif op == "sub":
            b = rng.randint(1, min(max_delta, x - 1))
            friend = rng.choice(_FRIENDS)
            story.append(
                rng.choice(
                    [f"{He} gives {b} {obj} to {friend}.", f"{He} loses {b} {obj}.",
                     f"{He} uses {b} {obj} for a school project."]
                )
            )  # fmt: skip
            steps.append(f"{He} loses {b}, so {x} - {b} = {x - b}.")
            x -= b
        elif op == "mul":
            k = rng.choice([f for f in word_problems.FACTORS if x * f <= 500])
            story.append(f"Then the number of {obj} {he} has becomes {k} times as large.")
            steps.append(f"It becomes {k} times as large, so {x} * {k} = {x * k}.")
            x *= k
        else:
            k = rng.choice([f for f in word_problems.FACTORS if x % f == 0])
            story.append(f"Then {he} splits {his} {obj} into {k} equal groups and keeps only one group.")
            steps.append(f"{He} keeps one of {k} equal groups, so {x} / {k} = {x // k}.")
            x //= k
        ops_left -= 1
    question = (
        " ".join(story)
        + " "
        + rng.choice(
            [f"How many {obj} does {name} have now?", f"How many {obj} does {name} have at the end?"]
        )
    )
    solution = "\n".join(steps + [f"#### {x}"])
    return {"question": question, "solution": solution, "answer": str(x), "level": level}


def make_synthetic_gsm8k(
    num_examples: int,
    *,
    split: str = "train",
    seed: int = 0,
    levels: tuple[int, ...] = (1, 2, 3),
    level_weights: tuple[float, ...] | None = None,
    level_ranges: dict[int, tuple[int, int]] | None = None,
    conversational: bool = True,
    prompt_style: str = "steps",
    version: int = 1,
) -> Dataset:
    """Offline GSM8K-style word problems: 1 to 3 arithmetic steps (+, -, *, /) with integer results.

    Deterministic in (seed, split). Each split owns a disjoint slice of the question-text hash space, so no
    question appears in two splits. Columns: `prompt`, `answer`, `id`, `question`, `solution` (worked
    steps ending in `#### N`), `level` (the number of operations, the difficulty knob), `wording` ("seen", or
    "held_out" for questions using `HELD_OUT_PHRASES`, which the train split never contains).

    Args:
        num_examples: rows to generate.
        split: "train", "validation" or "test".
        seed: different seeds give different problems (and ids).
        levels: difficulty levels to draw from (each in 1..3).
        level_weights: relative frequency of each level (default: `DEFAULT_LEVEL_WEIGHTS`, 2:1:1).
        level_ranges: per level, (largest starting amount, largest added/removed amount).
        conversational: messages (`True`, default) or a plain-string prompt (TRL's standard format).
        prompt_style: the system prompt, a key of `PROMPT_STYLES` ("steps", the default, asks for short
            worked steps).
        version: 1 (the default, and every number measured so far): a few templates per operation, held-out
            phrasings. 2: the wider task of `trl_dart_es.tasks.word_problems` (many templates and question forms,
            distractor sentences); `wording` then marks held-out names and objects, and an extra `template`
            column marks whole sentence templates and question forms that the train split never contains.
    """
    if version not in (1, 2):
        raise ValueError(f"Unknown version {version!r} of the synthetic GSM8K generator; choose 1 or 2.")
    if split not in _SPLIT_BUCKETS:
        raise ValueError(
            f"Unknown split {split!r} for synthetic GSM8K; choose from {sorted(_SPLIT_BUCKETS)}."
        )
    if prompt_style not in PROMPT_STYLES:
        raise ValueError(f"Unknown prompt_style {prompt_style!r}; choose from {sorted(PROMPT_STYLES)}.")
    ranges = {**DEFAULT_LEVEL_RANGES, **(level_ranges or {})}
    bad = [lvl for lvl in levels if lvl not in ranges]
    if not levels or bad:
        raise ValueError(f"Levels must be a non-empty subset of {sorted(ranges)}, got {levels!r}.")
    if level_weights is None:
        weights = [DEFAULT_LEVEL_WEIGHTS.get(lvl, 1.0) for lvl in levels]
    else:
        weights = list(level_weights)
    if len(weights) != len(levels):
        raise ValueError("level_weights must have one weight per level.")

    rng = random.Random(f"trl_dart_es/synthetic-gsm8k/{split}/{seed}")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    attempts = 0
    while len(rows) < num_examples:
        attempts += 1
        if attempts > 100 * num_examples + 1000:
            raise RuntimeError("Could not generate enough distinct problems; widen level_ranges.")
        level = rng.choices(levels, weights=weights)[0]
        if version == 1:
            problem = _generate_problem(rng, level, *ranges[level])
        else:
            problem = word_problems.generate_problem_v2(rng, level, *ranges[level])
        if problem["question"] in seen or _split_of(problem["question"]) != split:
            continue
        if version == 1:
            wording, extra = wording_of(problem["question"]), {}
        else:
            wording = word_problems.wording_of_v2(problem)
            extra = {"template": word_problems.template_of(problem)}
        if split == "train" and "held_out" in (wording, *extra.values()):
            continue
        seen.add(problem["question"])
        index = len(rows)
        rows.append(
            {
                "prompt": format_gsm8k_prompt(
                    problem["question"], conversational=conversational, style=prompt_style
                ),
                "answer": problem["answer"],
                "id": f"synthetic-gsm8k-{split}-s{seed}-{index:05d}",
                "question": problem["question"],
                "solution": problem["solution"],
                "level": problem["level"],
                "wording": wording,
                **extra,
            }
        )
    return Dataset.from_list(rows)
