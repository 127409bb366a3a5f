"""A restricted evaluator for arithmetic expressions written by a model (Countdown answers).

Model output is untrusted: it is parsed with `ast.parse` and walked by hand, never passed to eval/exec.
Only number literals, binary + - * /, unary minus and parentheses are accepted. Limits on the text length,
node count, nesting depth and the size of every intermediate value keep hostile inputs ("9**9**9**9",
10k nested parentheses, megabyte strings) cheap: they are rejected before or during a walk that does a
bounded amount of work. Arithmetic is exact (`fractions.Fraction`), so "(6 / 4) * 2 = 3" holds exactly.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from fractions import Fraction

MAX_EXPRESSION_CHARS = 200
MAX_NODES = 64
MAX_DEPTH = 32
MAX_MAGNITUDE = 10**12  # bound on |numerator| and denominator of every value, literals included

# Symbols models often write instead of Python operators.
_TRANSLATE = str.maketrans({"×": "*", "·": "*", "÷": "/", "−": "-", "–": "-"})


class ExpressionRejected(ValueError):
    """The expression is not allowed or could not be evaluated (the reason is in the message)."""


@dataclass(frozen=True)
class Evaluation:
    value: Fraction
    numbers: tuple[Fraction, ...]  # literals in the order they appear


def _check(value: Fraction) -> Fraction:
    if abs(value.numerator) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
        raise ExpressionRejected("intermediate value too large")
    return value


def evaluate_arithmetic(expression: str) -> Evaluation:
    """Evaluate `expression` exactly, returning its value and the number literals it uses.

    Raises `ExpressionRejected` (a `ValueError`) for anything outside the allowed grammar or limits,
    and for division by zero.
    """
    if not isinstance(expression, str):
        raise ExpressionRejected("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:  # checked before parsing: the parser is the expensive part
        raise ExpressionRejected("expression too long")
    text = expression.translate(_TRANSLATE).strip()
    if not text:
        raise ExpressionRejected("empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ExpressionRejected(f"not an expression: {exc.__class__.__name__}") from None

    numbers: list[Fraction] = []
    budget = [MAX_NODES]

    def walk(node: ast.AST, depth: int) -> Fraction:
        budget[0] -= 1
        if budget[0] < 0:
            raise ExpressionRejected("expression has too many nodes")
        if depth > MAX_DEPTH:
            raise ExpressionRejected("expression nested too deeply")
        if isinstance(node, ast.Constant):
            # bool is an int subclass; `True + 1` is not arithmetic on numbers.
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise ExpressionRejected("only number literals are allowed")
            if isinstance(node.value, float) and not (abs(node.value) < float(MAX_MAGNITUDE)):
                raise ExpressionRejected("number literal out of range")  # also rejects inf and nan
            # Floats go through their shortest repr so that 0.5 is 1/2 and 0.1 is 1/10, not a binary fraction.
            value = _check(
                Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value)
            )
            numbers.append(value)
            return value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand, depth + 1)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            left = walk(node.left, depth + 1)
            right = walk(node.right, depth + 1)
            if isinstance(node.op, ast.Add):
                return _check(left + right)
            if isinstance(node.op, ast.Sub):
                return _check(left - right)
            if isinstance(node.op, ast.Mult):
                return _check(left * right)
            if right == 0:
                raise ExpressionRejected("division by zero")
            return _check(left / right)
        raise ExpressionRejected(f"{node.__class__.__name__} is not allowed")

    try:
        value = walk(tree.body, 0)
    except RecursionError:  # unreachable with the depth limit, kept as a guard
        raise ExpressionRejected("expression nested too deeply") from None
    return Evaluation(value=value, numbers=tuple(numbers))


def uses_numbers_exactly_once(evaluation: Evaluation, numbers: list[int] | tuple[int, ...]) -> bool:
    """True when the expression's literals are exactly the given numbers, each used once (as a multiset)."""
    return sorted(evaluation.numbers) == sorted(Fraction(n) for n in numbers)
