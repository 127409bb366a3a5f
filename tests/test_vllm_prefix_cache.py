"""vLLM prefix caching (`vllm_enable_prefix_caching=True`): prompts of one generate call that share a prefix
compute it once, the cache is emptied before every call (the weights change between calls), and the
completions stay those of the transformers backend. Its own module: one engine lives per process."""

from test_vllm import load_embedded, requires_embedded, requires_vllm

from trl_dart_es import DartESConfig
from trl_dart_es.lowrank import LowRankParameters, lora_carried_names
from trl_dart_es.noise import Member
from trl_dart_es.rollout import vllm as vllm_rollout
from trl_dart_es.rollout import vllm_engine
from trl_dart_es.rollout.transformers import greedy_generation_config
from trl_dart_es.tasks import load_task_dataset

PROMPTS = 16
# 75 tokens: with the chat template's header, two whole 32-token blocks are shared by every prompt.
SYSTEM = (
    "You are a careful math tutor. Read the word problem, work out the result in your head, and reply with one "
    "line only: #### followed by the final number. Example: a shop sells 3 boxes of 12 eggs, so the reply is "
    "#### 36. Give only the final answer, written as #### followed by the number. Do not explain."
)


def test_prefix_caching_is_off_unless_asked_and_named_in_the_config():
    assert DartESConfig(output_dir="out").vllm_enable_prefix_caching is False
    assert "prefix" in DartESConfig.__dataclass_fields__["vllm_enable_prefix_caching"].metadata["help"]


@requires_vllm
@requires_embedded
def test_prefix_cache_shares_a_prompt_prefix_within_a_call_only_and_keeps_the_completions():
    from vllm import SamplingParams

    from trl_dart_es.rollout.lowrank import LowRankRollout
    from trl_dart_es.rollout.vllm_lowrank import VLLMLowRankRollout

    model, tokenizer = load_embedded()
    rows = load_task_dataset("embedded:gsm8k", "test", num_examples=PROMPTS, prompt_style="answer")
    prompts = [[{**m, "content": SYSTEM} if m["role"] == "system" else m for m in p] for p in rows["prompt"]]
    engine = vllm_rollout.start_engine(
        model,
        cpu_kvcache_space=1,
        max_model_len=1024,
        max_loras=2,
        max_lora_rank=1,
        enable_prefix_caching=True,
    )
    try:
        assert engine.prefix_caching
        params = LowRankParameters(model, 2e-3, rank=1, names=lora_carried_names(model))
        gc = greedy_generation_config(tokenizer, 24)
        members = [Member(5), Member(5, -1)]
        vllm_r = VLLMLowRankRollout(model, tokenizer, gc, params, engine)
        encoded = vllm_r._encode(prompts)
        first = engine.generate(encoded, SamplingParams(max_tokens=1, temperature=0.0))
        from_vllm = vllm_r.generate_population(prompts, members)
        base = vllm_r.generate(prompts)
        second = engine.generate(encoded, SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        vllm_rollout.shutdown_engine()
    hf = LowRankRollout(model, tokenizer, gc, params)
    from_hf, hf_base = hf.generate_population(prompts, members), hf.generate(prompts)

    cached = [o.num_cached_tokens for o in first]
    # The first prompt of a call computes the prefix; the others read its two whole blocks.
    assert cached[0] == 0 and all(c >= 64 for c in cached[1:]), cached
    # Emptied before the next call: its first prompt computes the prefix again instead of reading stale KV.
    assert second[0].num_cached_tokens == 0
    pairs = [(a, b) for g, h in zip([*from_vllm, base], [*from_hf, hf_base], strict=True)
             for a, b in zip(g.token_ids, h.token_ids, strict=True)]  # fmt: skip
    same = sum(a == b for a, b in pairs)
    assert same >= 0.9 * len(pairs), f"only {same}/{len(pairs)} identical completions"
    assert any(a != b for g in from_vllm for a, b in zip(g.token_ids, base.token_ids, strict=True)), (
        "the members generate what the base does: the test would not see stale KV"
    )


@requires_vllm
def test_trainer_passes_the_prefix_caching_switch_to_the_engine(monkeypatch):
    seen = {}
    monkeypatch.setattr(vllm_engine, "start_engine", lambda model, **kw: seen.update(kw))

    class Trainer:
        model = None
        processing_class = None
        args = DartESConfig(output_dir="out", use_vllm=True, vllm_enable_prefix_caching=True)
        accelerator = type("A", (), {"process_index": 0, "local_process_index": 0, "num_processes": 1})()

    vllm_engine.start_engine_for_trainer(Trainer())
    assert seen["enable_prefix_caching"] is True
