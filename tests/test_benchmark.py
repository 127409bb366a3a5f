"""The side-by-side benchmark harness (trl_dart_es.benchmark) and the baseline configs (curves: test_curves.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from datasets import Dataset, DatasetDict

from trl_dart_es import benchmark as bench

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "recipes" / "configs"


# ------------------------------------------------------------------------------------------ pure helpers
def test_summarize_run_uses_steps_after_warmup():
    # Steps 2..4 are timed: median(2, 4, 3) = 3 s; tokens 20 + 40 + 60 over 2 + 4 + 3 s = 13.33 tokens/s.
    out = bench.summarize_run([10.0, 2.0, 4.0, 3.0], [100, 20, 40, 60], warmup_steps=1)
    assert out["step_time_s_median"] == 3.0
    assert out["tokens_per_s"] == pytest.approx(120 / 9)
    assert out["timed_steps"] == 3


def test_summarize_run_times_every_step_when_warmup_leaves_none():
    out = bench.summarize_run([5.0, 3.0], [10, 30], warmup_steps=2)
    assert out["step_time_s_median"] == 4.0
    assert out["tokens_per_s"] == pytest.approx(40 / 8)
    assert out["timed_steps"] == 2


@pytest.mark.parametrize("total,preferred,expected", [(64, 16, 16), (48, 32, 24), (7, 16, 7), (128, 16, 16)])
def test_micro_batch_divides_the_rollouts(total, preferred, expected):
    assert bench._micro_batch(total, preferred) == expected


def test_method_registry():
    vllm_rows = {"dart-es-vllm", "dart-es-vllm-lowrank", "inference-vllm"}
    installed = bench._installed(["vllm"])
    assert set(bench.DEFAULT_METHODS) == {
        "dart-es",
        "es",
        "grpo",
        "grpo-lora",
        "dart-es-lowrank",
        "inference",
    } | (vllm_rows if installed else set())
    for optional in ("dart-es-noise-cache",):
        assert optional in bench.METHODS and optional not in bench.DEFAULT_METHODS
    assert bench.METHODS["dart-es-vllm"].overrides["use_vllm"] is True
    lowrank_vllm = bench.METHODS["dart-es-vllm-lowrank"].overrides
    assert lowrank_vllm["use_vllm"] is True and lowrank_vllm["perturbation"] == "lowrank"
    assert bench.METHODS["inference-vllm"].kind == "inference"
    assert bench.METHODS["inference-vllm"].overrides["use_vllm"] is True
    assert bench.METHODS["dart-es-lowrank"].overrides["perturbation"] == "lowrank"
    # The inference row generates with the low-rank rollout's batching (all N x B rows in one call).
    assert bench.METHODS["inference"].overrides["perturbation"] == "lowrank"
    assert bench.METHODS["dart-es-noise-cache"].overrides["noise_cache"] == "on"
    # Plain ES is the DART-ES row with the two switches off, nothing else, on either backend pair.
    switches = {"use_difficulty_reweighting", "use_targeted_replay"}
    pairs = (("dart-es", "es"), ("dart-es-vllm-lowrank", "es-vllm-lowrank"), ("dart-es-demo", "es-demo"))
    for dart_name, es_name in pairs:
        dart, es = bench.METHODS[dart_name], bench.METHODS[es_name]
        assert dart.configs == es.configs and dart.kind == es.kind == "es"
        assert set(dart.overrides) == set(es.overrides) and switches <= set(dart.overrides)
        assert all(dart.overrides[k] for k in switches) and not any(es.overrides[k] for k in switches)
        assert {k: v for k, v in dart.overrides.items() if k not in switches} == {
            k: v for k, v in es.overrides.items() if k not in switches
        }
    # Every ES row pins its backend, whatever the demo config (quickstart.yaml) generates with, and but for the
    # demo's own rows its generation precision.
    for m in bench.METHODS.values():
        if m.kind in ("es", "inference"):
            assert {"perturbation", "use_vllm"} <= set(m.overrides), m.name
            assert ("generation_dtype" in m.overrides) != m.name.endswith("-demo"), m.name
    assert all(m.kind in bench.RUNNERS for m in bench.METHODS.values())


def _row(method, status="ok", time_s=None, mem=None, **kw):
    row = {
        "method": method,
        "status": status,
        "rollouts_per_step": 64,
        "step_time_s_median": time_s,
        "peak_mem_mb": mem,
        "tokens_per_s": 10.0 if status == "ok" else None,
        "acc_before": 0.25,
        "acc_after": 0.5 if status == "ok" else None,
        "machine": "test machine",
        "date": "2026-01-01 00:00 UTC",
        "command": "python -m trl_dart_es.benchmark",
        "mem_kind": "cpu_peak_rss",
        "workload": bench.SHORT.comparable(),
    }
    row.update(kw)
    return row


def test_markdown_table_and_relative_numbers():
    rows = [
        _row("dart-es", time_s=50.0, mem=2048.0),
        _row("grpo", time_s=100.0, mem=8192.0),
        _row("grpo-lora", status="failed", error="Traceback ...\nRuntimeError: out of memory"),
    ]
    bench._add_relative(rows)
    assert rows[0]["step_time_vs_grpo"] == pytest.approx(-0.5)
    assert rows[0]["peak_mem_vs_grpo"] == pytest.approx(-0.75)
    assert rows[2]["step_time_vs_grpo"] is None
    md = bench.render_markdown(rows, bench.SHORT)
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(rows)  # header, separator, one line per method
    assert "| dart-es | ok | 64 | 50.0 | -50% | 2.00 | -75% | 10.0 | 25.0% | 50.0% |" in md
    assert "| grpo-lora | failed |" in md
    assert "RuntimeError: out of memory" in md


def test_throughput_section_only_where_a_row_is_compared_with_its_inference_row():
    inference = _row("inference", time_s=1.0, mem=1.0, tokens_per_s=100.0, peak_mem_mb_max_process=1.0)
    vllm = _row("inference-vllm", time_s=1.0, mem=1.0, tokens_per_s=200.0, peak_mem_mb_max_process=1.0)
    lowrank = _row(
        "dart-es-lowrank",
        time_s=1.0,
        mem=1.0,
        tokens_per_s=80.0,
        generation_tokens_per_s=90.0,
        peak_mem_mb_max_process=1.0,
    )
    md = bench.render_markdown([inference, vllm, lowrank], bench.SHORT)
    assert (
        "(100.0 tokens/s, the `inference` row):\n\n- `dart-es-lowrank`: whole ES step 80%, generation phase only 90%."
        in md
    )
    assert "the `inference-vllm` row" not in md  # no vLLM ES row: no header without lines under it
    md = bench.render_markdown([inference, vllm], bench.SHORT)
    assert "Rollout throughput against" not in md


def test_merge_keeps_only_rows_measured_on_the_same_workload():
    old = [
        _row("dart-es", time_s=1.0, mem=1.0),
        _row("es", time_s=2.0, mem=1.0),
        _row("grpo-lora", time_s=3.0, mem=1.0, workload={**bench.SHORT.comparable(), "steps": 99}),
    ]
    new = [_row("grpo", time_s=4.0, mem=2.0)]
    merged = bench.merge_rows(new, old, bench.SHORT)
    assert [r["method"] for r in merged] == [
        "dart-es",
        "es",
        "grpo",
    ]  # registry order; stale grpo-lora dropped
    assert merged[0]["step_time_vs_grpo"] == pytest.approx(-0.75)


def test_a_failing_method_is_reported_and_the_others_still_run(monkeypatch, tmp_path):
    calls = []

    def fake_spawn(name, workload, work_dir, bar=None):
        calls.append(name)
        log = tmp_path / f"{name}.log"
        if name == "es":
            log.write_text("Traceback (most recent call last):\nValueError: boom\n")
            return None, {
                "rc": 1,
                "wall_s": 1.0,
                "peak_tree_rss_mb": 0.0,
                "log": str(log),
                "timed_out": False,
            }
        result = {
            "eval": {"accuracy": 0.5},
            "step_times_s": [9.0, 2.0, 4.0],
            "completion_tokens": [64, 64, 64],
        }
        observed = {"rc": 0, "wall_s": 1.0, "peak_tree_rss_mb": 1000.0, "log": str(log), "timed_out": False}
        return result, observed

    monkeypatch.setattr(bench.run, "spawn", fake_spawn)
    rows = bench.run_benchmark(["dart-es", "es", "grpo"], bench.SHORT, work_dir=tmp_path, show_progress=False)
    assert calls == ["_baseline", "dart-es", "es", "grpo"]
    status = {r["method"]: r["status"] for r in rows}
    assert status == {"dart-es": "ok", "es": "failed", "grpo": "ok"}
    failed = next(r for r in rows if r["method"] == "es")
    assert "ValueError: boom" in failed["error"]
    ok = next(r for r in rows if r["method"] == "grpo")
    assert ok["step_time_s_median"] == 3.0 and ok["peak_mem_mb"] == 1000.0 and ok["acc_before"] == 0.5


# ------------------------------------------------------------------------------------------------ configs
def test_es_quickstart_is_quickstart_with_dart_switched_off():
    dart_path = CONFIGS / "quickstart.yaml"
    if not dart_path.is_file():
        pytest.skip("recipes/configs/quickstart.yaml is not there yet")
    dart = yaml.safe_load(dart_path.read_text())
    es = yaml.safe_load((CONFIGS / "es_quickstart.yaml").read_text())
    switches = {"use_difficulty_reweighting", "use_targeted_replay", "output_dir", "project"}
    assert {k: v for k, v in dart.items() if k not in switches} == {
        k: v for k, v in es.items() if k not in switches
    }
    assert es["use_difficulty_reweighting"] is False and es["use_targeted_replay"] is False


def test_grpo_configs_match_the_es_workload_and_parse():
    from trl import GRPOConfig, get_peft_config

    es = yaml.safe_load((CONFIGS / "es_quickstart.yaml").read_text())
    for name, lora in (("grpo_quickstart.yaml", False), ("grpo_lora_quickstart.yaml", True)):
        raw = yaml.safe_load((CONFIGS / name).read_text())
        for key in (
            "model_name_or_path",
            "dtype",
            "dataset_name",
            "max_completion_length",
            "seed",
            "reward_weights",
        ):
            assert raw[key] == es[key], (name, key)
        # Same rollouts per optimizer step as ES: N x B completions.
        rollouts = raw["per_device_train_batch_size"] * raw["gradient_accumulation_steps"]
        assert rollouts == es["population_size"] * es["per_device_train_batch_size"]
        assert raw["num_generations"] == es["population_size"]
        _, args, model_args = bench.parse_recipe_config(GRPOConfig, CONFIGS / name, {"output_dir": "unused"})
        assert args.bf16 is False and args.num_generations == raw["num_generations"]
        peft = get_peft_config(model_args)
        assert (peft is not None) == lora
        if lora:
            assert peft.r == 16 and peft.target_modules == "all-linear"


def test_recipe_overrides_carry_lists_and_booleans():
    from trl_dart_es import DartESConfig

    values = {"output_dir": "unused", "lowrank_target_modules": ["o_proj", "down_proj"], "antithetic": False}
    values |= {"reward_weights": [1.0, 0.5], "perturbation": "lowrank"}
    _, args, _ = bench.parse_recipe_config(DartESConfig, CONFIGS / "quickstart.yaml", values)
    assert args.lowrank_target_modules == ["o_proj", "down_proj"] and args.reward_weights == [1.0, 0.5]
    assert args.antithetic is False


def test_workload_options_override_the_short_default():
    args = bench._parser().parse_args(["--steps", "5", "--prompts", "4", "--model", "m"])
    workload = bench.workload_from_args(args)
    assert (workload.steps, workload.prompts, workload.model) == (5, 4, "m")
    assert workload.rollouts_per_step == 4 * bench.SHORT.population
    es = yaml.safe_load((CONFIGS / "es_quickstart.yaml").read_text())
    assert workload.max_completion_length == es["max_completion_length"]  # from the ES recipe config
    full = bench.workload_from_args(bench._parser().parse_args(["--full"]))
    assert full.steps > bench.SHORT.steps and full.eval_prompts > bench.SHORT.eval_prompts


def test_every_method_gets_the_demo_configs_task_version(tmp_path):
    """The DART-ES config's `task_version` reaches the workload, so GRPO trains and every method is scored on the
    demo's task; rows of another version do not sit in one table."""
    from trl_dart_es.tasks import load_task_dataset

    demo = yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())
    curves_args = bench._parser().parse_args(["--curves"])
    assert bench.workload_from_args(curves_args).task_version == demo.get("task_version")
    for version in (1, 2):
        (tmp_path / "quickstart.yaml").write_text(yaml.safe_dump({**demo, "task_version": version}))
        workload = bench.Workload(config_dir=str(tmp_path), eval_prompts=16).resolved()
        assert workload.task_version == version and workload.data_options()["version"] == version
        assert workload.comparable()["task_version"] == version
        expected = load_task_dataset(
            "embedded:gsm8k", "test", prompt_style="answer", num_examples=16, version=version
        )
        assert bench.held_out_set(workload)["prompt"] == expected["prompt"]
    other = load_task_dataset("embedded:gsm8k", "test", prompt_style="answer", num_examples=16, version=1)
    assert bench.held_out_set(workload)["prompt"] != other["prompt"]  # the version changes the prompts
    (tmp_path / "quickstart.yaml").write_text(
        yaml.safe_dump({k: v for k, v in demo.items() if k != "task_version"})
    )
    unset = bench.Workload(config_dir=str(tmp_path)).resolved()
    assert unset.task_version is None and "version" not in unset.data_options()
    assert "task_version" not in unset.comparable()  # rows measured before the field existed still merge


# ------------------------------------------------------------------------- shared evaluation on a tiny model
def test_evaluate_greedy_matches_the_dart_es_trainer_evaluation(tmp_path, tiny_lm, tokenizer):
    """The one evaluation function every method uses gives DartESTrainer.evaluate_dataset's numbers."""
    from trl_dart_es import DartESConfig, DartESTrainer

    def first_token_even(completion_ids, **kwargs):
        return [float(bool(ids) and ids[0] % 2 == 0) for ids in completion_ids]

    def length(completions, **kwargs):
        return [len(c[0]["content"]) / 10 for c in completions]

    data = _tiny_split(7, "test")
    args = DartESConfig(
        output_dir=str(tmp_path / "out"), population_size=2, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, max_completion_length=4, use_cpu=True, report_to="none", disable_tqdm=True,
        reward_weights=[1.0, 0.5],
    )  # fmt: skip
    trainer = DartESTrainer(
        model=tiny_lm,
        reward_funcs=[first_token_even, length],
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
    )
    expected = trainer.evaluate_dataset(data)
    got = bench.evaluate_greedy(
        tiny_lm, tokenizer, data, [first_token_even, length], max_completion_length=4, batch_size=4,
        reward_weights=[1.0, 0.5],
    )  # fmt: skip
    assert got["accuracy"] == pytest.approx(expected["eval_accuracy"])
    assert got["reward"] == pytest.approx(expected["eval_reward"])
    assert got["completions/mean_length"] == pytest.approx(expected["eval_completions/mean_length"])
    assert 0.0 < got["reward"]  # the length reward is positive, so the comparison is not 0 == 0


# ------------------------------------------------------------------------------- end to end on a tiny model
def _tiny_split(n, split):
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i} + {i + 1}?"}] for i in range(n)],
            "answer": [str(2 * i + 1) for i in range(n)],
            "id": [f"{split}-{i}" for i in range(n)],
        }
    )


@pytest.fixture
def tiny_model_and_data(tmp_path, tiny_lm, tokenizer):
    model_dir, data_dir = tmp_path / "model", tmp_path / "data"
    tiny_lm.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    DatasetDict(train=_tiny_split(16, "train"), test=_tiny_split(6, "test")).save_to_disk(str(data_dir))
    return str(model_dir), str(data_dir)


def _run(cmd, timeout):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_benchmark_end_to_end_on_a_tiny_model(tmp_path, tiny_model_and_data):
    model_dir, data_dir = tiny_model_and_data
    out = tmp_path / "report"
    methods = ["dart-es", "es", "grpo", "grpo-lora", "dart-es-lowrank", "inference"]
    cmd = [sys.executable, "-m", "trl_dart_es.benchmark", "--methods", ",".join(methods), "--model", model_dir,
           "--dataset", data_dir, "--steps", "1", "--warmup-steps", "0", "--population", "2", "--prompts", "2",
           "--max-completion-length", "4", "--eval-prompts", "4", "--eval-batch-size", "4", "--output-dir", str(out),
           "--no-progress"]  # fmt: skip
    _run(cmd, timeout=600)

    rows = json.loads((out / "latest.json").read_text())
    assert [r["method"] for r in rows] == methods
    for row in rows:
        assert set(bench.ROW_KEYS) <= set(row), set(bench.ROW_KEYS) - set(row)
        assert row["status"] == "ok", row.get("error")
        assert row["rollouts_per_step"] == 4
        assert row["step_time_s_median"] > 0 and row["peak_mem_mb"] > 0 and row["tokens_per_s"] > 0
        assert 0 < row["peak_mem_mb_max_process"] <= row["peak_mem_mb"]
        assert 0.0 <= row["acc_before"] <= 1.0
        if row["method"] == "inference":  # nothing trained: no accuracy after
            assert row["acc_after"] is None and row["eval"] is None
        else:
            assert 0.0 <= row["acc_after"] <= 1.0
        assert row["command"].startswith("python -m trl_dart_es.benchmark")
    grpo = {r["method"]: r for r in rows}["grpo"]
    assert grpo["micro_batch"] * grpo["gradient_accumulation_steps"] == 4
    md = (out / "latest.md").read_text()
    for method in methods:
        assert f"| {method} | ok | 4 |" in md
    assert (out / "latest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        "Rollout throughput against pure batched inference" in md
        and "- `dart-es-lowrank`: whole ES step" in md
    )


# ------------------------------------------------------------------------------ two-process rows (issue 14)
def test_two_process_rows_launch_the_repo_configs_on_two_processes(monkeypatch):
    rows = {"dart-es-2proc": "cpu_2proc.yaml", "grpo-zero2": "deepspeed_zero2_cpu.yaml",
            "grpo-zero3": "deepspeed_zero3_cpu.yaml"}  # fmt: skip
    monkeypatch.setattr(bench.process, "_gpu_name", lambda: None)
    for name, cpu_config in rows.items():
        method = bench.METHODS[name]
        assert method.processes == 2 and method.launch[0] == cpu_config and not method.default
        for config in method.launch:
            assert (bench.LAUNCH_CONFIG_DIR / config).is_file(), config
        cmd, env = bench.launch_command(method, bench.SHORT, ["-m", "trl_dart_es.benchmark", "--child", "s"])
        assert cmd[1:3] == ["-m", "accelerate.commands.launch"]
        assert cmd[cmd.index("--config_file") + 1] == str(bench.LAUNCH_CONFIG_DIR / cpu_config)
        assert cmd[cmd.index("--num_processes") + 1] == "2"
        assert cmd[-4:] == ["-m", "trl_dart_es.benchmark", "--child", "s"]
        assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
        assert env["TORCH_EXTENSIONS_DIR"]
    assert bench.METHODS["grpo-zero2"].requires == bench.METHODS["grpo-zero3"].requires == ("deepspeed",)
    assert bench.METHODS["grpo-zero3"].configs == bench.METHODS["grpo"].configs  # the same GRPO recipe config
    cuda = bench.METHODS["grpo-zero3"].launch[1]
    assert yaml.safe_load((bench.LAUNCH_CONFIG_DIR / cuda).read_text())["deepspeed_config"]["zero_stage"] == 3


def test_rows_report_the_largest_single_process_next_to_the_whole_tree(tmp_path):
    context = {"acc_before": 0.25, "machine": "m", "date": "d", "command": "c"}
    observed = {"rc": 0, "wall_s": 1.0, "peak_tree_rss_mb": 3000.0, "peak_process_rss_mb": 1100.0,
                "log": str(tmp_path / "log"), "timed_out": False}  # fmt: skip
    two = {"step_times_s": [3.0, 2.0], "completion_tokens": [64, 64], "eval": {"accuracy": 0.5},
           "peak_rss_self_mb": 1200.0, "processes": 2,
           "ranks": [{"peak_rss_self_mb": 1200.0}, {"peak_rss_self_mb": 1400.0}]}  # fmt: skip
    row = bench._row(bench.METHODS["grpo-zero3"], bench.SHORT, two, observed, context)
    assert row["peak_mem_mb"] == 3000.0 and row["peak_mem_mb_max_process"] == 1400.0 and row["processes"] == 2
    one = {k: v for k, v in two.items() if k not in ("ranks", "processes")}
    row1 = bench._row(bench.METHODS["dart-es"], bench.SHORT, one, observed, context)
    assert row1["peak_mem_mb_max_process"] == 1200.0 and row1["processes"] == 1
    failed = bench._row(bench.METHODS["grpo-zero2"], bench.SHORT, None, {**observed, "error": "x"}, context)
    assert "peak_mem_mb_max_process" in failed and failed["peak_mem_mb_max_process"] is None
    md = bench.render_markdown([row, row1], bench.SHORT)
    assert "| grpo-zero3 | 2 | 2.93 | 1.37 |" in md and "| dart-es | 1 | 2.93 | 1.17 |" in md


def test_the_curves_dart_es_is_the_demo_config_as_it_is():
    """`--curves`' DART-ES row overrides nothing that quickstart.yaml (the demo) sets otherwise, and its ES row
    is the demo's plain-ES twin (es_quickstart.yaml's switches)."""
    demo = yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())
    es = yaml.safe_load((CONFIGS / "es_quickstart.yaml").read_text())
    dart_name, es_name = bench.CURVE_METHODS[:2]
    assert bench.METHODS[dart_name].configs[0] == "quickstart.yaml"
    for key, value in bench.METHODS[dart_name].overrides.items():
        assert demo.get(key) == value, key  # None: a field the demo leaves at its default
    for key, value in bench.METHODS[es_name].overrides.items():
        assert es.get(key) == value, key
    assert {"grpo", "grpo-lora"} <= set(bench.CURVE_METHODS)
