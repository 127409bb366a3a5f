"""TRL's own reward functions (`trl.rewards`) as `reward_funcs` of DartESTrainer, as a GRPO user passes them."""

import math

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama, tiny_es_config
from datasets import Dataset

from trl_dart_es import DartESTrainer
from trl_dart_es.rewards import TRL_REWARD_NAMES, trl_reward_func
from trl_dart_es.rollout.prompts import as_completions
from trl_dart_es.scoring import RewardScorer

# The four TRL rewards each get one training step (the `math` extra brings accuracy_reward's math_verify).
STEP_REWARDS = [
    "accuracy_reward",
    "think_format_reward",
    "get_soft_overlong_punishment",
    "get_repetition_penalty_reward",
]


def math_dataset() -> Dataset:
    """MATH-style rows: conversational prompts and a `solution` column with a `\\boxed{}` answer. The last gold
    solution has no answer math_verify can parse, so accuracy_reward skips it (None), as GRPO does."""
    problems = ["What is 2 + 3?", "What is half of 1?", "What is 7 * 6?", "Name a colour."]
    solutions = [r"2 + 3 = \boxed{5}", r"Half of 1 is $\boxed{\frac{1}{2}}$.", r"$\boxed{42}$", "Blue, say."]
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": p}] for p in problems],
            "solution": solutions,
            "id": [f"math-{i}" for i in range(len(problems))],
        }
    )


def test_trl_rewards_score_through_the_trainers_reward_call():
    """The trainer's reward call (RewardScorer, with the kwargs the trainer adds) gives TRL's functions what they
    read: `solution` for accuracy, message completions for the format, `completion_ids` for the length and
    repetition penalties; a None (unparseable gold) becomes NaN."""
    funcs = [trl_reward_func(n, max_completion_length=8) for n in STEP_REWARDS]
    scorer = RewardScorer(funcs)
    assert scorer.names == [
        "accuracy_reward",
        "think_format_reward",
        "soft_overlong_punishment_reward",
        "repetition_penalty_reward",
    ]
    prompts = [[{"role": "user", "content": "What is half of 1?"}]] * 3
    texts = [r"<think>halve it</think> \boxed{\frac{1}{2}}", r"\boxed{0.7}", "No idea."]
    # Token ids chosen apart from the texts: the length and repetition rewards must read these.
    ids = [[1, 2, 3], [5] * 8, [4, 4, 4, 4, 9, 9]]
    logged: dict[str, list] = {}
    rewards = scorer(
        prompts,
        as_completions(prompts, texts),
        ids,
        {"prompt": prompts, "solution": [r"\boxed{\frac{1}{2}}", r"\boxed{\frac{1}{2}}", "no answer"]},
        trainer_state=None,
        log_extra=lambda column, values: logged.setdefault(column, values),
        log_metric=lambda name, value: None,
    )
    accuracy, think, overlong, repetition = rewards
    assert accuracy[:2].tolist() == [1.0, 0.0] and math.isnan(accuracy[2])  # 0.5 is not 0.7; gold unparseable
    assert think.tolist() == [1.0, 0.0, 0.0]
    # Sized to max_completion_length=8 with the last fifth (1 token) punished: 3 tokens free, 8 tokens at the
    # limit -1, 6 tokens free.
    assert overlong.tolist() == [0.0, -1.0, 0.0]
    # 3-grams: all distinct; 6 copies of one; 3 distinct of 4 (4,4,4 twice).
    assert repetition.tolist() == [0.0, -(1 - 1 / 6), -(1 - 3 / 4)]
    assert logged["solution"][2] == "no answer"  # log_extra reached accuracy_reward and is callable


@pytest.fixture
def few_token_lm(tokenizer):
    """A tiny Llama that mostly writes EOS or one of three tokens: its completions vary in length and repeat
    n-grams, so the length and repetition rewards differ between completions (a plain random one always writes
    6 distinct tokens)."""
    model = make_tiny_llama(vocab_size=len(tokenizer), hidden=16, layers=1)
    for cfg in (model.config, model.generation_config):
        cfg.pad_token_id, cfg.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    with torch.no_grad():
        head = model.lm_head.weight
        keep = [tokenizer.eos_token_id, 100, 200, 300]
        rows = 5 * torch.randn(len(keep), head.shape[1], generator=torch.Generator().manual_seed(0))
        head.zero_()
        head[keep] = rows
    return model


@pytest.mark.parametrize("name", STEP_REWARDS)
def test_trl_reward_trains_one_step(name, tmp_path, few_token_lm, tokenizer):
    """One ES step with a TRL reward alone: the rewards the trainer hands the strategy and logs are what the TRL
    function gives on the step's own completions and token ids."""
    reward = trl_reward_func(name, max_completion_length=6)
    trainer = DartESTrainer(
        model=few_token_lm,
        reward_funcs=[reward],
        args=tiny_es_config(tmp_path / "out", max_steps=1),
        train_dataset=math_dataset(),
        processing_class=tokenizer,
    )
    scored = []
    score = trainer._score

    def spy(columns, gens, member_columns=None):
        out = score(columns, gens, member_columns)
        scored.append((columns, gens, out))
        return out

    trainer._score = spy
    trainer.train()

    assert len(scored) == 1  # one step, one reward call for all members
    columns, gens, out = scored[0]
    assert out.shape == (1, 4, 4)  # rewards × members × problems
    for member, gen in enumerate(gens):
        expected = reward(
            prompts=columns["prompt"],
            completions=as_completions(columns["prompt"], gen.texts),
            completion_ids=gen.token_ids,
            solution=columns["solution"],
        )
        expected = [np.nan if v is None else v for v in expected]
        np.testing.assert_array_equal(out[0, member], expected)
    if name in ("get_soft_overlong_punishment", "get_repetition_penalty_reward"):
        assert np.std(out) > 0  # the rewards tell completions apart, so a mix-up of their token ids shows
    if name == "accuracy_reward":  # the unparseable gold is skipped for every member, not scored 0
        skipped = columns["solution"].index("Blue, say.")
        assert np.isnan(out[0, :, skipped]).all() and np.isfinite(np.delete(out[0], skipped, axis=1)).all()
    logs = trainer.state.log_history[0]
    logged = logs[f"rewards/{trainer.reward_func_names[0]}/mean"]
    assert math.isfinite(logged) and logged == pytest.approx(np.nanmean(np.nanmean(out[0], axis=1)))


def test_trl_reward_names_and_the_math_extra(monkeypatch):
    from trl import rewards

    assert trl_reward_func("accuracy_reward") is rewards.accuracy_reward
    assert trl_reward_func("think_format_reward") is rewards.think_format_reward
    # TRL's script sizes: 1280 tokens, the last 256 punished; sized to the run when max_completion_length is set.
    default = trl_reward_func("get_soft_overlong_punishment")
    assert (default.max_completion_len, default.soft_punish_cache) == (1280, 256)
    sized = trl_reward_func("get_soft_overlong_punishment", max_completion_length=64)
    assert (sized.max_completion_len, sized.soft_punish_cache) == (64, 12)
    assert trl_reward_func("get_cosine_scaled_reward", max_completion_length=64).max_len == 64
    for name in TRL_REWARD_NAMES:
        assert callable(trl_reward_func(name))
    with pytest.raises(ValueError, match="'accuracy'"):
        trl_reward_func("accuracy")
    # Without math_verify the math rewards fail at start-up, naming the extra (not mid-training, as TRL's would).
    import importlib

    import_utils = importlib.import_module("trl.import_utils")  # `trl` is a lazy module: no attribute access
    monkeypatch.setattr(import_utils, "is_math_verify_available", lambda: False)
    with pytest.raises(ImportError, match=r"trl-dart-es\[math\]"):
        trl_reward_func("accuracy_reward")
    assert trl_reward_func("think_format_reward") is rewards.think_format_reward


def test_math_verify_works_offline():
    """The `math` extra is installed and needs no network (HF_HUB_OFFLINE is set by conftest)."""
    import importlib.metadata

    from trl.rewards import accuracy_reward

    assert importlib.metadata.version("math-verify")
    completions = [[{"role": "assistant", "content": r"\boxed{\frac{6}{4}}"}]]
    assert accuracy_reward(completions, [r"$\boxed{1.5}$"]) == [1.0]
