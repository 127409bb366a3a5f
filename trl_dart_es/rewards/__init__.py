"""Reward functions with TRL's calling convention: `fn(completions, <dataset column>, **kwargs) -> list[float | None]`.

They work unchanged as `reward_funcs` of TRL's `GRPOTrainer` and of `DartESTrainer`, as TRL's own `trl.rewards` do
(`trl_reward_func` builds those by name).
"""

from .arithmetic import Evaluation, ExpressionRejected, evaluate_arithmetic, uses_numbers_exactly_once
from .countdown import countdown_accuracy_reward, countdown_format_reward, extract_countdown_expression
from .gsm8k import (
    completion_text,
    equation_results,
    extract_final_number,
    gsm8k_accuracy_reward,
    gsm8k_format_reward,
    gsm8k_step_reward,
    normalize_number,
)
from .trl_rewards import TRL_REWARD_NAMES, trl_reward_func

__all__ = [
    "TRL_REWARD_NAMES",
    "Evaluation",
    "ExpressionRejected",
    "completion_text",
    "countdown_accuracy_reward",
    "countdown_format_reward",
    "equation_results",
    "evaluate_arithmetic",
    "extract_countdown_expression",
    "extract_final_number",
    "gsm8k_accuracy_reward",
    "gsm8k_format_reward",
    "gsm8k_step_reward",
    "normalize_number",
    "trl_reward_func",
    "uses_numbers_exactly_once",
]
