"""DART-ES fine-tuning on GSM8K, TRL style.

    python recipes/dart_es_gsm8k.py --config recipes/configs/quickstart.yaml
    accelerate launch recipes/dart_es_gsm8k.py --config recipes/configs/gsm8k_qwen.yaml
    accelerate launch --multi_gpu --num_processes 2 recipes/dart_es_gsm8k.py --config ...   # population split

Any field of ScriptArguments, DartESConfig or ModelConfig can be set in the YAML or on the command line.
"""

from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from trl_dart_es import DartESConfig, DartESTrainer
from trl_dart_es.rewards import gsm8k_accuracy_reward, gsm8k_format_reward
from trl_dart_es.tasks import load_task_dataset


def main(script_args: ScriptArguments, training_args: DartESConfig, model_args: ModelConfig) -> None:
    # Data: "openai/gsm8k" from the hub, or "embedded:gsm8k", the offline GSM8K-style generator.
    train_dataset = load_task_dataset(script_args.dataset_name, script_args.dataset_train_split)
    eval_dataset = load_task_dataset(script_args.dataset_name, script_args.dataset_test_split)

    # Model: a hub id, a local path, or "embedded:smollm2-135m" (offline).
    training_args.model_init_kwargs = {
        "dtype": model_args.dtype or "float32",
        **(training_args.model_init_kwargs or {}),
    }
    trainer = DartESTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=[gsm8k_accuracy_reward, gsm8k_format_reward],
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )

    # Held-out accuracy of the unperturbed model, before and after training.
    before = trainer.evaluate_dataset(eval_dataset)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    after = trainer.evaluate_dataset(eval_dataset)

    trainer.save_model(training_args.output_dir)
    if trainer.is_world_process_zero():
        width = max(map(len, before))
        print(f"\n{'held-out metric':<{width}} {'before':>8} {'after':>8}")
        for key in before:
            print(f"{key:<{width}} {before[key]:>8.3f} {after[key]:>8.3f}")
        print(f"\nModel saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)


if __name__ == "__main__":  # the guard lets vLLM's spawned workers import this file safely
    parser = TrlParser((ScriptArguments, DartESConfig, ModelConfig))
    main(*parser.parse_args_and_config())
