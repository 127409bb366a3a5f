"""The GSM8K recipe runs end to end from a YAML config (TrlParser), on a tiny model saved to disk."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_recipe_trains_evaluates_and_saves(tmp_path, tiny_lm, tokenizer):
    model_dir = tmp_path / "tiny"
    tiny_lm.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "out"
    config = tmp_path / "tiny.yaml"
    config.write_text(
        "\n".join(
            [
                f"model_name_or_path: {model_dir}",
                "dataset_name: embedded:gsm8k",
                "dataset_train_split: validation",  # 128 rows: the smallest offline split
                "dataset_test_split: test",
                "prompt_style: answer",  # the task options of TaskArguments, as quickstart.yaml sets them
                "eval_num_examples: 24",
                f"output_dir: {out}",
                "use_cpu: true",
                "population_size: 2",
                "per_device_train_batch_size: 4",
                "per_device_eval_batch_size: 64",
                "max_steps: 1",
                "max_completion_length: 4",
                "sigma: 0.01",
                "learning_rate: 0.01",
                # TRL's GRPO-script convention: rewards by name, one weight each.
                "reward_funcs: [gsm8k_accuracy_reward, gsm8k_format_reward, gsm8k_step_reward]",
                "reward_weights: [1.0, 0.1, 0.5]",
                # the demo's logging: a local trackio store, completions to parquet
                "report_to: trackio",
                "project: recipe-test",
                "log_completions: true",
                "num_completions_to_print: 1",
                "disable_tqdm: true",
            ]
        )
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("TRACKIO_DIR", None)  # the recipe's own default: the store goes with the run's outputs
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "dart_es_gsm8k.py"), "--config", str(config), "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out metric" in proc.stdout and "eval_accuracy" in proc.stdout
    assert "Held-out: 24 prompts" in proc.stdout
    assert "eval_rewards/gsm8k_step_reward/mean" in proc.stdout
    # The gain with its interval, paired over the same prompts; the same gain as the table's accuracies.
    (row,) = re.findall(r"^eval_accuracy +([0-9.]+) +([0-9.]+)$", proc.stdout, flags=re.M)
    line = re.search(
        r"Accuracy [0-9.]+% -> [0-9.]+%: ([+-][0-9.]+) points, 95% interval \[([+-][0-9.]+), ([+-][0-9.]+)\] "
        r"paired over the 24 prompts",
        proc.stdout,
    )
    assert line, proc.stdout[-2000:]
    gain, low, high = map(float, line.groups())
    assert gain == pytest.approx(100 * (float(row[1]) - float(row[0])), abs=0.1) and low <= gain <= high
    assert (out / "model.safetensors").exists() and (out / "README.md").exists()
    assert "dart-es" in (out / "README.md").read_text()
    # The demo's picture and logs, and the printed pointers to them.
    assert (out / "training_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"{out / 'training_curve.png'}" in proc.stdout
    assert (out / "completions" / "completions_00001.parquet").exists()
    assert json.loads((out / "trainer_state.json").read_text())["log_history"][0]["reward"] is not None
    store = out / "trackio"
    assert (store / "recipe-test.db").exists()
    assert f'TRACKIO_DIR={store} trackio show --project "recipe-test"' in proc.stdout


def _run_recipe(tmp_path, tiny_lm, tokenizer, dataset: Path, *flags: str) -> tuple[str, Path]:
    """The recipe for one ES step of the tiny model on `dataset` (a local folder); its stdout and output dir."""
    model_dir = tmp_path / "tiny"
    tiny_lm.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "out"
    settings = {
        "model_name_or_path": model_dir,
        "dataset_name": dataset,
        "output_dir": out,
        "use_cpu": "true",
        "population_size": 2,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 64,
        "max_steps": 1,
        "max_completion_length": 4,
        "sigma": 0.01,
        "learning_rate": 0.01,
        "report_to": "none",
        "log_completions": "true",
        "num_completions_to_print": 0,
        "disable_tqdm": "true",
    }
    cmd = [sys.executable, str(ROOT / "recipes" / "dart_es_gsm8k.py")]
    cmd += [arg for key, value in settings.items() for arg in (f"--{key}", str(value))]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, *flags], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, out


def _step_table(out: Path):
    import pandas as pd

    return pd.read_parquet(out / "completions" / "completions_00001.parquet")


def test_recipe_trains_on_a_local_gsm8k_folder_in_the_hubs_layout(tmp_path, tiny_lm, tokenizer):
    """`--dataset_name <folder>` with `main/train-*.parquet`, `main/test-*.parquet` (as `openai/gsm8k` is
    stored) trains with GSM8K's rewards, on the "main" rows only."""
    from test_tasks import hub_gsm8k_rows, write_hub_gsm8k

    train, test = hub_gsm8k_rows("train", 8), hub_gsm8k_rows("test", 4)
    folder = tmp_path / "gsm8k"
    write_hub_gsm8k(folder, train, test)
    stdout, out = _run_recipe(tmp_path, tiny_lm, tokenizer, folder)
    assert f"Held-out: 4 prompts of {folder} (test split)" in stdout
    logs = json.loads((out / "trainer_state.json").read_text())["log_history"][0]
    assert {"rewards/gsm8k_accuracy_reward/mean", "rewards/gsm8k_format_reward/mean"} <= set(logs)
    table = _step_table(out)
    assert set(table["problem_id"]) <= {f"gsm8k-train-{i:05d}" for i in range(8)}
    for pid, prompt in zip(table["problem_id"], table["prompt"], strict=True):
        assert train["question"][int(pid[-5:])] in str(prompt)  # main's rows, not the socratic decoy's


def test_recipe_trains_on_a_math_style_folder_with_trls_rewards(tmp_path, tiny_lm, tokenizer):
    """MATH-style rows (`problem`, `solution` with `\\boxed{}`) train a step with TRL's rewards named on the
    command line as TRL's GRPO script takes them."""
    from datasets import Dataset

    folder = tmp_path / "math"
    folder.mkdir()
    for split, n in (("train", 6), ("test", 3)):
        rows = {
            "problem": [f"What is {i} + {i}?" for i in range(n)],
            "solution": [rf"{i} + {i} = \boxed{{{2 * i}}}" for i in range(n)],
        }
        Dataset.from_dict(rows).to_json(str(folder / f"{split}.jsonl"))
    names = ["accuracy_reward", "think_format_reward", "get_soft_overlong_punishment"]
    stdout, out = _run_recipe(tmp_path, tiny_lm, tokenizer, folder, "--reward_funcs", *names)
    assert f"Held-out: 3 prompts of {folder}" in stdout and "eval_accuracy" in stdout
    logs = json.loads((out / "trainer_state.json").read_text())["log_history"][0]
    for name in ("accuracy_reward", "think_format_reward", "soft_overlong_punishment_reward"):
        assert logs[f"rewards/{name}/mean"] is not None
    table = _step_table(out)
    assert table["problem_id"].str.startswith("math-train-").all()
    assert {"accuracy_reward", "think_format_reward"} <= set(table.columns)
    assert "\\boxed{}" in str(table["prompt"][0])  # the MATH prompt asks for a boxed answer
