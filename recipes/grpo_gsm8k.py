"""GRPO baseline on GSM8K: TRL's `GRPOTrainer` with the same rewards, data, model and held-out evaluation as
recipes/dart_es_gsm8k.py, so that the two can be compared (see docs/benchmarks.md).

    python recipes/grpo_gsm8k.py --config recipes/configs/grpo_quickstart.yaml
    accelerate launch recipes/grpo_gsm8k.py --config recipes/configs/grpo_quickstart.yaml
    # DeepSpeed ZeRO-2 / ZeRO-3 (GPUs: deepspeed_zero{2,3}.yaml; 2 CPU processes: deepspeed_zero{2,3}_cpu.yaml)
    accelerate launch --config_file recipes/accelerate_configs/deepspeed_zero3_cpu.yaml recipes/grpo_gsm8k.py \
        --config recipes/configs/grpo_quickstart.yaml

Any field of TaskArguments (ScriptArguments plus the task options), GRPOConfig or ModelConfig can be set in
the YAML or on the command line; with `--use_peft true` this is GRPO+LoRA (recipes/grpo_lora_gsm8k.py sets it
for you).
"""

import os
import sys

from trl import GRPOConfig, GRPOTrainer, ModelConfig, TrlParser, get_peft_config
from trl.models.utils import unwrap_model_for_generation

from trl_dart_es.benchmark import evaluate_greedy
from trl_dart_es.embedded import resolve_model_path
from trl_dart_es.tasks.arguments import TaskArguments


def main(script_args: TaskArguments, training_args: GRPOConfig, model_args: ModelConfig) -> None:
    # Data: "openai/gsm8k" from the hub, or "embedded:gsm8k", the offline GSM8K-style generator (with the
    # DART-ES recipe's `prompt_style` and `eval_num_examples`).
    train_dataset = script_args.load_split(script_args.dataset_train_split)
    eval_dataset = script_args.load_split(script_args.dataset_test_split)
    # `reward_funcs` in the config (TRL's GRPO-script convention); unset, the task's correctness and format.
    reward_funcs = script_args.load_reward_funcs()

    # Model: a hub id, a local path, or "embedded:smollm2-135m" (converted once to a local folder).
    training_args.model_init_kwargs = {
        "dtype": model_args.dtype or "float32",
        **(training_args.model_init_kwargs or {}),
    }
    trainer = GRPOTrainer(
        model=resolve_model_path(model_args.model_name_or_path),
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        peft_config=get_peft_config(model_args),
    )

    # Held-out accuracy before and after, with the greedy generation code DART-ES evaluates with. Under ZeRO-3
    # the parameters are partitioned: TRL's context gathers them (on every process) for generation.
    def evaluate() -> dict[str, float]:
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
            return evaluate_greedy(
                model,
                trainer.processing_class,
                eval_dataset,
                reward_funcs,
                max_completion_length=training_args.max_completion_length,
                batch_size=training_args.per_device_eval_batch_size,
                reward_weights=training_args.reward_weights,
            )

    before = evaluate()
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    after = evaluate()

    trainer.save_model(training_args.output_dir)
    if trainer.is_world_process_zero():
        print(f"\n{'held-out metric':<32} {'before':>8} {'after':>8}")
        for key in before:
            print(f"{key:<32} {before[key]:>8.3f} {after[key]:>8.3f}")
        print(f"\nModel saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    # Destroy the process group before exit, as Accelerate advises. Under ZeRO-3 a rank still, rarely, aborts in
    # teardown (SIGABRT, "terminate called without an active exception") after its work is saved.
    trainer.accelerator.end_training()


def cpu_launch_args(argv: list[str]) -> list[str]:
    """`argv` plus `--use_cpu true` for a multi-process launch on a machine without a GPU.

    There, without `use_cpu`, Accelerate counts one process while torchrun (and DeepSpeed) started several, and
    a DeepSpeed run stops on `train_batch_size ... 4 != 4 * 1 * 2`. A `--use_cpu` given on the command line wins.
    """
    import torch

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched and not torch.cuda.is_available() and not any(a.startswith("--use_cpu") for a in argv):
        return [*argv, "--use_cpu", "true"]
    return argv


if __name__ == "__main__":
    parser = TrlParser((TaskArguments, GRPOConfig, ModelConfig))
    main(*parser.parse_args_and_config(cpu_launch_args(sys.argv[1:])))
