"""TRL's own GRPOTrainer takes this package's rewards and task datasets unchanged (one real training step)."""

import pytest
from conftest import make_tiny_llama

from trl_dart_es.rewards import (
    countdown_accuracy_reward,
    countdown_format_reward,
    gsm8k_accuracy_reward,
    gsm8k_format_reward,
)
from trl_dart_es.tasks import load_task_dataset

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer():
    """A byte-level tokenizer with no merges (259 tokens) and a ChatML template; ids 1 and 2 match the tiny
    Llama's bos and eos/pad ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials[:2]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def run_one_grpo_step(tmp_path, dataset, reward_funcs):
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = make_tiny_tokenizer()
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1
    model = make_tiny_llama(vocab_size=len(tokenizer))
    config = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        learning_rate=1e-2,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        reward_weights=[1.0, 0.1],
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=list(reward_funcs),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    for fn in reward_funcs:
        value = logs[f"rewards/{fn.__name__}/mean"]  # TRL called our function and logged its rewards
        assert 0.0 <= value <= 1.0
    assert trainer.state.global_step == 1


# ~4-7 s on 2 shared cores; the conversational case stays in the default suite as the standing proof of
# TRL compatibility.
@pytest.mark.parametrize("conversational", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_grpo_trainer_accepts_gsm8k_task_and_rewards(tmp_path, conversational):
    dataset = load_task_dataset("embedded:gsm8k", "train", num_examples=8, conversational=conversational)
    run_one_grpo_step(tmp_path, dataset, [gsm8k_accuracy_reward, gsm8k_format_reward])


@pytest.mark.slow
def test_grpo_trainer_accepts_countdown_task_and_rewards(tmp_path):
    dataset = load_task_dataset("embedded:countdown", "train", num_examples=8)
    run_one_grpo_step(tmp_path, dataset, [countdown_accuracy_reward, countdown_format_reward])
