"""Stop strings on the vLLM backend: an engine started with the tokenizer stops where transformers'
`stop_strings` does. Its own module: it needs an engine of its own (with a tokenizer), and one engine lives per
process, so it must not share a module with test_vllm.py's engine fixture."""

from test_vllm import load_embedded, requires_embedded, requires_vllm

from trl_dart_es.noise import Member
from trl_dart_es.perturb import EvolvedParameters
from trl_dart_es.rollout import vllm as vllm_rollout
from trl_dart_es.rollout.transformers import TransformersRollout, greedy_generation_config
from trl_dart_es.tasks import load_task_dataset

STOP = "\nThe answer is"
PROMPTS = 16


@requires_vllm
@requires_embedded
def test_stop_strings_end_vllm_completions_where_transformers_ends_them():
    model, tokenizer = load_embedded()
    rows = load_task_dataset("embedded:gsm8k", "test", num_examples=PROMPTS, prompt_style="answer").to_dict()
    engine = vllm_rollout.start_engine(model, cpu_kvcache_space=1, max_model_len=1024, tokenizer=tokenizer)
    try:
        assert engine.tokenizer_dir is not None
        params = EvolvedParameters(model, 2e-3, cache_noise=False)
        plain = greedy_generation_config(tokenizer, 48)
        stopping = greedy_generation_config(tokenizer, 48, stop_strings=[STOP])
        member = Member(7)
        free = vllm_rollout.VLLMRollout(model, tokenizer, plain, params, engine)
        free = free.generate_population(rows["prompt"], [member])[0]
        from_vllm = vllm_rollout.VLLMRollout(model, tokenizer, stopping, params, engine)
        from_hf = TransformersRollout(model, tokenizer, stopping, params)
        a = from_vllm.generate_population(rows["prompt"], [member])[0]
        b = from_hf.generate_population(rows["prompt"], [member])[0]
    finally:
        vllm_rollout.shutdown_engine()
    assert any(STOP in text for text in free.texts), (
        "no completion says 'The answer is': the test would not see the stop"
    )
    same = sum(x == y for x, y in zip(a.token_ids, b.token_ids, strict=True))
    assert same >= 0.9 * PROMPTS, f"only {same}/{PROMPTS} identical completions"
    for text in a.texts:  # nothing after the stop string but the rest of its last token
        if STOP in text:
            assert len(text) - (text.index(STOP) + len(STOP)) <= 2, repr(text)
    assert any(STOP in text for text in a.texts) and sum(map(len, a.token_ids)) < sum(
        map(len, free.token_ids)
    )
