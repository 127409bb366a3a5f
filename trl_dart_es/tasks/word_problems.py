"""Version 2 of the offline GSM8K-style generator: a wider task, built to measure transfer.

Version 1 (`make_synthetic_gsm8k(version=1)`, the default) has about three sentence templates per operation and
two question forms, so a model can learn the templates instead of the arithmetic. Version 2 has many templates
per operation, several question forms, 48 names, 40 objects (some counted in units such as dollars or pages),
and sentences that carry no number or an irrelevant one. Two kinds of text never reach the train split:

* whole sentence templates and question forms (`HELD_OUT_TEMPLATES`): test rows that use one have
  `template == "held_out"`;
* names and objects (`HELD_OUT_NAMES`, `HELD_OUT_OBJECTS`): test rows that use one have `wording == "held_out"`.

Held-out accuracy on either column then measures whether a gain transfers to text training never showed.
"""

from __future__ import annotations

import random
from typing import Any

# (name, pronoun, possessive): version 1 draws from the first 20, version 2 from all 48.
NAMES_V1 = [
    ("Tom", "he", "his"), ("Anna", "she", "her"), ("Liam", "he", "his"), ("Sofia", "she", "her"),
    ("Omar", "he", "his"), ("Grace", "she", "her"), ("Noah", "he", "his"), ("Maya", "she", "her"),
    ("Ben", "he", "his"), ("Lucy", "she", "her"), ("Ravi", "he", "his"), ("Emma", "she", "her"),
    ("Carlos", "he", "his"), ("Zoe", "she", "her"), ("Kenji", "he", "his"), ("Nora", "she", "her"),
    ("Sam", "he", "his"), ("Leah", "she", "her"), ("Hugo", "he", "his"), ("Ivy", "she", "her"),
]  # fmt: skip
_NAMES = NAMES_V1 + [
    ("Ahmed", "he", "his"), ("Chloe", "she", "her"), ("Diego", "he", "his"), ("Fatima", "she", "her"),
    ("Jonas", "he", "his"), ("Priya", "she", "her"), ("Mateo", "he", "his"), ("Hana", "she", "her"),
    ("Felix", "he", "his"), ("Amara", "she", "her"), ("Yusuf", "he", "his"), ("Elena", "she", "her"),
    ("Oscar", "he", "his"), ("Mei", "she", "her"), ("Tariq", "he", "his"), ("Julia", "she", "her"),
    ("Pablo", "he", "his"), ("Aisha", "she", "her"), ("Lukas", "he", "his"), ("Rosa", "she", "her"),
    ("Arjun", "he", "his"), ("Clara", "she", "her"), ("Mikhail", "he", "his"), ("Ines", "she", "her"),
    ("Kofi", "he", "his"), ("Yara", "she", "her"), ("Tomas", "he", "his"), ("Lina", "she", "her"),
]  # fmt: skip
# (plural noun, whether it is food: eaten, not lost)
_OBJECTS = [
    ("apples", True), ("pencils", False), ("stickers", False), ("marbles", False), ("cookies", True),
    ("books", False), ("stamps", False), ("shells", False), ("cards", False), ("beads", False),
    ("eggs", True), ("balloons", False), ("coins", False), ("flowers", False), ("candies", True),
    ("crayons", False), ("buttons", False), ("oranges", True), ("rocks", False), ("toy cars", False),
    ("muffins", True), ("paper cranes", False), ("seashells", False), ("postcards", False), ("plums", True),
    ("comic books", False), ("ribbons", False), ("pebbles", False), ("cupcakes", True), ("keychains", False),
    ("dollars", False), ("pages", False), ("minutes of music", False), ("tickets", False), ("bananas", True),
    ("puzzle pieces", False), ("feathers", False), ("grapes", True), ("photos", False), ("badges", False),
]  # fmt: skip
HELD_OUT_NAMES: frozenset[str] = frozenset({"Kofi", "Yara", "Tomas", "Lina", "Mikhail", "Ines"})
HELD_OUT_OBJECTS: frozenset[str] = frozenset(
    {"bananas", "puzzle pieces", "feathers", "grapes", "photos", "badges"}
)
_FRIENDS = ["a friend", "a neighbour", "a classmate", "a cousin", "a teacher", "an uncle", "an aunt"]
_CONTAINERS = ["boxes", "bags", "jars", "baskets", "packs", "trays", "crates", "envelopes"]

# Sentence templates, by id. {N} name, {he}/{He} pronoun, {his} possessive, {o} object, {x} amount, {b} change,
# {k} factor or count, {n} amount per container, {c} container, {f} a friend.
_START = {
    "start0": "{N} has {x} {o}.",
    "start1": "{N} owns {x} {o}.",
    "start2": "There are {x} {o} in {N}'s room.",
    "start3": "{N} starts the week with {x} {o}.",
    "start4": "{N} collected {x} {o} last month.",
    "start5": "{N} keeps {x} {o} in a drawer.",
}
_START_GROUPS = {
    "group0": "{N} has {k} {c} with {n} {o} in each.",
    "group1": "{N} buys {k} {c} of {o}, and each holds {n}.",
    "group2": "{N} fills {k} {c}, putting {n} {o} into every one.",
}
_ADD = {
    "add0": "{He} buys {b} more {o}.",
    "add1": "{F} gives {N} {b} {o}.",
    "add2": "{He} finds {b} more {o}.",
    "add3": "{He} receives {b} {o} as a gift.",
    "add4": "{He} picks up another {b} {o}.",
    "add5": "{He} wins {b} {o} at a fair.",
    "add6": "{He} gets {b} extra {o} from {f}.",
    "add7": "Later, {he} adds {b} {o} to {his} collection.",
}
_SUB = {
    "sub0": "{He} gives {b} {o} to {f}.",
    "sub1": "{He} loses {b} {o}.",
    "sub2": "{He} uses {b} {o} for a school project.",
    "sub3": "{He} sells {b} of {his} {o}.",
    "sub4": "{He} donates {b} {o} to a charity.",
    "sub5": "{F} borrows {b} {o} and never returns them.",
    "sub6": "{He} trades away {b} {o}.",
    "sub7": "{He} throws away {b} {o}.",
}
_SUB_FOOD = {
    "subfood0": "{He} eats {b} of the {o}.",
    "subfood1": "{He} shares {b} {o} with {f}, who eats them.",
}
_MUL = {
    "mul0": "Then the number of {o} {he} has becomes {k} times as large.",
    "mul1": "After a good week {he} has {k} times as many {o} as before.",
    "mul2": "{His} stock of {o} grows to {k} times its size.",
    "mul3": "Next, {he} multiplies {his} {o} by {k}.",
}
_DIV = {
    "div0": "Then {he} splits {his} {o} into {k} equal groups and keeps only one group.",
    "div1": "{He} shares the {o} equally among {k} children, {himself} included, and keeps {his} share.",
    "div2": "{He} keeps only a 1/{k} share of {his} {o} and gives the rest away.",
    "div3": "{He} divides the {o} into {k} equal piles and puts all but one pile away.",
}
_QUESTIONS = {
    "q0": "How many {o} does {N} have now?",
    "q1": "How many {o} does {N} have at the end?",
    "q2": "How many {o} does {N} end up with?",
    "q3": "After all this, how many {o} does {N} have?",
    "q4": "What is the number of {o} {N} has in the end?",
    "q5": "Count {N}'s {o} at the end: how many are there?",
}
# Sentences without a number, or with one that does not matter.
_DISTRACTORS = {
    "noise0": "{N}'s favourite colour is green.",
    "noise1": "It is a sunny Saturday.",
    "noise2": "{N} is {r} years old.",
    "noise3": "{F} lives {r} streets away.",
    "noise4": "The shop closes at {r} o'clock.",
    "noise5": "{His} {other} are not counted.",
}
# Never in the train split: one of each kind (the ids above).
HELD_OUT_TEMPLATES: frozenset[str] = frozenset(
    {"start5", "add7", "sub7", "subfood1", "mul3", "div3", "q5", "noise5"}
)
FACTORS = (2, 3, 4, 5)  # multipliers and divisors


def allowed_operations(x: int, smallest_change: int) -> list[str]:
    """The operations that keep amounts integer, positive and at most 500 from amount `x`, in a fixed order (the
    draw depends on it); removing needs `x` above the smallest amount a problem adds or removes."""
    choices = ["add", "sub", "mul", "div"]
    if x <= smallest_change:
        choices.remove("sub")
    if not any(x % f == 0 for f in FACTORS):
        choices.remove("div")
    if x * 2 > 500:
        choices.remove("mul")
    return choices


def _fill(template: str, slots: dict[str, Any]) -> str:
    text = template.format(**slots)
    return text[0].upper() + text[1:]


def generate_problem_v2(rng: random.Random, level: int, max_start: int, max_delta: int) -> dict[str, Any]:
    """One word problem with exactly `level` operations, integer results and no negative amounts.

    Returns the question, a worked solution, the answer, the level, the template ids used and the name and
    object (for the held-out columns).
    """
    name, he, his = rng.choice(_NAMES)
    obj, food = rng.choice(_OBJECTS)
    other = rng.choice([o for o, _ in _OBJECTS if o != obj and o not in HELD_OUT_OBJECTS])  # a distractor's
    slots = {
        "N": name, "he": he, "He": he.capitalize(), "his": his, "His": his.capitalize(), "o": obj,
        "himself": "himself" if he == "he" else "herself", "other": other,
    }  # fmt: skip
    used: list[str] = []
    story: list[str] = []
    steps: list[str] = []

    def say(templates: dict[str, str], **values: Any) -> None:
        fresh = sorted(set(templates) - set(used))  # no sentence twice in one problem
        tid = rng.choice(fresh or sorted(templates))
        friend = rng.choice(_FRIENDS)
        used.append(tid)
        story.append(_fill(templates[tid], {**slots, "f": friend, "F": friend, **values}))

    ops_left = level
    if rng.random() < 0.35:  # start from "k containers with n each" (a multiplication)
        k, n = rng.randint(2, 6), rng.randint(2, max(3, max_start // 3))
        say(_START_GROUPS, k=k, n=n, c=rng.choice(_CONTAINERS))
        x = k * n
        steps.append(f"{name} starts with {k} * {n} = {x} {obj}.")
        ops_left -= 1
    else:
        x = rng.randint(3, max_start)
        say(_START, x=x)
    while ops_left > 0:
        op = rng.choice(
            allowed_operations(x, smallest_change=2)
        )  # changes of 2 or more: "1 apples" reads wrong
        if op == "add":
            b = rng.randint(2, max(2, max_delta))
            say(_ADD, b=b)
            steps.append(f"{slots['He']} gets {b} more, so {x} + {b} = {x + b}.")
            x += b
        elif op == "sub":
            b = rng.randint(2, max(2, min(max_delta, x - 1)))
            say({**_SUB, **(_SUB_FOOD if food else {})}, b=b)
            steps.append(f"{slots['He']} has {b} fewer, so {x} - {b} = {x - b}.")
            x -= b
        elif op == "mul":
            k = rng.choice([f for f in FACTORS if x * f <= 500])
            say(_MUL, k=k)
            steps.append(f"It becomes {k} times as large, so {x} * {k} = {x * k}.")
            x *= k
        else:
            k = rng.choice([f for f in FACTORS if x % f == 0])
            say(_DIV, k=k)
            steps.append(f"{slots['He']} keeps one of {k} equal parts, so {x} / {k} = {x // k}.")
            x //= k
        ops_left -= 1
    if rng.random() < 0.3:  # a sentence that changes nothing, anywhere after the first
        before = len(story)
        say(_DISTRACTORS, r=rng.randint(2, 12))
        story.insert(rng.randint(1, before), story.pop())
    say(_QUESTIONS)
    return {
        "question": " ".join(story),
        "solution": "\n".join(steps + [f"#### {x}"]),
        "answer": str(x),
        "level": level,
        "templates": used,
        "name": name,
        "object": obj,
    }


def template_of(problem: dict[str, Any]) -> str:
    """ "held_out" if the problem uses a template or question form kept out of the train split, else "seen"."""
    return "held_out" if HELD_OUT_TEMPLATES.intersection(problem["templates"]) else "seen"


def wording_of_v2(problem: dict[str, Any]) -> str:
    """ "held_out" if the problem names a person or object kept out of the train split, else "seen"."""
    return (
        "held_out" if problem["name"] in HELD_OUT_NAMES or problem["object"] in HELD_OUT_OBJECTS else "seen"
    )
