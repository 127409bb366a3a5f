"""TRL's own reward functions (`trl.rewards`) by name, built the way TRL's GRPO script builds them.

`DartESTrainer` calls every reward as `GRPOTrainer` does (`prompts`, `completions`, `completion_ids`, the dataset
columns, `trainer_state`, `log_extra`, `log_metric`), so TRL's functions need no adapter; this module only turns a
recipe's `reward_funcs` names into functions, sizing the length-based factories to the run.
"""

from __future__ import annotations

from collections.abc import Callable

# The names TRL's `trl/scripts/grpo.py` accepts, plus the two other factories of `trl.rewards`.
TRL_REWARD_NAMES: tuple[str, ...] = (
    "accuracy_reward",
    "reasoning_accuracy_reward",
    "think_format_reward",
    "get_soft_overlong_punishment",
    "get_repetition_penalty_reward",
    "get_cosine_scaled_reward",
)
# These verify answers with math_verify, which TRL imports only when installed (the `math` extra).
MATH_VERIFY_REWARDS = frozenset({"accuracy_reward", "reasoning_accuracy_reward", "get_cosine_scaled_reward"})
# TRL's GRPO script: get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256).
TRL_SCRIPT_MAX_COMPLETION_LEN, TRL_SCRIPT_SOFT_PUNISH_CACHE = 1280, 256


def trl_reward_func(name: str, *, max_completion_length: int | None = None) -> Callable:
    """The reward function of `trl.rewards` called `name` (one of `TRL_REWARD_NAMES`).

    Factories are called: `get_soft_overlong_punishment` punishes the last fifth of `max_completion_length`
    (TRL's script: 1280 tokens with a 256-token cache, used when `max_completion_length` is None; at ES's short
    completion budgets a 1280-token limit would never punish), `get_cosine_scaled_reward` scales over
    `max_completion_length` (1280 when None), `get_repetition_penalty_reward` takes TRL's defaults (3-grams,
    penalty down to -1). Math rewards raise an ImportError naming the extra when math_verify is missing, at
    start-up rather than in the first step.
    """
    if name not in TRL_REWARD_NAMES:
        raise ValueError(f"Unknown TRL reward {name!r}: expected one of {list(TRL_REWARD_NAMES)}.")
    from trl import rewards
    from trl.import_utils import is_math_verify_available

    if name in MATH_VERIFY_REWARDS and not is_math_verify_available():
        raise ImportError(
            f"TRL's {name} needs math-verify: pip install 'trl-dart-es[math]' (or 'math-verify>=0.5.2')."
        )
    if name == "get_soft_overlong_punishment":
        if max_completion_length is None:
            return rewards.get_soft_overlong_punishment(
                TRL_SCRIPT_MAX_COMPLETION_LEN, TRL_SCRIPT_SOFT_PUNISH_CACHE
            )
        return rewards.get_soft_overlong_punishment(max_completion_length, max(1, max_completion_length // 5))
    if name == "get_cosine_scaled_reward":
        return rewards.get_cosine_scaled_reward(max_completion_length or TRL_SCRIPT_MAX_COMPLETION_LEN)
    if name == "get_repetition_penalty_reward":
        return rewards.get_repetition_penalty_reward()
    return getattr(rewards, name)
