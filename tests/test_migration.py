"""A GRPO script with only the class names swapped runs."""

import textwrap

import pytest

GRPO_SCRIPT = textwrap.dedent(
    """
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.rewards import think_format_reward

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(c[0]["content"] if isinstance(c, list) else c)) for c in completions]

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Say {i}"}] for i in range(8)]})
    training_args = GRPOConfig(
        output_dir=OUTPUT_DIR,
        per_device_train_batch_size=4,
        max_completion_length=8,
        learning_rate=1e-3,
        logging_steps=1,
        max_steps=1,
        report_to="none",
        use_cpu=True,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=MODEL,
        reward_funcs=[reward_len, think_format_reward],
        args=training_args,
        train_dataset=dataset,
        processing_class=TOKENIZER,
    )
    trainer.train()
    """
)


def test_grpo_script_with_swapped_class_names_runs(tmp_path, tiny_lm, tokenizer):
    script = GRPO_SCRIPT.replace(
        "from trl import GRPOConfig, GRPOTrainer",
        "from trl_dart_es import DartESConfig as GRPOConfig, DartESTrainer as GRPOTrainer",
    )
    assert "trl_dart_es" in script
    scope = {"OUTPUT_DIR": str(tmp_path), "MODEL": tiny_lm, "TOKENIZER": tokenizer}
    exec(compile(script, "grpo_script.py", "exec"), scope)  # our own test script, not model output
    trainer = scope["trainer"]
    assert type(trainer).__name__ == "DartESTrainer"
    assert trainer.state.global_step == 1
    assert "rewards/reward_len/mean" in trainer.state.log_history[0]


def test_grpo_only_fields_are_named_in_the_error(tmp_path):
    from trl_dart_es import DartESConfig

    with pytest.raises(TypeError, match="beta"):
        DartESConfig(output_dir=str(tmp_path), beta=0.04)
