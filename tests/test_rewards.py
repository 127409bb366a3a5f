import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_dart_es.rewards import (
    ExpressionRejected,
    countdown_accuracy_reward,
    countdown_format_reward,
    equation_results,
    evaluate_arithmetic,
    extract_countdown_expression,
    extract_final_number,
    gsm8k_accuracy_reward,
    gsm8k_format_reward,
    gsm8k_step_reward,
)


def as_messages(texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


# ---------------------------------------------------------------------------------------------- GSM8K


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She has 4 + 5 = 9 pens.\n#### 9", "9"),
        ("#### 1,234", "1234"),
        ("#### $18", "18"),
        ("#### 18.0", "18"),
        ("#### 2.50", "2.5"),
        ("#### -7", "-7"),
        ("first #### 3 then #### 12", "12"),  # the last marked answer wins
        ("no marker, 3 apples then 12 apples.", "12"),  # fallback: last number anywhere
        ("#### The answer is 42.", "42"),  # marker without a number: fallback
        ("10-3", "3"),  # a minus between operands is not a sign
        ("nothing numeric here", None),
        ("", None),
    ],
)
def test_extract_final_number(text, expected):
    assert extract_final_number(text) == expected


def test_gsm8k_accuracy_strings_and_messages_agree():
    texts = [
        "4 * 6 = 24, minus 5 is 19.\n#### 19",
        "She has 19 pens.",  # fallback to the last number
        "#### 19.0",
        "#### $1,9",  # "1,9" is not a thousands group: the number after #### is 1
        "I am not sure.",  # no number at all
        "#### 20",
    ]
    answers = ["19"] * len(texts)
    expected = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert gsm8k_accuracy_reward(texts, answers) == expected
    assert gsm8k_accuracy_reward(as_messages(texts), answers) == expected


def test_gsm8k_accuracy_accepts_trainer_kwargs_and_skips_unparseable_gold():
    rewards = gsm8k_accuracy_reward(
        ["#### 5", "#### 5"],
        answer=["5", "five"],
        prompts=["p1", "p2"],
        completion_ids=[[1], [2]],
        trainer_state=None,
        id=["a", "b"],
    )
    assert rewards == [1.0, None]


def test_gsm8k_accuracy_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        gsm8k_accuracy_reward(["#### 1"], ["1", "2"])


def test_gsm8k_format_reward_levels():
    texts = [
        "Mia has 4 * 6 = 24 pens.\n#### 24",  # reasoning + final line
        "#### 24",  # no reasoning
        "Mia has 24 pens.\n#### 24\nThe answer is 24.",  # text after the answer
        "Mia has 24 pens.\n#### 24\n#### 24",  # a stutter of answers
        "Mia has 24 pens.",  # a number but no marker
        "I do not know.",
        "",
    ]
    expected = [1.0, 0.5, 0.5, 0.5, 0.1, 0.0, 0.0]
    assert gsm8k_format_reward(texts) == expected
    assert gsm8k_format_reward(as_messages(texts)) == expected


def test_gsm8k_rewards_score_only_the_completion():
    # The prompt holds a perfect "#### 19" example; it must not earn the completion anything.
    prompts = [[{"role": "user", "content": "Example ...\n#### 19\nQuestion: ..."}]]
    assert gsm8k_accuracy_reward(["no idea"], ["19"], prompts=prompts) == [0.0]
    assert gsm8k_format_reward(["no idea"], prompts=prompts) == [0.0]


def test_gsm8k_rewards_are_fast_on_huge_completions():
    huge = "1," * 500_000 + " 7 " + "x" * 500_000
    start = time.perf_counter()
    assert gsm8k_accuracy_reward([huge], ["7"]) == [1.0]
    gsm8k_format_reward([huge, "#" * 1_000_000])
    assert extract_final_number("9" * 1_000_000) is None  # absurdly long numbers are not answers
    assert time.perf_counter() - start < 2.0


@settings(max_examples=200, deadline=None)
@given(value=st.integers(min_value=-(10**9), max_value=10**9), text=st.text(max_size=60))
def test_gsm8k_marked_answer_always_wins(value, text):
    # Whatever reasoning precedes it, a final "#### value" line decides the answer.
    completion = f"{text}\n#### {value:,}"
    assert gsm8k_accuracy_reward([completion], [str(value)]) == [1.0]
    assert gsm8k_accuracy_reward([completion], [str(value + 1)]) == [0.0]


# ---------------------------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize(
    "expression, value",
    [
        ("(6 - 2) * 5", 20),
        ("6 / 4 * 2", 3),  # exact: 3/2 * 2
        ("-3 + 10", 7),
        ("((((1))))", 1),
        ("7 × 3 ÷ 7", 3),  # typographic operators
        ("0.5 * 4", 2),
    ],
)
def test_evaluate_arithmetic(expression, value):
    assert evaluate_arithmetic(expression).value == value


def test_evaluate_arithmetic_is_exact():
    assert evaluate_arithmetic("1 / 3 + 1 / 3 + 1 / 3").value == 1
    assert evaluate_arithmetic("0.1 + 0.2").value == Fraction(3, 10)


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('echo hacked')",
        "9**9**9**9",
        "2 ** 3",
        "1 // 2",
        "7 % 3",
        "abs(-3)",
        "x + 1",
        "[1, 2]",
        "1 if 1 else 2",
        "+3",  # unary plus is not in the grammar
        "True + 1",
        "'a' * 3",
        "1 / 0",
        "1 / (2 - 2)",
        "(" * 10_000 + "1" + ")" * 10_000,
        "1+" * 500_000 + "1",
        "9" * 1_000_000,
        "99999999 * 99999999 * 99999999",  # intermediate value over the limit
        "1e300",
        "1 < 2",
        "lambda: 1",
        "",
        "   ",
    ],
)
def test_evaluate_arithmetic_rejects_fast(expression):
    start = time.perf_counter()
    with pytest.raises(ExpressionRejected):
        evaluate_arithmetic(expression)
    assert time.perf_counter() - start < 0.5


def test_node_and_depth_limits_within_length_limit():
    with pytest.raises(ExpressionRejected, match="nodes"):
        evaluate_arithmetic("+".join(["(1+1+1+1)"] * 16))  # 127 nodes, only ~20 deep, 159 chars
    with pytest.raises(ExpressionRejected, match="deep"):
        evaluate_arithmetic("-" * 40 + "1")  # 41 levels of unary minus


# ---------------------------------------------------------------------------------------------- Countdown


def test_extract_countdown_expression():
    assert extract_countdown_expression("so... <answer> (6 - 2) * 5 </answer>") == "(6 - 2) * 5"
    assert extract_countdown_expression("<answer>1+1</answer> then <answer> 2*3 = 6 </answer>") == "2*3"
    assert extract_countdown_expression("steps\n#### 3 + 4\nmore") == "3 + 4"
    assert extract_countdown_expression("no answer here") is None
    assert extract_countdown_expression("<answer> </answer>") is None


def test_countdown_accuracy():
    numbers = [[2, 5, 6]] * 6
    target = [20] * 6
    texts = [
        "6 - 2 = 4, 4 * 5 = 20. <answer> (6 - 2) * 5 </answer>",  # correct
        "<answer> (6 - 2) * 5 = 20 </answer>",  # trailing "= 20" is dropped
        "<answer> 4 * 5 </answer>",  # right value, wrong numbers
        "<answer> (6 - 2) * 5 * 1 </answer>",  # an extra number
        "<answer> 6 * 5 - 2 </answer>",  # uses each once but equals 28
        "<answer> __import__('os') </answer>",
    ]
    expected = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert countdown_accuracy_reward(texts, numbers, target) == expected
    assert countdown_accuracy_reward(as_messages(texts), numbers, target, prompts=None) == expected


def test_countdown_numbers_used_exactly_once_as_multiset():
    # A repeated given number may be used twice, but a single one may not be reused.
    assert countdown_accuracy_reward(["<answer> 3 * 3 + 1 </answer>"], [[3, 3, 1]], [10]) == [1.0]
    assert countdown_accuracy_reward(["<answer> 3 * 3 + 1 </answer>"], [[3, 1, 9]], [10]) == [0.0]


def test_countdown_rewards_are_fast_on_hostile_completions():
    hostile = [
        "<answer>" * 200_000,  # many unclosed tags
        "<answer> " + "(" * 10_000 + "1" + ")" * 10_000 + " </answer>",
        "<answer> 9**9**9**9 </answer>",
        "#### " + "1*" * 500_000 + "1",
        "x" * 1_000_000 + "</answer>",
    ]
    start = time.perf_counter()
    assert countdown_accuracy_reward(hostile, [[1, 2, 3]] * 5, [6] * 5) == [0.0] * 5
    countdown_format_reward(hostile)
    assert time.perf_counter() - start < 2.0


def test_countdown_format_reward():
    texts = [
        "6 - 2 is 4 and 4 * 5 is 20.\n<answer> (6 - 2) * 5 </answer>",
        "<answer> (6 - 2) * 5 </answer>",  # no reasoning
        "reasoning <answer> (6 - 2) * 5 </answer> and more text",
        "reasoning <answer> six minus two </answer>",  # not arithmetic
        "reasoning\n#### (6 - 2) * 5",
        "no answer",
    ]
    assert countdown_format_reward(texts) == [1.0, 0.5, 0.5, 0.5, 0.5, 0.0]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=50), min_size=2, max_size=5), st.data())
def test_countdown_accepts_any_sum_or_product_of_the_numbers(nums, data):
    op = data.draw(st.sampled_from(["+", "*"]))
    order = data.draw(st.permutations(nums))
    expression = f" {op} ".join(str(n) for n in order)
    total = sum(nums) if op == "+" else eval_product(nums)
    completion = f"I combine them. <answer> {expression} </answer>"
    assert countdown_accuracy_reward([completion], [nums], [total]) == [1.0]
    assert countdown_accuracy_reward([completion], [nums], [total + 1]) == [0.0]
    assert countdown_accuracy_reward([completion], [nums + [1]], [total]) == [0.0]


def eval_product(nums):
    product = 1
    for n in nums:
        product *= n
    return product


_TWO_STEPS = "Ravi gives 12 away, so 26 - 12 = 14.\nIt becomes 5 times as large, so 14 * 5 = 70.\n#### 70"


def test_equation_results_read_worked_steps_and_gsm8k_annotations():
    assert equation_results(_TWO_STEPS) == ["14", "70"]
    # GSM8K's calculator annotations: the result after the inner "=", once per step.
    assert equation_results("She sold 48/2 = <<48/2=24>>24 clips.\n#### 24") == ["24"]
    assert equation_results("= $1,200.0 and = -3") == ["1200", "-3"]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("26 - 12 = 14, then 14 * 5 = 70.\n#### 70", 1.0),  # every step
        ("26 - 12 = 14, then 14 * 5 = 75.\n#### 75", 0.5),  # the first step right, the second wrong
        ("#### 70", 0.0),  # no worked step: partial credit is for steps, the 0/1 reward for the answer
        ("= 14 = 70 = 3 = 9", 0.5),  # extra guesses dilute the score: 2 right of 4 written
        ("14 * 5 = 70 and 26 - 12 = 14", 1.0),  # order does not matter
        ("26 - 12 = 14 and 26 - 12 = 14", 0.5),  # a result counts once per reference step
    ],
)
def test_gsm8k_step_reward(completion, expected):
    assert gsm8k_step_reward([completion], [_TWO_STEPS]) == [expected]
    assert gsm8k_step_reward(as_messages([completion]), [_TWO_STEPS], prompts=["p"]) == [expected]


def test_gsm8k_step_reward_skips_solutions_without_steps():
    assert gsm8k_step_reward(["= 5"], ["#### 5"]) == [None]
    with pytest.raises(ValueError):
        gsm8k_step_reward(["a", "b"], [_TWO_STEPS])


def test_gsm8k_step_reward_gives_credit_where_correctness_gives_none():
    # The synthetic task's own solutions score 1.0, and a wrong final answer with a right first step scores > 0.
    from trl_dart_es.tasks import make_synthetic_gsm8k

    rows = make_synthetic_gsm8k(20, levels=(2, 3), seed=1)
    assert gsm8k_step_reward(rows["solution"], rows["solution"]) == [1.0] * len(rows)
    first_step_only = [s.splitlines()[0] for s in rows["solution"]]
    assert gsm8k_accuracy_reward(first_step_only, rows["answer"]) != [1.0] * len(rows)
    assert all(0 < r < 1 for r in gsm8k_step_reward(first_step_only, rows["solution"]))
