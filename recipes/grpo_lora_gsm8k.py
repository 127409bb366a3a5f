"""GRPO+LoRA baseline on GSM8K: TRL's `GRPOTrainer` training a LoRA adapter (base weights frozen), with the same
rewards, data, model and held-out evaluation as recipes/dart_es_gsm8k.py (see docs/benchmarks.md).

    python recipes/grpo_lora_gsm8k.py --config recipes/configs/grpo_lora_quickstart.yaml

LoRA is always on here (`use_peft`); `lora_r`, `lora_alpha`, `lora_target_modules` come from the config.
Everything else is recipes/grpo_gsm8k.py.
"""

import os
import sys

from trl import GRPOConfig, ModelConfig, TrlParser

from trl_dart_es.tasks.arguments import TaskArguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_gsm8k import cpu_launch_args  # noqa: E402
from grpo_gsm8k import main as grpo_main  # noqa: E402


def main(script_args: TaskArguments, training_args: GRPOConfig, model_args: ModelConfig) -> None:
    model_args.use_peft = True
    if model_args.lora_target_modules is None:  # every linear layer, the usual GRPO+LoRA set-up
        model_args.lora_target_modules = "all-linear"
    grpo_main(script_args, training_args, model_args)


if __name__ == "__main__":
    parser = TrlParser((TaskArguments, GRPOConfig, ModelConfig))
    main(*parser.parse_args_and_config(cpu_launch_args(sys.argv[1:])))
