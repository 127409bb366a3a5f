"""trl-dart-es: fine-tune language models with DART-ES evolution strategies, the TRL way."""

from .difficulty import DifficultyState
from .embedded import EMBEDDED_MODELS, is_embedded, load_model, load_tokenizer, resolve_model_path
from .fitness import dart_fitness, shape_fitness, solved_matrix
from .lowrank import LowRankParameters
from .noise import Member, gaussian, population
from .perturb import EvolvedParameters
from .replay import BatchPlanner, PlannedBatch
from .rewards import (
    countdown_accuracy_reward,
    countdown_format_reward,
    extract_final_number,
    gsm8k_accuracy_reward,
    gsm8k_format_reward,
)
from .strategy import DartES, TellResult
from .tasks import get_task, load_task_dataset, make_countdown, make_synthetic_gsm8k
from .trainer import DartESConfig, DartESTrainer

__version__ = "0.1.0"

__all__ = [
    "EMBEDDED_MODELS",
    "countdown_accuracy_reward",
    "countdown_format_reward",
    "extract_final_number",
    "get_task",
    "gsm8k_accuracy_reward",
    "gsm8k_format_reward",
    "is_embedded",
    "load_model",
    "load_task_dataset",
    "load_tokenizer",
    "make_countdown",
    "make_synthetic_gsm8k",
    "resolve_model_path",
    "BatchPlanner",
    "DartES",
    "DartESConfig",
    "DartESTrainer",
    "DifficultyState",
    "EvolvedParameters",
    "LowRankParameters",
    "Member",
    "PlannedBatch",
    "TellResult",
    "dart_fitness",
    "gaussian",
    "population",
    "shape_fitness",
    "solved_matrix",
]
