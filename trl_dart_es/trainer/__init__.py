from .dart_es_config import DartESConfig
from .dart_es_trainer import DartESTrainer

__all__ = ["DartESConfig", "DartESTrainer"]
