"""DART-ES fine-tuning on GSM8K, TRL style.

    python recipes/dart_es_gsm8k.py --config recipes/configs/quickstart.yaml
    accelerate launch recipes/dart_es_gsm8k.py --config recipes/configs/gsm8k_qwen.yaml
    accelerate launch --multi_gpu --num_processes 2 recipes/dart_es_gsm8k.py --config ...   # population split
    python recipes/dart_es_gsm8k.py --config ... --dataset_name ./gsm8k   # a local copy in the Hub's layout
    python recipes/dart_es_gsm8k.py --config ... --dataset_name ./math --reward_funcs accuracy_reward  # MATH-style

Any field of TaskArguments (TRL's ScriptArguments plus the task options and `reward_funcs`:
trl_dart_es/tasks/arguments.py), DartESConfig or ModelConfig can be set in the YAML or on the command line.
"""

import os
import sys

from trl import ModelConfig, TrlParser, get_peft_config

from trl_dart_es import DartESConfig, DartESTrainer
from trl_dart_es.benchmark.stats import paired_t_interval
from trl_dart_es.tasks.arguments import TaskArguments
from trl_dart_es.trainer.baseline import evaluate_untrained
from trl_dart_es.training_curve import plot_training_curve


def report_where(trainer: DartESTrainer, curve: str) -> None:
    """Print where the run's logs and picture are, and how to open the trackers' dashboards on them."""
    args = trainer.args
    report_to = [args.report_to] if isinstance(args.report_to, str) else list(args.report_to or [])
    print(f"\nTraining curve (reward and fitness per step, held-out accuracy): {curve}")
    print(
        f"Every logged metric, per step: {os.path.join(args.output_dir, 'trainer_state.json')} (log_history)"
    )
    if args.log_completions:
        print(
            f"Completions, one parquet file per logged step: {os.path.join(args.output_dir, 'completions')}"
        )
    if "trackio" in report_to:
        trackio_utils = sys.modules.get("trackio.utils")
        store = str(trackio_utils.TRACKIO_DIR) if trackio_utils else os.environ.get("TRACKIO_DIR", "")
        print(f'Dashboard (trackio, local): TRACKIO_DIR={store} trackio show --project "{args.project}"')
    if "tensorboard" in report_to:
        print(f"Dashboard (TensorBoard): tensorboard --logdir {os.path.join(args.output_dir, 'runs')}")


def main(script_args: TaskArguments, training_args: DartESConfig, model_args: ModelConfig) -> None:
    # Data: "openai/gsm8k" from the hub, "embedded:gsm8k", the offline GSM8K-style generator, or a local folder
    # (GSM8K in the Hub's layout, MATH-style `problem`/`solution` rows, or rows with a `prompt`: docs/tasks.md).
    # `prompt_style` and `eval_num_examples` (TaskArguments) choose the offline task's prompt and held-out size.
    name = script_args.dataset_name
    train_dataset = script_args.load_split(script_args.dataset_train_split)
    eval_dataset = script_args.load_split(script_args.dataset_test_split)

    # Model: a hub id, a local path, or "embedded:smollm2-135m" (offline).
    training_args.model_init_kwargs = {
        "dtype": model_args.dtype or "float32",
        **(training_args.model_init_kwargs or {}),
    }
    # trackio's local store goes with the run's other outputs unless TRACKIO_DIR says otherwise; trackio reads it
    # when first imported, which the trainer's tracker callback does.
    if "trackio" in (training_args.report_to or []):
        os.environ.setdefault(
            "TRACKIO_DIR", os.path.join(os.path.abspath(training_args.output_dir), "trackio")
        )
    trainer = DartESTrainer(
        model=model_args.model_name_or_path,
        # `reward_funcs` in the config (ours, TRL's or import paths); unset: the task's correctness and format
        # rewards (for a local folder, chosen by its columns). TRL's length-based ones sized to this run.
        reward_funcs=script_args.load_reward_funcs(
            train_dataset.column_names, training_args.max_completion_length
        ),
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )

    # Held-out metrics of the unperturbed model, before (cached for the embedded model) and after training.
    # Row by row too (`solved`), for the gain's paired interval.
    resuming = training_args.resume_from_checkpoint
    if resuming:
        (before, solved_before), cached = trainer.evaluate_dataset(eval_dataset, return_solved=True), False
    else:
        before, solved_before, cached = evaluate_untrained(
            trainer, eval_dataset, model_args.model_name_or_path, return_solved=True
        )
    trainer.train(resume_from_checkpoint=resuming)
    after, solved_after = trainer.evaluate_dataset(eval_dataset, return_solved=True)

    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json: log_history, the metrics every tracker received
    if trainer.is_world_process_zero():
        curve = plot_training_curve(
            trainer.state.log_history,
            os.path.join(training_args.output_dir, "training_curve.png"),
            before=before["eval_accuracy"],
            after=after["eval_accuracy"],
            title=f"DART-ES on {name}",
        )
        width = max(map(len, before))
        print(
            f"\nHeld-out: {len(eval_dataset)} prompts of {name} ({script_args.dataset_test_split} split), greedy, "
            f"up to {training_args.max_completion_length} tokens"
            + (" ('before' from cache)" if cached else "")
        )
        print(f"{'held-out metric':<{width}} {'before':>8} {'after':>8}")
        for key in [k for k in before if k in after]:
            print(f"{key:<{width}} {before[key]:>8.3f} {after[key]:>8.3f}")
        # The same prompts before and after: a t-interval of the per-prompt differences (-1, 0 or +1).
        gain, low, high = (100 * x for x in paired_t_interval(solved_after.astype(float) - solved_before))
        print(
            f"\nAccuracy {100 * before['eval_accuracy']:.1f}% -> {100 * after['eval_accuracy']:.1f}%: "
            f"{gain:+.1f} points, 95% interval [{low:+.1f}, {high:+.1f}] paired over the {len(eval_dataset)} prompts"
            + (" (includes 0: not distinguishable from noise)" if low <= 0 <= high else "")
        )
        print(f"Model saved to {training_args.output_dir}")
        report_where(trainer, curve)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=name)
    # Destroy the process group before exit, as Accelerate advises. Under ZeRO-3 a rank still, rarely, aborts in
    # teardown (SIGABRT, "terminate called without an active exception") after its work is saved.
    trainer.accelerator.end_training()


if __name__ == "__main__":  # the guard lets vLLM's spawned workers import this file safely
    parser = TrlParser((TaskArguments, DartESConfig, ModelConfig))
    main(*parser.parse_args_and_config())
