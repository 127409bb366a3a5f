"""The GRPO baselines under DeepSpeed ZeRO-2 and ZeRO-3, launched with the repo's own Accelerate configs on two
CPU processes (recipes/accelerate_configs/deepspeed_zero{2,3}_cpu.yaml).

Each run is the recipe itself (recipes/grpo_gsm8k.py, or recipes/grpo_lora_gsm8k.py) on a tiny model for one
optimizer step, through tests/scripts/grpo_deepspeed_probe.py, which adds a callback recording what really
ran: two processes, a DeepSpeed engine at the expected ZeRO stage, partitioned parameters under ZeRO-3, and
weights that changed.
"""

import importlib.util
import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama, run_launch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "grpo_deepspeed_probe.py"
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (make install)"
    ),
    pytest.mark.skipif(torch.cuda.is_available(), reason="these runs check the CPU (gloo) launch path"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir):
    """A tiny Llama over the embedded tokenizer whose digit tokens are likely enough that some sampled
    completions contain a number and some do not: the format reward differs within a group, so GRPO's
    advantages (and its gradient) are not all zero."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_tokenizer_dir)
    model = make_tiny_llama(vocab_size=len(tokenizer), hidden=16, layers=1)
    for cfg in (model.config, model.generation_config):
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.eos_token_id = tokenizer.eos_token_id
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    with torch.no_grad():
        model.lm_head.weight[digits] *= 60
    out = tmp_path_factory.mktemp("tiny-grpo")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def _launch(stage: int, recipe: str, config: str, model_dir: str, out: Path) -> str:
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(REPO / "recipes" / "accelerate_configs" / f"deepspeed_zero{stage}_cpu.yaml"),
        "--main_process_port", str(_free_port()),
        str(SCRIPT), "--recipe", recipe, "--probe-out", str(out / "probe"), "--",
        "--config", str(REPO / "recipes" / "configs" / config),
        "--model_name_or_path", model_dir, "--dataset_train_split", "validation", "--output_dir", str(out / "model"),
        "--max_steps", "1", "--num_generations", "4", "--per_device_train_batch_size", "8",
        "--gradient_accumulation_steps", "1", "--max_completion_length", "8", "--per_device_eval_batch_size", "128",
        "--eval_num_examples", "32",  # the configs' 256 held-out prompts only slow the test down
        "--learning_rate", "1e-3",
    ]  # fmt: skip
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        # DeepSpeed compiles its CPU communication op on first use (~30 s); keep it for the next runs.
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions")),
    }  # fmt: skip
    returncode, log = run_launch(cmd, env, 300, cwd=REPO)
    # Rarely (twice in ~40 ZeRO-3 runs, never reproduced on demand) a rank aborts in teardown, after the model
    # is saved: DeepSpeed/gloo's, not the recipe's. Only that exact failure gets one more launch.
    if _teardown_abort(returncode, log):
        print(f"teardown abort after the save; launching again:\n{log[-1500:]}")
        returncode, log = run_launch(cmd, env, 300, cwd=REPO)
    if returncode != 0:
        errors = [line for line in log.splitlines() if "Error" in line or "abort" in line.lower()]
        pytest.fail(f"rc {returncode}; error lines:\n" + "\n".join(errors[:30]) + f"\n...\n{log[-4000:]}")
    return log


def _teardown_abort(returncode: int, log: str) -> bool:
    """A failed run whose only fault is a SIGABRT at exit: training, evaluation and the save all finished."""
    done = "held-out metric" in log and "Model saved to" in log
    return returncode != 0 and done and "terminate called without an active exception" in log


def test_teardown_abort_is_recognised_only_after_a_finished_run():
    finished = "held-out metric ...\nModel saved to /x\nterminate called without an active exception\n"
    assert _teardown_abort(1, finished)
    assert not _teardown_abort(0, finished)
    assert not _teardown_abort(1, finished.replace("Model saved to /x\n", ""))  # died before the save
    assert not _teardown_abort(1, "held-out metric ...\nModel saved to /x\nRuntimeError: boom\n")


@pytest.mark.parametrize(
    "stage,recipe,config",
    [
        (2, "grpo_gsm8k", "grpo_quickstart.yaml"),
        (3, "grpo_gsm8k", "grpo_quickstart.yaml"),
        (2, "grpo_lora_gsm8k", "grpo_lora_quickstart.yaml"),
    ],
    ids=["zero2-grpo", "zero3-grpo", "zero2-grpo-lora"],
)
def test_grpo_recipe_trains_under_deepspeed_on_two_processes(tmp_path, tiny_model_dir, stage, recipe, config):
    log = _launch(stage, recipe, config, tiny_model_dir, tmp_path)
    assert "held-out metric" in log  # the recipe evaluated before and after and finished
    infos = [json.loads((tmp_path / "probe" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, info in enumerate(infos):
        assert info["rank"] == rank
        assert info["torch_world_size"] == info["accelerate_num_processes"] == 2, "not two processes"
        assert info["is_deepspeed_engine"], info["engine_class"]
        assert info["zero_stage"] == stage
        assert info["optimizer_class"] == (
            "DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer"
        )
        assert info["global_step"] == 1
        changes = info["max_abs_change"]
        if recipe == "grpo_lora_gsm8k":  # only the adapter trains
            assert changes and all("lora_" in name for name in changes), list(changes)
        assert max(changes.values()) > 0, "no trainable weight changed"
    assert (
        infos[0]["max_abs_change"] == infos[1]["max_abs_change"]
    )  # one model, seen the same from both ranks
    if stage == 3:
        for name, (local0, full, visible) in infos[0]["partitions"].items():
            local1 = infos[1]["partitions"][name][0]
            # Each rank holds its half (padded up) and nothing else; the module's own tensor is released.
            assert local0 == local1 == -(-full // 2), (name, local0, local1, full)
            assert visible == 0, name
        embed = infos[0]["partitions"]["model.embed_tokens.weight"]
        assert embed[0] * 2 == embed[1]
    assert (tmp_path / "model").is_dir() and any((tmp_path / "model").iterdir())


def test_cpu_launch_args_add_use_cpu_only_for_a_multi_process_cpu_launch(monkeypatch):
    sys.path.insert(0, str(REPO / "recipes"))
    from grpo_gsm8k import cpu_launch_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cpu_launch_args(["--config", "c.yaml"]) == ["--config", "c.yaml", "--use_cpu", "true"]
    assert cpu_launch_args(["--use_cpu", "false"]) == ["--use_cpu", "false"]  # the command line wins
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cpu_launch_args(["--config", "c.yaml"]) == ["--config", "c.yaml"]
