"""DartESTrainer on tiny models built from a config: interface, one ES step, errors, checkpoints, evaluation."""

import asyncio
import json
import os

import numpy as np
import pytest
import torch
from conftest import length_reward, parity_reward, tiny_es_config, toy_dataset
from datasets import Dataset

from trl_dart_es import DartESConfig, DartESTrainer

_dataset = toy_dataset


def _config(tmp_path, **kw):
    return tiny_es_config(tmp_path / "out", **kw)


def _trainer(tmp_path, tiny_lm, tokenizer, reward_funcs=None, dataset=None, eval_dataset=None, **kw):
    return DartESTrainer(
        model=tiny_lm,
        reward_funcs=reward_funcs or [parity_reward, length_reward],
        args=_config(tmp_path, **kw),
        train_dataset=dataset if dataset is not None else _dataset(),
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "field,value",
    [
        ("population_size", 1),
        ("sigma", 0.0),
        ("fitness_shaping", "softmax"),
        ("perturbation", "sparse"),
        ("replay_ratio", 1.0),
        ("gradient_accumulation_steps", 2),
        ("vllm_mode", "server"),
        ("noise_cache", "maybe"),
    ],
)
def test_config_rejects_bad_values_by_name(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        _config(tmp_path, **{field: value})


def test_config_antithetic_needs_even_population(tmp_path):
    with pytest.raises(ValueError, match="population_size"):
        _config(tmp_path, antithetic=True, population_size=5)


def test_config_defaults_follow_reference(tmp_path):
    args = DartESConfig(output_dir=str(tmp_path))
    assert (args.population_size, args.sigma, args.learning_rate) == (40, 1.5e-3, 2.5e-4)
    assert args.per_device_train_batch_size == 256
    assert (args.replay_ratio, args.difficulty_ema_decay, args.difficulty_weight_floor) == (0.2, 0.7, 0.8)
    assert (args.difficulty_weight_exponent, args.replay_pass_threshold) == (3.0, 0.5)
    assert (args.max_replays_per_epoch, args.replay_cooldown, args.zero_pass_patience) == (2, 1, 2)
    assert args.temperature == 0.0 and args.lr_scheduler_type == "constant"


# ----------------------------------------------------------------------------------------------- errors
def test_trainer_rejects_optimizers(tmp_path, tiny_lm, tokenizer):
    opt = torch.optim.SGD(tiny_lm.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optimizers"):
        DartESTrainer(
            tiny_lm,
            parity_reward,
            _config(tmp_path),
            _dataset(),
            processing_class=tokenizer,
            optimizers=(opt, None),
        )


def test_trainer_rejects_dataset_without_prompt(tmp_path, tiny_lm, tokenizer):
    ds = Dataset.from_dict({"question": ["a", "b", "c", "d"]})
    with pytest.raises(ValueError, match="prompt"):
        _trainer(tmp_path, tiny_lm, tokenizer, dataset=ds)


def test_trainer_rejects_duplicate_ids(tmp_path, tiny_lm, tokenizer):
    ds = _dataset().map(lambda row: {"id": "same"})
    with pytest.raises(ValueError, match="same"):
        _trainer(tmp_path, tiny_lm, tokenizer, dataset=ds)


def test_trainer_rejects_unsupported_grpo_arguments(tmp_path, tiny_lm, tokenizer):
    with pytest.raises(TypeError, match="tools"):
        DartESTrainer(
            tiny_lm, parity_reward, _config(tmp_path), _dataset(), processing_class=tokenizer, tools=[]
        )


def test_trainer_rejects_wrong_number_of_reward_weights(tmp_path, tiny_lm, tokenizer):
    with pytest.raises(ValueError, match="reward_weights"):
        _trainer(tmp_path, tiny_lm, tokenizer, reward_weights=[1.0])


# --------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("conversational", [True, False])
def test_one_step_moves_weights_and_logs_metrics(tmp_path, tiny_lm, tokenizer, conversational):
    trainer = _trainer(
        tmp_path, tiny_lm, tokenizer, dataset=_dataset(conversational=conversational), max_steps=1
    )
    before = _params(trainer.model)
    trainer.train()
    after = _params(trainer.model)
    assert not trainer.es_params.is_perturbed
    assert any(not torch.equal(before[n], after[n]) for n in before)
    logs = trainer.state.log_history[0]
    for key in [
        "loss",
        "reward",
        "reward_std",
        "rewards/parity_reward/mean",
        "rewards/length_reward/mean",
        "update_norm",
        "time/generation",
        "time/reward",
        "time/es",
        "tokens_per_s",
    ]:
        assert key in logs, key
    assert logs["update_norm"] > 0
    assert 0 < logs["time/perturb"] <= logs["time/es"]  # applying members is ES bookkeeping, not generation
    assert "grad_norm" not in logs  # ES has no gradients; Trainer's gradient norm would be a misleading 0


def test_rewards_get_grpo_keyword_arguments(tmp_path, tiny_lm, tokenizer):
    seen = {}

    def spy(prompts, completions, completion_ids, answer, id, trainer_state, log_extra, log_metric, **kwargs):
        seen.update(n=len(completions), answer=answer, id=id, step=trainer_state.global_step)
        log_metric("spy/calls", 1.0)
        return [0.0] * len(completions)

    trainer = _trainer(tmp_path, tiny_lm, tokenizer, reward_funcs=[parity_reward, spy], max_steps=1)
    trainer.train()
    assert seen["n"] == 4 * 4  # N members × B problems in one call
    assert len(seen["answer"]) == seen["n"] and len(seen["id"]) == seen["n"]
    assert "spy/calls" in trainer.state.log_history[0]


def test_none_rewards_become_nan_and_async_rewards_run(tmp_path, tiny_lm, tokenizer):
    async def async_reward(completions, **kwargs):
        await asyncio.sleep(0)
        return [1.0] * len(completions)

    def sometimes_none(completions, **kwargs):
        return [None if i % 2 else 0.5 for i in range(len(completions))]

    trainer = _trainer(
        tmp_path, tiny_lm, tokenizer, reward_funcs=[parity_reward, async_reward, sometimes_none], max_steps=1
    )
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["rewards/async_reward/mean"] == 1.0
    assert logs["rewards/sometimes_none/mean"] == 0.5  # NaN left out, not counted as 0


def test_trl_reward_functions_run_unchanged(tmp_path, tiny_lm, tokenizer):
    from trl.rewards import get_soft_overlong_punishment, think_format_reward

    overlong = get_soft_overlong_punishment(max_completion_len=6, soft_punish_cache=2)
    trainer = _trainer(
        tmp_path,
        tiny_lm,
        tokenizer,
        reward_funcs=[think_format_reward, overlong],
        max_steps=1,
        solved_threshold=1.0,
    )
    trainer.train()
    assert "rewards/think_format_reward/mean" in trainer.state.log_history[0]


def test_reward_error_restores_weights(tmp_path, tiny_lm, tokenizer):
    def broken(completions, **kwargs):
        raise RuntimeError("reward server down")

    trainer = _trainer(tmp_path, tiny_lm, tokenizer, reward_funcs=[broken])
    before = _params(trainer.model)
    with pytest.raises(RuntimeError, match="reward server down"):
        trainer.train()
    assert not trainer.es_params.is_perturbed
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_interrupt_during_generation_restores_weights(tmp_path, tiny_lm, tokenizer):
    trainer = _trainer(tmp_path, tiny_lm, tokenizer)
    before = _params(trainer.model)
    calls = {"n": 0}
    original = trainer.model.generate

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # mid-population: member 3 is applied
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    trainer.model.generate = interrupted
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert calls["n"] == 3 and not trainer.es_params.is_perturbed
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_plain_es_switches(tmp_path, tiny_lm, tokenizer):
    trainer = _trainer(
        tmp_path, tiny_lm, tokenizer, use_difficulty_reweighting=False, use_targeted_replay=False, max_steps=2
    )
    trainer.train()
    for logs in trainer.state.log_history[:2]:
        assert logs["dart/weight_mean"] == 1.0 and logs["dart/weight_max"] == 1.0
        assert logs["dart/num_replayed"] == 0


def test_peft_updates_only_adapter(tmp_path, tiny_lm, tokenizer):
    from peft import LoraConfig

    trainer = DartESTrainer(
        tiny_lm,
        parity_reward,
        _config(tmp_path, max_steps=1),
        _dataset(),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    before = _params(trainer.model)
    trainer.train()
    after = _params(trainer.model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all("lora_" in n for n in changed)


def test_same_seed_same_trajectory(tmp_path, tokenizer):
    from conftest import make_tiny_llama

    runs = []
    for i in range(2):
        model = make_tiny_llama(vocab_size=len(tokenizer), hidden=16, layers=1)
        trainer = DartESTrainer(
            model,
            [parity_reward, length_reward],
            _config(tmp_path / str(i), max_steps=2),
            _dataset(),
            processing_class=tokenizer,
        )
        trainer.train()
        runs.append((_params(trainer.model), trainer.strategy.state_dict()))
    for n in runs[0][0]:
        assert torch.equal(runs[0][0][n], runs[1][0][n])
    assert json.dumps(runs[0][1], sort_keys=True) == json.dumps(runs[1][1], sort_keys=True)


# -------------------------------------------------------------------------------- checkpoint and resume
@pytest.mark.parametrize("momentum", [0.0, 0.8])
def test_resume_is_bitwise_equal_to_uninterrupted_run(tmp_path, tokenizer, momentum):
    """With `momentum` the checkpoint also carries the running update, which the resumed steps need."""
    from conftest import make_tiny_llama

    def run(out, max_steps, resume=None):
        model = make_tiny_llama(vocab_size=len(tokenizer), hidden=16, layers=1)
        args = _config(
            tmp_path / out,
            max_steps=max_steps,
            save_strategy="steps",
            save_steps=2,
            per_device_train_batch_size=3,
            momentum=momentum,
        )
        trainer = DartESTrainer(
            model, [parity_reward, length_reward], args, _dataset(), processing_class=tokenizer
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run("a", 4)
    run("b", 2)  # "interrupted" after a checkpoint at step 2
    ckpt = tmp_path / "b" / "out" / "checkpoint-2"
    assert (ckpt / "dart_es_state.json").exists() and (ckpt / "model.safetensors").exists()
    assert (ckpt / "dart_es_velocity.safetensors").exists() == bool(momentum)
    resumed = run("b", 4, resume=str(ckpt))
    assert resumed.state.global_step == 4
    a, b = _params(straight.model), _params(resumed.model)
    for n in a:
        assert torch.equal(a[n], b[n]), n
    assert json.dumps(straight.strategy.state_dict(), sort_keys=True) == json.dumps(
        resumed.strategy.state_dict(), sort_keys=True
    )


def test_resume_from_foreign_checkpoint_is_a_clear_error(tmp_path, tiny_lm, tokenizer):
    trainer = _trainer(tmp_path, tiny_lm, tokenizer, max_steps=1, save_strategy="steps", save_steps=1)
    trainer.train()
    ckpt = tmp_path / "out" / "checkpoint-1"
    os.remove(ckpt / "dart_es_state.json")
    trainer2 = _trainer(tmp_path, tiny_lm, tokenizer, max_steps=2)
    with pytest.raises(FileNotFoundError, match="dart_es_state.json"):
        trainer2.train(resume_from_checkpoint=str(ckpt))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_best_model_at_end_puts_the_best_checkpoint_in_the_model_and_the_es_state(
    tmp_path, tokenizer, dtype
):
    """Trainer's `load_best_model_at_end` on the default metric (eval reward): the model ends with the best
    checkpoint's weights, and so do the ES base and fp32 master, so a later perturb/restore comes back to them."""
    from conftest import make_tiny_llama
    from safetensors.torch import load_file

    from trl_dart_es.noise import Member

    model = make_tiny_llama(vocab_size=len(tokenizer), hidden=16, layers=1, dtype=dtype)
    trainer = _trainer(
        tmp_path, model, tokenizer, eval_dataset=_dataset(6), max_steps=4, eval_strategy="steps", eval_steps=1,
        save_strategy="steps", save_steps=1, load_best_model_at_end=True, per_device_eval_batch_size=6,
    )  # fmt: skip
    assert trainer.args.metric_for_best_model == "reward" and trainer.args.greater_is_better
    trainer.train()
    rewards = {log["step"]: log["eval_reward"] for log in trainer.state.log_history if "eval_reward" in log}
    best_step = max(rewards, key=rewards.get)  # the first best, as Trainer keeps it
    assert best_step != 4, "the test needs a best checkpoint other than the last"
    best = tmp_path / "out" / f"checkpoint-{best_step}"
    assert trainer.state.best_model_checkpoint == str(best)
    saved = load_file(best / "model.safetensors")
    expected = {n: saved[n] for n, _ in model.named_parameters() if n in saved}
    assert expected and all(
        torch.equal(p.detach(), expected[n]) for n, p in model.named_parameters() if n in saved
    )
    master = trainer.es_params.master_state_dict()
    if dtype == torch.float32:
        assert master == {}
    else:  # the fp32 master is the best checkpoint's, not the last step's
        saved_master = load_file(best / "dart_es_master.safetensors")
        assert master.keys() == saved_master.keys()
        assert all(torch.equal(master[n], saved_master[n]) for n in master)
    before = _params(model)
    trainer.es_params.perturb(Member(seed=123, sign=1))
    trainer.es_params.restore()
    assert all(torch.equal(before[n], p) for n, p in _params(model).items())
    assert trainer.evaluate(_dataset(6))["eval_reward"] == pytest.approx(rewards[best_step])


# ------------------------------------------------------------------------------------------- evaluation
def test_evaluation_runs_on_schedule_with_unperturbed_model(tmp_path, tiny_lm, tokenizer):
    trainer = _trainer(
        tmp_path, tiny_lm, tokenizer, eval_dataset=_dataset(5), max_steps=2, eval_strategy="steps", eval_steps=1,
        per_device_eval_batch_size=3,
    )  # fmt: skip
    trainer.train()
    evals = [log for log in trainer.state.log_history if "eval_accuracy" in log]
    assert [log["step"] for log in evals] == [1, 2]
    for log in evals:
        assert 0.0 <= log["eval_accuracy"] <= 1.0
        assert "eval_rewards/parity_reward/mean" in log and "eval_reward" in log
    # The reported accuracy is the unperturbed model's: recompute it by hand.
    gen = trainer.rollout.generate(_dataset(5)["prompt"])
    expected = np.mean([float(ids[0] % 2 == 0) for ids in gen.token_ids])
    assert evals[-1]["eval_accuracy"] == pytest.approx(expected)


# ------------------------------------------------------------------------------------ saving and cards
def test_save_model_writes_card_and_reloads(tmp_path, tiny_lm, tokenizer):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(tmp_path, tiny_lm, tokenizer, max_steps=1)
    trainer.train()
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    card = (tmp_path / "out" / "README.md").read_text()
    for needle in ["dart-es", "evolution-strategies", "trl", "population_size", "2610.06993", "2509.24372"]:
        assert needle in card, needle
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    for (n, p), (_, q) in zip(trainer.model.named_parameters(), reloaded.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_evaluation_reports_clipped_ratio_and_accuracy_per_level_and_wording(tmp_path, tiny_lm, tokenizer):
    from trl_dart_es.rollout.base import Generation

    eos = tokenizer.eos_token_id
    gen = Generation(texts=["", "", "", ""], token_ids=[[5, 6, 7], [5, eos], [5, 6, eos], []])
    assert gen.num_clipped(3, [eos]) == 1  # only the row that reached 3 tokens without EOS

    rows = _dataset(6).add_column("level", [1, 2, 1, 2, 1, 3])
    rows = rows.add_column("wording", ["seen", "held_out", "seen", "seen", "held_out", "seen"])
    trainer = _trainer(tmp_path, tiny_lm, tokenizer, per_device_eval_batch_size=4)
    metrics = trainer.evaluate_dataset(rows)
    out = trainer.rollout.generate(rows["prompt"])
    solved = np.asarray([float(ids[0] % 2 == 0) for ids in out.token_ids])
    clipped = out.num_clipped(trainer.args.max_completion_length, trainer.eos_token_ids)
    assert metrics["eval_completions/clipped_ratio"] == pytest.approx(clipped / 6)
    levels = np.asarray(rows["level"])
    for level in (1, 2, 3):
        assert metrics[f"eval_accuracy/level{level}"] == pytest.approx(solved[levels == level].mean())
    wording = np.asarray(rows["wording"])
    for value in ("seen", "held_out"):
        assert metrics[f"eval_accuracy/wording_{value}"] == pytest.approx(solved[wording == value].mean())
    assert "eval_accuracy/level1" not in trainer.evaluate_dataset(_dataset(3))  # no level column, no split
    # Row by row, for a paired comparison of two evaluations.
    again, flags = trainer.evaluate_dataset(rows, return_solved=True)
    assert again == metrics and flags.dtype == bool and flags.tolist() == (solved == 1).tolist()


def test_rows_gathered_rank_by_rank_go_back_to_dataset_order():
    from trl_dart_es.trainer.dart_es_trainer import strided_to_dataset_order

    rows = np.arange(7)
    for world in (1, 2, 3):
        gathered = np.concatenate([rows[r::world] for r in range(world)])  # what evaluate_dataset gathers
        assert strided_to_dataset_order(gathered, world).tolist() == rows.tolist()


def test_learning_rate_schedule_reaches_the_es_update(tmp_path, tiny_lm, tokenizer):
    trainer = _trainer(
        tmp_path, tiny_lm, tokenizer, max_steps=3, learning_rate=0.3, lr_scheduler_type="linear"
    )
    used, update = [], trainer.es_params.update

    def spy(members, z, lr):
        used.append(lr)
        return update(members, z, lr)

    trainer.es_params.update = spy
    trainer.train()
    # Linear decay to 0 over max_steps: step k uses α (1 - k / 3).
    assert used == pytest.approx([0.3, 0.2, 0.1])


def test_generation_dtype_with_peft_on_transformers_is_a_clear_error(tmp_path, tiny_lm, tokenizer):
    from peft import LoraConfig

    with pytest.raises(NotImplementedError, match="generation_dtype with a PEFT model"):
        DartESTrainer(
            tiny_lm,
            parity_reward,
            _config(tmp_path, max_steps=1, generation_dtype="bfloat16"),
            _dataset(),
            processing_class=tokenizer,
            peft_config=LoraConfig(r=2, target_modules=["q_proj", "v_proj"]),
        )
