"""Generation precision (`DartESConfig.generation_dtype`): how it resolves, what it refuses, and that a bf16 vLLM
engine leaves the evolved weights in exact fp32 (the update is replayed bitwise on a fresh fp32 model)."""

import copy

import pytest
import torch
from conftest import (
    requires_vllm,
    tiny_es_config,
    token_length_reward,
    token_parity_reward,
    toy_dataset,
    vllm_tiny_llama,
)
from transformers import GenerationConfig

from trl_dart_es import DartESTrainer, precision
from trl_dart_es.lowrank import LowRankParameters
from trl_dart_es.noise import population
from trl_dart_es.perturb import EvolvedParameters
from trl_dart_es.precision import cpu_supports_bf16, resolve_generation_dtype
from trl_dart_es.rollout import vllm as vllm_rollout
from trl_dart_es.rollout.generation_copy import GenerationCopy
from trl_dart_es.rollout.transformers import TransformersRollout
from trl_dart_es.trainer.baseline import baseline_cache_parts, generation_precision

AMX_CPU = "processor : 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
AVX2_CPU = "processor : 0\nflags\t\t: fpu sse2 avx2 fma\n"


def test_cpu_bf16_support_comes_from_the_cpu_flags():
    assert cpu_supports_bf16(AMX_CPU) and not cpu_supports_bf16(AVX2_CPU)
    assert cpu_supports_bf16("flags : avx512_bf16\n") and cpu_supports_bf16("flags : amx_bf16\n")


def test_generation_dtype_resolves_per_request_model_and_hardware():
    fp32, bf16 = torch.float32, torch.bfloat16
    assert resolve_generation_dtype(None, fp32, on_cuda=False, cpuinfo=AMX_CPU) == fp32  # the reference
    assert resolve_generation_dtype("auto", fp32, on_cuda=False, cpuinfo=AMX_CPU) == bf16
    assert (
        resolve_generation_dtype("auto", fp32, on_cuda=False, cpuinfo=AVX2_CPU) == fp32
    )  # emulated bf16: slower
    assert resolve_generation_dtype("auto", torch.float16, on_cuda=False, cpuinfo=AMX_CPU) == torch.float16
    assert resolve_generation_dtype("bfloat16", fp32, on_cuda=False, cpuinfo=AVX2_CPU) == bf16  # asked for
    assert resolve_generation_dtype("float32", bf16, on_cuda=False) == fp32
    with pytest.raises(ValueError, match="generation_dtype='bf16'"):
        resolve_generation_dtype("bf16", fp32, on_cuda=False)


def test_generation_precision_enters_cache_keys_only_when_set():
    from types import SimpleNamespace as NS

    engine = NS(dtype=torch.bfloat16)
    assert generation_precision(NS(args=NS(generation_dtype=None), rollout=NS(engine=engine))) == {}
    parts = generation_precision(NS(args=NS(generation_dtype="auto"), rollout=NS(engine=engine)))
    assert parts["generation_dtype"] == "torch.bfloat16"
    assert generation_precision(NS(args=NS(generation_dtype="auto"), rollout=NS())) == {}  # no engine


def test_bf16_cache_keys_name_the_cpus_bf16_units(monkeypatch):
    # AMX and AVX512-BF16 round bf16 differently: an untrained score cached on one is not the other's.
    from types import SimpleNamespace as NS

    import trl_dart_es.trainer.baseline as baseline

    def key(engine_dtype, device="cpu"):
        trainer = NS(args=NS(generation_dtype="auto"), rollout=NS(engine=NS(dtype=engine_dtype)),
                     accelerator=NS(device=torch.device(device)))  # fmt: skip
        return generation_precision(trainer)

    keys = {}
    for name, cpuinfo in (("amx", AMX_CPU), ("avx2", AVX2_CPU)):
        monkeypatch.setattr(baseline, "cpu_bf16_flags", lambda c=cpuinfo: precision.cpu_bf16_flags(c))
        keys[name] = key(torch.bfloat16)
        assert key(torch.float32) == {"generation_dtype": "torch.float32"}  # fp32: no CPU part
    assert keys["amx"]["cpu_bf16"] == "avx512_bf16+amx_bf16"
    assert precision.cpu_bf16_flags(AMX_CPU.replace(" amx_bf16 amx_tile", "")) == ["avx512_bf16"]  # an EPYC
    assert keys["avx2"]["cpu_bf16"] == "emulated" and keys["amx"] != keys["avx2"]
    assert "cpu_bf16" not in key(torch.bfloat16, device="meta")  # an accelerator: not the CPU's units


def test_config_refuses_a_bad_generation_dtype(tmp_path):
    with pytest.raises(ValueError, match="generation_dtype='half'"):
        tiny_es_config(tmp_path, use_vllm=True, generation_dtype="half")
    assert (
        tiny_es_config(tmp_path, generation_dtype="bfloat16").generation_dtype == "bfloat16"
    )  # transformers too
    assert tiny_es_config(tmp_path).generation_dtype is None  # the reference by default


BACKENDS = [
    pytest.param(b, marks=requires_vllm) if b.startswith("vllm") else b
    for b in ("vllm-lowrank", "vllm", "transformers-lowrank", "transformers")
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_generation_keeps_the_evolved_weights_in_exact_fp32(backend, tokenizer, tmp_path):
    perturbation = "lowrank" if backend.endswith("lowrank") else "full"
    args = tiny_es_config(
        tmp_path,
        use_vllm=backend.startswith("vllm"),
        perturbation=perturbation,
        generation_dtype="bfloat16",
        vllm_max_model_length=256,
        vllm_cpu_kvcache_space=1,
        max_completion_length=8,
        sigma=0.5 if perturbation == "lowrank" else 0.05,
    )
    trainer = DartESTrainer(
        model=vllm_tiny_llama(tokenizer),
        reward_funcs=[token_parity_reward, token_length_reward],
        args=args,
        train_dataset=toy_dataset(8),
        processing_class=tokenizer,
    )
    try:
        rollout = trainer.rollout
        assert (rollout.engine.dtype if args.use_vllm else rollout.dtype) == torch.bfloat16
        # The cached untrained score is keyed by the precision too: bf16 scores differently from fp32.
        parts = baseline_cache_parts(trainer, toy_dataset(8), "embedded:smollm2-135m")
        assert parts["generation_dtype"] == "torch.bfloat16"
        updates = []
        update = trainer.es_params.update

        def record(members, z, lr):
            updates.append((list(members), list(z), lr))
            return update(members, z, lr)

        trainer.es_params.update = record
        trainer.train()
    finally:
        vllm_rollout.shutdown_engine()
    assert updates and all(p.dtype == torch.float32 for p in trainer.model.parameters())
    if not args.use_vllm:  # a bf16 copy generated; refreshed, it holds the trained master rounded
        assert trainer.rollout.copy.syncs >= len(updates) - 1  # before each step after an update
        copied = dict(trainer.rollout.generating_model().named_parameters())
        for name, p in trainer.model.named_parameters():
            assert copied[name].dtype == torch.bfloat16 and torch.equal(copied[name], p.to(torch.bfloat16)), (
                name
            )
    # Replaying the same updates on a fresh fp32 model gives bitwise the trained weights: the bf16 engine never
    # fed rounding back into them.
    fresh = vllm_tiny_llama(tokenizer)
    if perturbation == "lowrank":
        params = LowRankParameters(fresh, args.sigma, names=trainer.es_params.names)
    else:
        from trl_dart_es.perturb import EvolvedParameters

        params = EvolvedParameters(fresh, args.sigma)
    for members, z, lr in updates:
        params.update(members, z, lr)
    trained = dict(trainer.model.named_parameters())
    moved = 0
    for name, p in fresh.named_parameters():
        assert torch.equal(p, trained[name]), name
        moved += not torch.equal(p, dict(vllm_tiny_llama(tokenizer).named_parameters())[name])
    assert moved > 0, "no update: the test would prove nothing"


def _tiny_rollout(kind, tokenizer, generation_dtype=None):
    from trl_dart_es.perturb import EvolvedParameters
    from trl_dart_es.rollout.lowrank import LowRankRollout
    from trl_dart_es.rollout.transformers import TransformersRollout

    model = vllm_tiny_llama(tokenizer)
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=[tokenizer.eos_token_id],
                          pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    if kind == "lowrank":
        params = LowRankParameters(model, 0.5)
        return LowRankRollout(model, tokenizer, gc, params, generation_dtype=generation_dtype)
    return TransformersRollout(
        model, tokenizer, gc, EvolvedParameters(model, 0.05), generation_dtype=generation_dtype
    )


def test_a_bf16_member_generates_what_its_rounded_weights_generate(tokenizer):
    """Full rank: member n's completions from the bf16 copy are those of its perturbed fp32 weights cast to bf16."""
    rollout = _tiny_rollout("full", tokenizer, torch.bfloat16)
    prompts = toy_dataset(8)["prompt"][:4]
    members = population(7, 2, antithetic=True)
    gens = rollout.generate_population(prompts, members)
    for member, gen in zip(members, gens, strict=True):
        with rollout.params.perturbed(member):
            rounded = copy.deepcopy(rollout.model).to(torch.bfloat16)
        alone = TransformersRollout(
            rounded, tokenizer, rollout.generation_config, EvolvedParameters(rounded, 0.05)
        )
        assert alone.generate(prompts).token_ids == gen.token_ids
    # the master is back to its base weights, and the copy follows it
    base = rollout.generate(prompts)
    cast = copy.deepcopy(rollout.model).to(torch.bfloat16)
    assert (
        TransformersRollout(cast, tokenizer, rollout.generation_config, EvolvedParameters(cast, 0.05))
        .generate(prompts)
        .token_ids
        == base.token_ids
    )


def test_low_rank_hooks_on_a_generation_copy_are_the_hooks_on_the_model(tokenizer):
    """The batched population's hooks go on the copy by module path: with an fp32 copy, bitwise the same outputs."""
    rollout = _tiny_rollout("lowrank", tokenizer)
    prompts = toy_dataset(8)["prompt"][:4]
    members = population(3, 4, antithetic=True)
    on_model = rollout.generate_population(prompts, members)
    rollout.copy = GenerationCopy(rollout.model, torch.float32)
    on_copy = rollout.generate_population(prompts, members)
    assert [g.token_ids for g in on_copy] == [g.token_ids for g in on_model]
    assert len({tuple(map(tuple, g.token_ids)) for g in on_model}) > 1, (
        "members must differ, or this proves nothing"
    )
