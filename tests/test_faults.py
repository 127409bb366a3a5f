"""Faults leave nothing behind, on every backend (transformers full and low rank, vLLM full and low rank).

A fault is injected into a real run: Ctrl-C (KeyboardInterrupt) in the middle of the population's generation, a
reward function that raises, an update that fails part-way, Ctrl-C during the update. After it, the engine holds
no request or adapter of the interrupted call, and a retry ends bitwise where a clean run ends. Also: the weight
sync sees changes that keep a tensor's sum, outputs are checked row by row, stop strings work on the low-rank
transformers rollout, vLLM runs resume bitwise, and a resume under changed trajectory settings is refused.
Engine tests use a tiny model (one engine per setting, ~10 s to start) and skip without vLLM.
"""

import json
import os
import signal
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from conftest import backend_params as _backend_params
from conftest import backend_trainer as _trainer
from conftest import (
    make_tiny_llama,
    requires_vllm,
    token_length_reward,
    token_parity_reward,
    toy_dataset,
    vllm_tiny_llama,
)

from trl_dart_es.rollout import vllm as vllm_rollout
from trl_dart_es.rollout.base import Generation, check_population
from trl_dart_es.rollout.vllm import WeightSignal, check_outputs
from trl_dart_es.trainer.transaction import StepSnapshot, check_resume_settings


def _weights(trainer):
    return {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}


def _assert_same_run(a, b):
    wa, wb = _weights(a), _weights(b)
    assert any(not torch.equal(wa[n], p) for n, p in _tiny_model_like(a).items()), "no update: proves nothing"
    for name, tensor in wa.items():
        assert torch.equal(tensor, wb[name]), name
    sa, sb = a.strategy.state_dict(), b.strategy.state_dict()
    assert json.dumps(sa, sort_keys=True) == json.dumps(sb, sort_keys=True)


def _tiny_model_like(trainer):
    return dict(vllm_tiny_llama(trainer.processing_class).named_parameters())


@contextmanager
def _fail_once(target, attr: str, exc: BaseException, at_call: int = 2):
    """Make ``target.attr`` raise ``exc`` on its ``at_call``-th call (once); every other call goes through."""
    original = getattr(target, attr)
    own = attr in vars(target)  # set on the instance before us (else a class attribute)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at_call:
            raise exc
        return original(*args, **kwargs)

    setattr(target, attr, wrapper)
    try:
        yield calls
    finally:
        if own:
            setattr(target, attr, original)
        else:
            delattr(target, attr)


def _generation_target(trainer):
    """Where a Ctrl-C lands mid-generation: a vLLM engine step, or a forward pass of `generate`."""
    if trainer.args.use_vllm:
        return trainer.rollout.engine.llm.llm_engine, "step"
    return trainer.model, "forward"


def _engine_is_clean(trainer):
    if not trainer.args.use_vllm:
        return
    engine = trainer.rollout.engine.llm.llm_engine
    assert engine.get_num_unfinished_requests() == 0
    if trainer.args.perturbation == "lowrank":  # an engine with LoRA slots: no member adapter left behind
        assert not engine.list_loras()


@pytest.fixture(scope="module")
def clean_runs(tmp_path_factory, embedded_tokenizer_dir):
    """One clean 1-step run per backend, built on demand."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_tokenizer_dir, padding_side="left")
    cache = {}

    def get(backend):
        if backend not in cache:
            trainer = _trainer(backend, tokenizer, tmp_path_factory.mktemp(f"clean-{backend}"))
            trainer.train()
            cache[backend] = trainer
        return cache[backend]

    yield get
    vllm_rollout.shutdown_engine()


# --------------------------------------------------------------------------- faults in a real step
@pytest.mark.parametrize("backend", _backend_params())
def test_ctrl_c_in_generate_and_a_reward_error_leave_nothing_and_a_retry_equals_a_clean_step(
    backend, tokenizer, tmp_path, clean_runs
):
    calls = {"n": 0}

    def flaky_parity(completion_ids, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("reward server unreachable")
        return token_parity_reward(completion_ids)

    trainer = _trainer(backend, tokenizer, tmp_path, reward_funcs=[flaky_parity, token_length_reward])
    target, attr = _generation_target(trainer)
    before = (json.dumps(trainer.strategy.state_dict(), sort_keys=True), _weights(trainer))

    def assert_as_before():
        _engine_is_clean(trainer)
        assert json.dumps(trainer.strategy.state_dict(), sort_keys=True) == before[0]
        assert not trainer.es_params.is_perturbed
        for name, tensor in _weights(trainer).items():
            assert torch.equal(tensor, before[1][name]), name  # restored bitwise, no update applied

    with _fail_once(target, attr, KeyboardInterrupt()) as generate_calls:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
    assert generate_calls["n"] >= 2, "the interrupt never fired"
    assert calls["n"] == 0  # interrupted before any reward
    assert_as_before()
    with pytest.raises(ValueError, match="unreachable"):
        trainer.train()
    assert_as_before()
    trainer.train()  # the retry: same process, same trainer
    _assert_same_run(trainer, clean_runs(backend))


def test_an_update_that_fails_part_way_stops_the_trainer_until_it_resumes(tokenizer, tmp_path):
    trainer = _trainer("transformers", tokenizer, tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    with _fail_once(trainer.es_params, "update", MemoryError("out of memory"), at_call=2):
        with pytest.raises(RuntimeError, match="update failed part-way.*resume_from_checkpoint"):
            trainer.train()
    with pytest.raises(RuntimeError, match="update failed part-way"):
        trainer.train()  # refuses to step on weights that may be half-updated
    trainer.train(resume_from_checkpoint=True)  # from checkpoint-1: consistent weights and state again
    assert trainer.state.global_step == 2 and trainer.strategy.step == 2


def test_ctrl_c_during_the_update_completes_the_step_and_stops_training(tokenizer, tmp_path, clean_runs):
    trainer = _trainer("transformers", tokenizer, tmp_path, max_steps=3)
    update = trainer.es_params.update

    def update_then_ctrl_c(*args, **kwargs):
        norm = update(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)  # arrives while the update still holds Ctrl-C back
        return norm

    trainer.es_params.update = update_then_ctrl_c
    handler = signal.getsignal(signal.SIGINT)
    trainer.train()  # no KeyboardInterrupt: the step completed and training stopped at its boundary
    assert trainer.state.global_step == 1 and trainer.strategy.step == 1
    assert signal.getsignal(signal.SIGINT) is handler  # the usual Ctrl-C is back
    _assert_same_run(trainer, clean_runs("transformers"))


def test_step_snapshot_restores_strategy_rngs_and_metrics():
    from trl_dart_es.strategy import DartES

    strategy = DartES([str(i) for i in range(8)], population_size=4, batch_size=4)
    metrics = {"reward": [0.5]}
    snapshot = StepSnapshot.take(strategy, metrics)
    saved = json.dumps(strategy.state_dict(), sort_keys=True)
    expected = (torch.rand(3), np.random.rand(3))
    batch, _ = strategy.ask()
    strategy.tell(batch, np.random.default_rng(0).random((1, 4, 4)))
    metrics["reward"].append(1.0)
    metrics["new"] = [1.0]
    snapshot.restore(strategy, metrics)
    assert json.dumps(strategy.state_dict(), sort_keys=True) == saved and strategy.step == 0
    assert metrics == {"reward": [0.5]}
    again = (torch.rand(3), np.random.rand(3))
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])


# ----------------------------------------------------------------------- checks on what came back
def test_population_results_must_have_one_row_per_member_and_prompt():
    ok = Generation(texts=["a", "b"], token_ids=[[1], [2]])
    check_population([ok, ok], 2, 2)
    with pytest.raises(RuntimeError, match="1 generations for 2 members"):
        check_population([ok], 2, 2)
    with pytest.raises(RuntimeError, match="member 1, expected 3"):
        check_population([Generation(["a"] * 3, [[1]] * 3), ok], 2, 3)


def test_vllm_outputs_are_checked_against_their_rows():
    class Out:
        def __init__(self, prompt, lora=None):
            self.prompt_token_ids, self.finished, self.outputs = prompt, True, [object()]
            self.lora_request = None if lora is None else type("L", (), {"lora_int_id": lora})()

    rows = [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    check_outputs(rows, [Out([1, 2]), Out([3])])
    with pytest.raises(RuntimeError, match="3 outputs for 2 prompts"):
        check_outputs(rows, [Out([9]), Out([1, 2]), Out([3])])
    with pytest.raises(RuntimeError, match="output 0 belongs to another prompt"):
        check_outputs(rows, [Out([3]), Out([1, 2])])
    loras = [type("L", (), {"lora_int_id": i})() for i in (5, 6)]
    check_outputs(rows, [Out([1, 2], 5), Out([3], 6)], loras)
    with pytest.raises(RuntimeError, match="adapter 5, row 1 asked for 6"):
        check_outputs(rows, [Out([1, 2], 5), Out([3], 5)], loras)


# ------------------------------------------------------------------------------- the weight sync
def test_weight_signal_sees_changes_that_keep_the_sum():
    model = make_tiny_llama()
    name, weight = "model.layers.0.mlp.down_proj.weight", model.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        weight[0, :2] = 0.75  # mid-binade: its ulp is the same up and down, so +1 and -1 ulp cancel
    held = WeightSignal.of(model)
    assert held.changed_since(held) == set()
    total = weight.detach().sum(dtype=torch.float64)
    with torch.no_grad():
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))
        weight[0, 1] = torch.nextafter(weight[0, 1], torch.tensor(0.0))
    assert weight.detach().sum(dtype=torch.float64) == total  # a checksum would miss it
    after_ulps = WeightSignal.of(model)
    assert after_ulps.changed_since(held) == {name}
    permuted = weight.detach()[torch.randperm(weight.shape[0])]
    weight.detach().copy_(permuted)  # rows permuted in place: same sum, same storage
    assert WeightSignal.of(model).changed_since(after_ulps) == {name}
    other = make_tiny_llama()  # same architecture, other tensors: everything differs
    assert WeightSignal.of(other).changed_since(held) == {n for n, _ in other.named_parameters()}


@requires_vllm
def test_the_engine_generates_from_permuted_weights_a_checksum_would_miss(tokenizer, tmp_path):
    from trl_dart_es.rollout.transformers import TransformersRollout

    trainer = _trainer("vllm", tokenizer, tmp_path)  # a live engine (a cached run's may have been switched)
    prompts = toy_dataset(8)["prompt"]
    hf = TransformersRollout(trainer.model, tokenizer, trainer.rollout.generation_config, trainer.es_params)
    before = trainer.rollout.generate(prompts)
    head = trainer.model.lm_head.weight
    saved = head.detach().clone()
    total = head.detach().sum(dtype=torch.float64)
    try:
        head.detach().copy_(head.detach().roll(1, dims=0))  # token i now scores as token i - 1
        assert head.detach().sum(dtype=torch.float64) == total
        after = trainer.rollout.generate(prompts)
        assert after.token_ids != before.token_ids, "the permutation changed nothing: the test proves nothing"
        assert after.token_ids == hf.generate(prompts).token_ids  # the engine holds the permuted weights
    finally:
        head.detach().copy_(saved)
    assert trainer.rollout.generate(prompts).token_ids == before.token_ids


@requires_vllm
def test_ctrl_c_during_an_evaluation_generate_leaves_no_request_behind(tokenizer, tmp_path):
    trainer = _trainer("vllm", tokenizer, tmp_path)
    prompts = toy_dataset(8)["prompt"]
    clean = trainer.rollout.generate(prompts)
    with _fail_once(trainer.rollout.engine.llm.llm_engine, "step", KeyboardInterrupt()):
        with pytest.raises(KeyboardInterrupt):
            trainer.rollout.generate(prompts)
    _engine_is_clean(trainer)
    again = trainer.rollout.generate(prompts)
    assert len(again.token_ids) == 8 and again.token_ids == clean.token_ids


@requires_vllm
def test_a_request_left_in_the_engine_is_aborted_before_the_next_call(tokenizer, tmp_path):
    """A call interrupted outside our code (say, between vLLM adding requests and stepping) left requests in
    the engine: the next generate aborts them instead of returning their completions among its own."""
    trainer = _trainer("vllm", tokenizer, tmp_path)
    prompts = toy_dataset(8)["prompt"]
    clean = trainer.rollout.generate(prompts)
    engine = trainer.rollout.engine
    encoded = trainer.rollout._encode(prompts)
    engine.llm.enqueue(encoded, trainer.rollout._sampling_params(len(encoded), None), use_tqdm=False)
    assert engine.llm.llm_engine.get_num_unfinished_requests() == 8
    assert trainer.rollout.generate(prompts).token_ids == clean.token_ids
    _engine_is_clean(trainer)


# ----------------------------------------------------------------------------------- stop strings
@pytest.mark.parametrize("backend", _backend_params())
def test_stop_strings_end_completions_on_every_backend(backend, tokenizer, tmp_path):
    free = _trainer(backend, tokenizer, tmp_path / "free")
    prompts = toy_dataset(8)["prompt"][:4]
    members = free.strategy.members(0)
    texts = [t for g in free.rollout.generate_population(prompts, members) for t in g.texts]
    stop = next(t[2:4] for t in texts if len(t) >= 6 and t[2:4].strip())  # something a completion does say
    stopped = _trainer(backend, tokenizer, tmp_path / "stop", generation_kwargs={"stop_strings": [stop]})
    gens = stopped.rollout.generate_population(prompts, members)
    rows = [(t, ids) for g in gens for t, ids in zip(g.texts, g.token_ids, strict=True)]
    hits = 0
    for (text, ids), free_text in zip(rows, texts, strict=True):
        assert free_text.startswith(text)  # the same completion, cut short
        if stop in free_text:
            hits += 1
            assert stop in text  # it ends at the first token that completes the stop string
            assert stop not in tokenizer.decode(ids[:-1], skip_special_tokens=True)
        else:
            assert text == free_text
    assert hits >= 1
    stopped.train()  # the whole step runs with stop strings (it raised at the first step before)
    assert stopped.state.global_step == 1


# ----------------------------------------------------------------------------------------- resume
@requires_vllm
@pytest.mark.parametrize("backend", ["vllm", "vllm-lowrank"])
def test_vllm_resume_is_bitwise_equal_to_a_straight_run(backend, tokenizer, tmp_path):
    def run(out, max_steps, resume=None):
        trainer = _trainer(
            backend, tokenizer, tmp_path / out, max_steps=max_steps, save_strategy="steps", save_steps=1
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run("a", 2)
    run("b", 1)
    resumed = run("b", 2, resume=str(tmp_path / "b" / "checkpoint-1"))
    assert resumed.state.global_step == 2
    _assert_same_run(straight, resumed)


def test_resume_refuses_a_changed_trajectory_setting_and_names_it(tokenizer, tmp_path):
    first = _trainer("transformers-lowrank", tokenizer, tmp_path / "a", save_strategy="steps", save_steps=1)
    first.train()
    checkpoint = str(tmp_path / "a" / "checkpoint-1")
    changed = _trainer("transformers-lowrank", tokenizer, tmp_path / "b", sigma=0.25, max_steps=2)
    before = _weights(changed)
    with pytest.raises(ValueError, match=r"sigma: checkpoint 0\.5, now 0\.25"):
        changed.train(resume_from_checkpoint=checkpoint)
    assert all(torch.equal(t, before[n]) for n, t in _weights(changed).items())  # refused before loading
    other_targets = _trainer(
        "transformers-lowrank", tokenizer, tmp_path / "c", lowrank_target_modules=["q_proj"]
    )
    with pytest.raises(ValueError, match="evolved tensors.*no longer evolve"):
        other_targets.train(resume_from_checkpoint=checkpoint)
    with pytest.warns(UserWarning, match="learning_rate: checkpoint 0.05, now 0.1"):
        _trainer("transformers-lowrank", tokenizer, tmp_path / "d", learning_rate=0.1, max_steps=2).train(
            resume_from_checkpoint=checkpoint
        )


@requires_vllm
def test_resume_refuses_switching_use_vllm_when_auto_targets_change(tokenizer, tmp_path):
    first = _trainer("transformers-lowrank", tokenizer, tmp_path / "a", save_strategy="steps", save_steps=1)
    first.train()
    switched = _trainer("vllm-lowrank", tokenizer, tmp_path / "b", max_steps=2)
    assert set(switched.es_params.names) < set(first.es_params.names)  # 'auto': linear weights only on vLLM
    with pytest.raises(ValueError, match="evolved tensors"):
        switched.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))


def test_check_resume_settings_tolerates_checkpoints_without_settings():
    check_resume_settings(None, {"sigma": 1.0}, "old-checkpoint")
    check_resume_settings({}, {"sigma": 1.0}, "old-checkpoint")
