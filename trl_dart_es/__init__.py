"""trl-dart-es: fine-tune language models with DART-ES evolution strategies, the TRL way."""

from .difficulty import DifficultyState
from .fitness import dart_fitness, shape_fitness, solved_matrix
from .noise import Member, gaussian, population
from .perturb import EvolvedParameters
from .replay import BatchPlanner, PlannedBatch
from .strategy import DartES, TellResult
from .trainer import DartESConfig, DartESTrainer

__version__ = "0.1.0"

__all__ = [
    "BatchPlanner",
    "DartES",
    "DartESConfig",
    "DartESTrainer",
    "DifficultyState",
    "EvolvedParameters",
    "Member",
    "PlannedBatch",
    "TellResult",
    "dart_fitness",
    "gaussian",
    "population",
    "shape_fitness",
    "solved_matrix",
]
