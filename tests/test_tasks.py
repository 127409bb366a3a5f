import re
from fractions import Fraction

import pytest
from datasets import Dataset

from trl_dart_es.rewards import evaluate_arithmetic, gsm8k_accuracy_reward, gsm8k_format_reward
from trl_dart_es.tasks import (
    TASKS,
    extract_gsm8k_answer,
    get_task,
    load_task_dataset,
    make_countdown,
    make_synthetic_gsm8k,
    to_trl_format,
)

# Rows shaped like the real `openai/gsm8k` "main" config: the answer column holds the worked solution.
GSM8K_LIKE = Dataset.from_dict(
    {
        "question": [
            "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?",
            "A company paid $1,200 to each of 3 workers. How much did it pay?",
        ],
        "answer": [
            "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
            "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
            "It paid 3 * 1200 = <<3*1200=3600>>3600 dollars.\n#### 3,600",
        ],
    }
)


def test_gsm8k_mapping_conversational():
    ds = to_trl_format(GSM8K_LIKE, split="train")
    assert ds["answer"] == ["72", "3600"]
    assert ds["id"] == ["gsm8k-train-00000", "gsm8k-train-00001"]
    assert ds["question"] == GSM8K_LIKE["question"]  # extra columns are kept
    assert ds["solution"] == GSM8K_LIKE["answer"]  # the worked solution is not lost
    prompt = ds[0]["prompt"]
    assert [m["role"] for m in prompt] == ["system", "user"]
    assert GSM8K_LIKE["question"][0] in prompt[1]["content"]
    assert "####" in prompt[0]["content"]


def test_gsm8k_mapping_standard_format():
    ds = to_trl_format(GSM8K_LIKE, split="test", conversational=False)
    assert isinstance(ds[0]["prompt"], str)
    assert GSM8K_LIKE["question"][1] in ds[1]["prompt"]
    assert ds["id"][1] == "gsm8k-test-00001"


def test_extract_gsm8k_answer_requires_marker():
    assert extract_gsm8k_answer("so 5\n#### -5") == "-5"
    with pytest.raises(ValueError):
        extract_gsm8k_answer("no final answer")


def test_synthetic_gsm8k_columns_and_solutions():
    ds = make_synthetic_gsm8k(60, split="train", seed=3)
    assert set(ds.column_names) >= {"prompt", "answer", "id", "question", "solution", "level"}
    assert len(set(ds["id"])) == 60 and len(set(ds["question"])) == 60
    for row in ds:
        assert row["level"] in (1, 2, 3)
        assert row["solution"].endswith(f"#### {row['answer']}")
        assert int(row["answer"]) >= 0
        # The worked solution has one equation per operation, and each one is arithmetically true.
        equations = re.findall(r"(\d+ [-+*/] \d+) = (\d+)", row["solution"])
        assert len(equations) == row["level"]
        for lhs, rhs in equations:
            assert evaluate_arithmetic(lhs).value == Fraction(int(rhs))
        # A reference solution is a perfect completion for both rewards.
    assert gsm8k_accuracy_reward(ds["solution"], ds["answer"]) == [1.0] * 60
    assert gsm8k_format_reward(ds["solution"]) == [1.0] * 60


def test_synthetic_gsm8k_is_deterministic_and_seeded():
    a = make_synthetic_gsm8k(20, split="train", seed=1)
    b = make_synthetic_gsm8k(20, split="train", seed=1)
    c = make_synthetic_gsm8k(20, split="train", seed=2)
    assert a.to_list() == b.to_list()
    assert a["question"] != c["question"]
    assert not set(a["id"]) & set(c["id"])


def test_synthetic_gsm8k_splits_are_disjoint():
    train = make_synthetic_gsm8k(1000, split="train", seed=0)
    test = make_synthetic_gsm8k(300, split="test", seed=0)
    test_other_seed = make_synthetic_gsm8k(300, split="test", seed=1)
    assert not set(train["question"]) & set(test["question"])
    assert not set(train["question"]) & set(test_other_seed["question"])
    assert not set(train["id"]) & set(test["id"])


def test_synthetic_gsm8k_levels_and_weights():
    only_one = make_synthetic_gsm8k(30, levels=(1,))
    assert set(only_one["level"]) == {1}
    mixed = make_synthetic_gsm8k(300, levels=(1, 3), level_weights=(3.0, 1.0))
    counts = {lvl: mixed["level"].count(lvl) for lvl in (1, 3)}
    assert counts[1] > 1.5 * counts[3] > 0
    with pytest.raises(ValueError):
        make_synthetic_gsm8k(5, levels=(7,))
    with pytest.raises(ValueError):
        make_synthetic_gsm8k(5, split="dev")


def test_countdown_is_solvable_by_construction():
    for num_numbers in (3, 4):
        ds = make_countdown(50, split="train", seed=0, num_numbers=num_numbers)
        assert set(ds.column_names) >= {"prompt", "numbers", "target", "id", "solution"}
        for row in ds:
            assert len(row["numbers"]) == num_numbers
            evaluation = evaluate_arithmetic(row["solution"])
            assert evaluation.value == row["target"]
            assert sorted(evaluation.numbers) == sorted(Fraction(n) for n in row["numbers"])
            assert str(row["target"]) in row["prompt"][1]["content"]


def test_countdown_splits_disjoint_and_deterministic():
    train = make_countdown(300, split="train", seed=0)
    test = make_countdown(100, split="test", seed=0)
    key = lambda row: (tuple(sorted(row["numbers"])), row["target"])  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in test}
    assert make_countdown(10, split="test", seed=0).to_list() == test.select(range(10)).to_list()


def test_load_task_dataset_names_and_formats():
    ds = load_task_dataset("embedded:gsm8k", "test", num_examples=8)
    assert len(ds) == 8 and isinstance(ds[0]["prompt"], list)
    std = load_task_dataset("embedded:countdown", "train", num_examples=4, conversational=False)
    assert isinstance(std[0]["prompt"], str)
    assert set(TASKS) == {"openai/gsm8k", "embedded:gsm8k", "embedded:countdown"}
    assert get_task("embedded:gsm8k").reward_weights == (1.0, 0.1)
    with pytest.raises(ValueError, match="embedded:gsm8k"):
        load_task_dataset("gsm9k", "train")


def test_default_sizes():
    assert len(load_task_dataset("embedded:gsm8k", "test")) == 128


def test_hub_gsm8k_goes_through_load_dataset(monkeypatch):
    # The hub path is offline here; check it asks for the right data set and maps what it gets.
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return GSM8K_LIKE

    monkeypatch.setattr("datasets.load_dataset", fake_load_dataset)
    ds = load_task_dataset("openai/gsm8k", "test")
    assert calls == [("openai/gsm8k", "main", "test")]
    assert ds["answer"] == ["72", "3600"] and ds["id"][0] == "gsm8k-test-00000"


def test_prompt_styles_change_only_the_system_prompt():
    from trl_dart_es.tasks.gsm8k import PROMPT_STYLES

    steps = make_synthetic_gsm8k(6, split="test")
    for style, system in PROMPT_STYLES.items():
        ds = make_synthetic_gsm8k(6, split="test", prompt_style=style)
        assert [p[0]["content"] for p in ds["prompt"]] == [system] * 6
        # Same problems, answers and ids whatever the prompt asks for.
        assert (
            ds["question"] == steps["question"]
            and ds["answer"] == steps["answer"]
            and ds["id"] == steps["id"]
        )
    plain = load_task_dataset(
        "embedded:gsm8k", "test", conversational=False, prompt_style="answer", num_examples=2
    )
    assert plain["prompt"][0].startswith(PROMPT_STYLES["answer"])
    hub_like = to_trl_format(GSM8K_LIKE, split="train", prompt_style="brief")
    assert hub_like["prompt"][0][0]["content"] == PROMPT_STYLES["brief"]
    with pytest.raises(ValueError, match="'terse'"):
        make_synthetic_gsm8k(2, split="test", prompt_style="terse")


def test_held_out_wording_never_reaches_the_train_split():
    from trl_dart_es.tasks.gsm8k import HELD_OUT_PHRASES, wording_of

    train = make_synthetic_gsm8k(400, split="train", seed=0)
    test = make_synthetic_gsm8k(400, split="test", seed=0)
    assert set(train["wording"]) == {"seen"}
    assert not any(phrase in q for q in train["question"] for phrase in HELD_OUT_PHRASES)
    # The test split keeps both kinds, labelled by the phrases they use.
    assert [wording_of(q) for q in test["question"]] == test["wording"]
    held_out = test["wording"].count("held_out")
    assert 0.05 * len(test) < held_out < 0.5 * len(test)


def test_task_arguments_load_splits_with_the_options_that_are_set():
    from trl_dart_es.tasks import load_task_dataset
    from trl_dart_es.tasks.arguments import TaskArguments

    args = TaskArguments(
        dataset_name="embedded:gsm8k", dataset_test_split="test", prompt_style="answer", eval_num_examples=12
    )
    held_out, train = args.load_split("test"), args.load_split("validation")
    assert len(held_out) == 12  # the held-out size applies to the test split only
    assert len(train) == len(load_task_dataset("embedded:gsm8k", "validation"))
    answer = load_task_dataset("embedded:gsm8k", "test", prompt_style="answer", num_examples=12)
    assert held_out["prompt"] == answer["prompt"]
    assert held_out["prompt"] != load_task_dataset("embedded:gsm8k", "test", num_examples=12)["prompt"]
    # Unset options are not passed: a task without prompt styles loads as it always did.
    countdown = TaskArguments(dataset_name="embedded:countdown", dataset_test_split="test").load_split("test")
    assert len(countdown) == len(load_task_dataset("embedded:countdown", "test"))


def test_task_arguments_reward_funcs_by_name_or_import_path_as_trls_grpo_script():
    from trl_dart_es.rewards import (
        countdown_accuracy_reward,
        gsm8k_accuracy_reward,
        gsm8k_format_reward,
        gsm8k_step_reward,
    )
    from trl_dart_es.tasks.arguments import TaskArguments

    # Unset: the task's own rewards (the countdown task's for countdown, GSM8K's for a local folder).
    assert TaskArguments(dataset_name="embedded:gsm8k").load_reward_funcs() == [
        gsm8k_accuracy_reward,
        gsm8k_format_reward,
    ]
    assert (
        TaskArguments(dataset_name="embedded:countdown").load_reward_funcs()[0] is countdown_accuracy_reward
    )
    names = ["gsm8k_accuracy_reward", "trl_dart_es.rewards.gsm8k.gsm8k_step_reward"]
    assert TaskArguments(dataset_name="embedded:gsm8k", reward_funcs=names).load_reward_funcs() == [
        gsm8k_accuracy_reward,
        gsm8k_step_reward,
    ]
    # A name that is neither a reward of this package nor an import path is refused by name.
    with pytest.raises(ValueError, match="'gsm8k_acuracy_reward'.*gsm8k_step_reward"):
        TaskArguments(
            dataset_name="embedded:gsm8k", reward_funcs=["gsm8k_acuracy_reward"]
        ).load_reward_funcs()
    with pytest.raises(ValueError, match="'normalize_number'"):  # in trl_dart_es.rewards, but not a reward
        TaskArguments(dataset_name="embedded:gsm8k", reward_funcs=["normalize_number"]).load_reward_funcs()


def test_task_arguments_reward_funcs_import_a_module_from_the_working_directory(tmp_path, monkeypatch):
    from trl_dart_es.tasks.arguments import TaskArguments

    (tmp_path / "my_study_rewards.py").write_text(
        "def always_one(completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))  # undo the insertion after the test
    (func,) = TaskArguments(
        dataset_name="embedded:gsm8k", reward_funcs=["my_study_rewards.always_one"]
    ).load_reward_funcs()
    assert func(["a", "b"]) == [1.0, 1.0]


def test_block_styles_share_one_prefix_cache_block():
    """ "answer-math" and "answer-once" exist for vLLM's CPU prefix cache (32-token blocks): with the embedded
    model's chat template every prompt must share at least one whole block, where "answer" shares less."""
    import os

    from trl_dart_es.embedded import load_tokenizer
    from trl_dart_es.rollout.prompts import render_prompts

    tok = load_tokenizer("embedded:smollm2-135m")

    def shared(style: str) -> int:  # tokenized as the vLLM rollout encodes prompts
        rows = make_synthetic_gsm8k(32, split="train", prompt_style=style)["prompt"]
        ids = tok(render_prompts(rows, tok), add_special_tokens=False)["input_ids"]
        return len(os.path.commonprefix(ids))

    assert shared("answer") < 32
    assert shared("answer-math") >= 32
    assert shared("answer-once") >= 32


# ------------------------------------------------------------------------------------ version 2: a wider task
def _literal_pieces(template: str) -> list[str]:
    """The fixed text of a template between its {slots}, long enough to be distinctive."""
    import re

    return [p.strip() for p in re.split(r"\{[^}]*\}", template) if len(p.strip()) >= 8]


def test_version_2_never_puts_held_out_templates_names_or_objects_in_train():
    from trl_dart_es.tasks import word_problems as wp

    train = make_synthetic_gsm8k(3000, split="train", version=2)["question"]
    test = make_synthetic_gsm8k(600, split="test", version=2)
    every = {**wp._START, **wp._START_GROUPS, **wp._ADD, **wp._SUB, **wp._SUB_FOOD, **wp._MUL, **wp._DIV}
    every.update({**wp._QUESTIONS, **wp._DISTRACTORS})
    assert wp.HELD_OUT_TEMPLATES <= set(every)
    for tid in sorted(wp.HELD_OUT_TEMPLATES):
        pieces = _literal_pieces(every[tid])
        assert pieces, tid
        assert not any(all(p in q for p in pieces) for q in train), f"held-out template {tid} is in train"
        assert any(all(p in q for p in pieces) for q in test["question"]), (
            f"{tid} never in test: proves nothing"
        )
    words = re.compile(r"\b(" + "|".join(sorted((*wp.HELD_OUT_NAMES, *wp.HELD_OUT_OBJECTS))) + r")\b")
    assert not any(words.search(q) for q in train)
    assert sum(bool(words.search(q)) for q in test["question"]) > 30
    # The columns say which test rows use held-out text, and train has none of either kind.
    held_out_pieces = [_literal_pieces(every[tid]) for tid in wp.HELD_OUT_TEMPLATES]
    for q, template, wording in zip(test["question"], test["template"], test["wording"], strict=True):
        assert (wording == "held_out") == bool(words.search(q)), q
        assert (template == "held_out") == any(all(p in q for p in ps) for ps in held_out_pieces), q
    assert {"seen", "held_out"} == set(test["template"])


def test_version_2_solutions_are_correct_arithmetic_and_have_distractors():
    import re

    from trl_dart_es.tasks import word_problems as wp

    rows = make_synthetic_gsm8k(500, split="train", version=2, seed=3)
    ops = {
        "+": lambda a, b: a + b,
        "-": lambda a, b: a - b,
        "*": lambda a, b: a * b,
        "/": lambda a, b: a // b,
    }
    for solution, answer in zip(rows["solution"], rows["answer"], strict=True):
        value = None
        for a, op, b, c in re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", solution):
            assert ops[op](int(a), int(b)) == int(c) and (op != "/" or int(a) % int(b) == 0), solution
            assert value is None or int(a) == value, solution  # each step starts from the last result
            value = int(c)
        assert solution.endswith(f"#### {answer}") and (value is None or value == int(answer))
    noise = [_literal_pieces(t) for t in wp._DISTRACTORS.values()]
    with_noise = sum(
        any(pieces and all(p in q for p in pieces) for pieces in noise) for q in rows["question"]
    )
    assert 0.1 < with_noise / len(rows) < 0.4  # about 30% carry a sentence that changes nothing
    assert len(set(rows["question"])) == len(rows)


def test_version_1_stays_the_default_and_a_bad_version_is_refused():
    v1 = make_synthetic_gsm8k(20, split="test")
    assert "template" not in v1.column_names
    assert v1["question"] == make_synthetic_gsm8k(20, split="test", version=1)["question"]
    assert v1["question"] != make_synthetic_gsm8k(20, split="test", version=2)["question"]
    with pytest.raises(ValueError, match="Unknown version 3 "):
        make_synthetic_gsm8k(5, version=3)


def test_held_out_templates_get_their_own_accuracy():
    import numpy as np

    from trl_dart_es.scoring import accuracy_by_group

    solved = np.array([True, False, True, True])
    metrics = accuracy_by_group(solved, {"template": ["seen", "held_out", "held_out", "seen"]})
    assert metrics == {"accuracy/template_held_out": 0.5, "accuracy/template_seen": 1.0}


def test_recipe_arguments_pick_the_task_version():
    from trl_dart_es.tasks.arguments import TaskArguments

    v2 = TaskArguments(dataset_name="embedded:gsm8k", task_version=2, eval_num_examples=40).load_split("test")
    assert len(v2) == 40 and "template" in v2.column_names
    assert "template" not in TaskArguments(dataset_name="embedded:gsm8k").load_split("test").column_names


# ------------------------------------------------------------------------------------ local dataset folders
def write_hub_gsm8k(folder, train: Dataset, test: Dataset, *, readme: bool = False) -> None:
    """A local copy of `openai/gsm8k` in the Hub's layout: `main/{split}-00000-of-00001.parquet`, plus a
    `socratic` config of other rows (as on the Hub) that a loader must not read for "main"."""
    for config, rows in (
        ("main", {"train": train, "test": test}),
        ("socratic", {"train": test, "test": train}),
    ):
        (folder / config).mkdir(parents=True)
        for split, ds in rows.items():
            ds.to_parquet(str(folder / config / f"{split}-00000-of-00001.parquet"))
    if readme:  # a `huggingface-cli download` snapshot also has the README that declares the configs
        configs = "".join(
            f"- config_name: {c}\n  data_files:\n"
            + "".join(f"  - split: {s}\n    path: {c}/{s}-*\n" for s in ("train", "test"))
            for c in ("main", "socratic")
        )
        (folder / "README.md").write_text(f"---\nconfigs:\n{configs}---\n# gsm8k\n")


def hub_gsm8k_rows(split: str, n: int) -> Dataset:
    """`n` rows shaped like the Hub's GSM8K (`question`, `answer` = worked solution ending in `#### N`)."""
    rows = make_synthetic_gsm8k(n, split=split)
    return Dataset.from_dict({"question": rows["question"], "answer": rows["solution"]})


@pytest.mark.parametrize("readme", [False, True])
def test_local_gsm8k_folder_in_the_hubs_layout_loads_as_the_hub_task(tmp_path, readme):
    from trl_dart_es.tasks.arguments import TaskArguments
    from trl_dart_es.tasks.gsm8k import PROMPT_STYLES

    train, test = hub_gsm8k_rows("train", 6), hub_gsm8k_rows("test", 3)
    folder = tmp_path / "gsm8k"
    write_hub_gsm8k(folder, train, test, readme=readme)
    for split, raw in (("train", train), ("test", test)):
        ds = load_task_dataset(str(folder), split)
        hub = to_trl_format(raw, split=split)  # what load_gsm8k makes of the Hub's rows
        assert ds["prompt"] == hub["prompt"] and ds["id"] == hub["id"] and ds["answer"] == hub["answer"]
        assert ds["answer"] == [extract_gsm8k_answer(a) for a in raw["answer"]]
    args = TaskArguments(  # as quickstart.yaml sets them; task_version (the generator's) does not apply
        dataset_name=str(folder),
        dataset_test_split="test",
        eval_num_examples=2,
        prompt_style="answer",
        task_version=2,
    )
    held_out = args.load_split("test")
    assert held_out["question"] == test["question"][:2]  # the first rows of the "main" test split
    assert held_out["prompt"][0][0]["content"] == PROMPT_STYLES["answer"]
    assert args.load_reward_funcs(held_out.column_names) == [gsm8k_accuracy_reward, gsm8k_format_reward]
    # TRL's dataset_config picks another subfolder.
    socratic = TaskArguments(dataset_name=str(folder), dataset_config="socratic").load_split("train")
    assert socratic["question"] == test["question"]


def test_math_style_folder_gets_a_boxed_prompt_and_trls_accuracy_reward(tmp_path):
    from trl.rewards import accuracy_reward, think_format_reward

    from trl_dart_es.tasks import MATH_SYSTEM_PROMPT
    from trl_dart_es.tasks.arguments import TaskArguments

    folder = tmp_path / "math"
    folder.mkdir()
    rows = {
        "problem": ["What is 1/2 + 1/4?", "Solve x + 1 = 3."],
        "solution": [r"$\boxed{\frac34}$", r"$x = \boxed{2}$"],
    }
    Dataset.from_dict(rows).to_json(str(folder / "train.jsonl"))
    ds = load_task_dataset(str(folder), "train")
    assert ds["id"] == ["math-train-00000", "math-train-00001"] and ds["solution"] == rows["solution"]
    assert ds["prompt"][1] == [
        {"role": "system", "content": MATH_SYSTEM_PROMPT},
        {"role": "user", "content": "Solve x + 1 = 3."},
    ]
    assert "\\boxed{}" in MATH_SYSTEM_PROMPT
    plain = load_task_dataset(str(folder), "train", conversational=False)["prompt"][0]
    assert plain.startswith(MATH_SYSTEM_PROMPT) and "What is 1/2 + 1/4?" in plain
    with pytest.raises(ValueError, match="prompt_style applies to GSM8K"):
        load_task_dataset(str(folder), "train", prompt_style="answer")
    # Unset: TRL's accuracy_reward; by name: TRL's rewards as its GRPO script names them.
    args = TaskArguments(dataset_name=str(folder))
    assert args.load_reward_funcs(ds.column_names) == [accuracy_reward]
    args.reward_funcs = ["accuracy_reward", "think_format_reward", "get_soft_overlong_punishment"]
    funcs = args.load_reward_funcs(ds.column_names, max_completion_length=40)
    assert funcs[:2] == [accuracy_reward, think_format_reward] and funcs[2].max_completion_len == 40
    # Columns that say nothing about the task are refused with the columns named.
    (tmp_path / "odd").mkdir()
    Dataset.from_dict({"text": ["hi"]}).to_json(str(tmp_path / "odd" / "train.jsonl"))
    with pytest.raises(ValueError, match=r"\['text'\]"):
        load_task_dataset(str(tmp_path / "odd"), "train")
