"""Accuracy against training time (`python -m trl_dart_es.benchmark --curves`) and its statistics."""

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from datasets import Dataset, DatasetDict

from trl_dart_es import benchmark as bench
from trl_dart_es.benchmark import curves
from trl_dart_es.benchmark.stats import (
    bootstrap_interval,
    includes_zero,
    paired_t_interval,
    t_cdf,
    t_quantile,
)

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------ stats
@pytest.mark.parametrize(
    "df,expected",
    [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (10, 2.228), (30, 2.042), (120, 1.980)],
)
def test_t_quantile_matches_the_table(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-3)


def test_t_quantile_is_symmetric_and_inverts_the_cdf():
    assert t_quantile(0.995, 2) == pytest.approx(9.925, abs=1e-3)
    assert t_quantile(0.025, 4) == pytest.approx(-t_quantile(0.975, 4))
    assert t_cdf(t_quantile(0.9, 7), 7) == pytest.approx(0.9, abs=1e-9)
    assert t_cdf(0.0, 3) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        t_quantile(1.0, 3)


def test_paired_t_interval():
    # mean 2, sd 1, n 3: half-width 4.303 / sqrt(3) = 2.484
    mean, lo, hi = paired_t_interval([1.0, 2.0, 3.0])
    assert mean == pytest.approx(2.0)
    assert (lo, hi) == pytest.approx((2.0 - 2.4843, 2.0 + 2.4843), abs=1e-3)
    assert includes_zero(lo, hi)  # [-0.48, +4.48]
    assert not includes_zero(*paired_t_interval([5.0, 6.0, 7.0])[1:])  # [+3.5, +8.5]
    mean, lo, hi = paired_t_interval([0.5])  # one seed: no interval
    assert mean == 0.5 and math.isnan(lo) and math.isnan(hi) and includes_zero(lo, hi)


def test_bootstrap_interval_is_reproducible_and_brackets_the_mean():
    values = [0.1, 0.4, 0.2, 0.3, 0.25]
    point, lo, hi = bootstrap_interval(values, resamples=2000, seed=1)
    assert point == pytest.approx(0.25)
    assert min(values) <= lo <= point <= hi <= max(values)
    assert bootstrap_interval(values, resamples=2000, seed=1) == (point, lo, hi)


# ------------------------------------------------------------------------------------------------ the clock
def test_clock_counts_steps_only_evaluates_at_marks_and_stops_at_the_budget():
    """Evaluation time never enters train_seconds: a slow evaluation does not bring the budget closer."""
    evaluations = []

    def slow_evaluate():
        time.sleep(0.15)
        evaluations.append(1)
        return {"accuracy": 0.5, "accuracy/level1": 0.75, "reward": 0.1, "tokens_per_s": 9.0}

    clock = curves.CurveClock(budget_s=0.12, eval_at_s=[0.05, 0.5], evaluate=slow_evaluate)
    assert clock.marks == [0.05, 0.12]  # marks past the budget are dropped; the budget's end is one
    clock.record(0, [0.0])
    step, stop = 0, False
    while not stop:
        step += 1
        clock.step_begin()
        time.sleep(0.02)
        stop = clock.step_end(step)
    assert len(evaluations) == 3  # step 0, the 0.05 s mark, the budget's end
    assert clock.eval_seconds >= 0.45
    assert clock.train_seconds == pytest.approx(sum(clock.step_times))
    assert 0.12 <= clock.train_seconds < 0.12 + 0.1  # stopped at the first step end after the budget
    points = clock.points
    assert [p["step"] for p in points][0] == 0 and points[0]["train_seconds"] == 0.0
    assert points[1]["marks"] == [0.05] and points[-1]["marks"] == [0.12] and points[-1]["step"] == step
    assert points[-1]["accuracy/level1"] == 0.75 and "tokens_per_s" not in points[-1]
    clock.finish(step)  # the last step already has its point
    assert len(clock.points) == 3


def test_one_step_crossing_several_marks_is_evaluated_once():
    clock = curves.CurveClock(budget_s=10.0, eval_at_s=[0.01, 0.02, 0.03], evaluate=lambda: {"accuracy": 0.0})
    clock.step_begin()
    time.sleep(0.05)
    assert clock.step_end(1) is False
    assert len(clock.points) == 1 and clock.points[0]["marks"] == [0.01, 0.02, 0.03]


# ------------------------------------------------------------------------------------------------ settings
def test_overrides_parse_as_yaml_scalars_per_method():
    parsed = curves.parse_overrides(
        ["sigma=0.003", "dart-es:perturbation=lowrank", "use_vllm=true", "es:x=1e-3"]
    )
    assert parsed == {"*": {"sigma": 0.003, "use_vllm": True}, "dart-es": {"perturbation": "lowrank"},
                      "es": {"x": 1e-3}}  # fmt: skip
    assert curves.overrides_for("dart-es", parsed) == {
        "sigma": 0.003,
        "use_vllm": True,
        "perturbation": "lowrank",
    }
    with pytest.raises(ValueError):
        curves.parse_overrides(["sigma"])
    with pytest.raises(ValueError):
        curves.parse_overrides(["nope:sigma=1"])
    workload, config = curves.split_overrides(bench.SHORT, {"max_completion_length": 64, "sigma": 0.01})
    assert workload.max_completion_length == 64 and config == {"sigma": 0.01}


def test_settings_name_the_config_and_what_was_overridden():
    a = curves.curve_settings("dart-es", curves.CURVES, 900, [150, 300, 1200])
    assert a["eval_at_s"] == [150.0, 300.0, 900.0] and a["config"] == "recipes/configs/quickstart.yaml"
    assert a["config_sha256"] and a["workload"]["eval_prompts"] == 512 and a["workload"]["population"]
    b = curves.curve_settings("dart-es", curves.CURVES, 900, [150, 300], {"sigma": 0.01}, tag="s")
    assert b["overrides"] == {"sigma": 0.01} and b["tag"] == "s" and a != b
    demo = yaml.safe_load((ROOT / "recipes" / "configs" / "quickstart.yaml").read_text())
    assert a["workload"]["task_version"] == demo["task_version"]  # the demo's task, for every method
    v1 = curves.curve_settings("dart-es", replace(curves.CURVES, task_version=1), 900, [150])
    assert v1["workload"]["task_version"] == 1 and v1 != curves.curve_settings(
        "dart-es", curves.CURVES, 900, [150]
    )
    assert curves.curve_run_path("d", "es", 2).name == "es-seed2.json"
    assert curves.curve_run_path("d", "es", 2, "s").name == "es-seed2-s.json"


def test_config_digest_follows_values_not_comments(tmp_path):
    base = tmp_path / "a.yaml"
    base.write_text("sigma: 0.002\nlearning_rate: 1.0e-3\n")
    commented = tmp_path / "b.yaml"
    commented.write_text("# why sigma is what it is\nlearning_rate:   1.0e-3\nsigma: 0.002  # tuned\n")
    changed = tmp_path / "c.yaml"
    changed.write_text("sigma: 0.003\nlearning_rate: 1.0e-3\n")
    assert curves.config_digest(base) == curves.config_digest(commented)
    assert curves.config_digest(base) != curves.config_digest(changed)


# ------------------------------------------------------------------------------------------------ report
def _fake_run(method, seed, accs, settings, peak=2048.0):
    """A finished run with points at step 0 and at the marks 300, 600, 900 s (each a little after its mark)."""
    points = [
        {"step": 0, "train_seconds": 0.0, "accuracy": accs[0], "marks": [0.0], "accuracy/level1": accs[0]}
    ]
    for i, (mark, acc) in enumerate(zip([300.0, 600.0, 900.0], accs[1:], strict=True)):
        points.append({"step": 10 * (i + 1), "train_seconds": mark + 7.0, "accuracy": acc, "marks": [mark],
                       "accuracy/level1": acc + 0.1, "accuracy/level2": acc - 0.1})  # fmt: skip
    return {"method": method, "seed": seed, "status": "ok", "eval_prompts": 512, "peak_mem_mb": peak,
            "points": points, "steps": 30, "budget_s": 900.0, "machine": "test machine",
            "date": "2026-01-01 00:00 UTC", "command": "python -m trl_dart_es.benchmark --curves",
            "settings": settings}  # fmt: skip


def test_report_tables_paired_intervals_and_plot(tmp_path):
    settings = curves.curve_settings("dart-es", curves.CURVES, 900, [300, 600, 900])
    runs = []
    for seed, (d, e, g) in enumerate([(0.30, 0.28, 0.24), (0.32, 0.33, 0.26), (0.35, 0.32, 0.30)]):
        runs += [
            _fake_run("dart-es", seed, [0.2, 0.25, 0.28, d], settings),
            _fake_run("es", seed, [0.2, 0.24, 0.27, e], settings),
            _fake_run("grpo", seed, [0.2, 0.22, 0.23, g], settings, peak=8192.0),
        ]
    assert curves.point_at(runs[0], 600.0)["step"] == 20  # the point evaluated for the mark
    assert curves.point_at(runs[0], 450.0)["step"] == 10  # else the last one before
    assert curves.report_times(900.0) == [300.0, 600.0, 900.0]
    assert curves.report_times(90.0) == [60 * 1.5]
    # Evaluated at 7.5 and 15 min only: the columns are those marks, not 5 min relabelling step 0.
    assert curves.report_times(900.0, [450.0, 900.0]) == [450.0, 900.0]
    assert curves.report_times(900.0, [150.0 * k for k in range(1, 7)]) == [300.0, 600.0, 900.0]
    assert curves.common_eval_marks(runs) == sorted(map(float, settings["eval_at_s"]))
    assert curves.common_eval_marks([*runs, {"settings": {}}]) is None

    for run in runs:  # seeds run in two invocations: the report names both
        run["command"] += " --seeds 0" if run["seed"] == 0 else " --seeds 1 2"
    paths = curves.write_curve_report(runs, tmp_path / "out", tmp_path / "img" / "curves.png")
    md = paths["md"].read_text()
    assert (
        "- Commands: `python -m trl_dart_es.benchmark --curves --seeds 0`, `python -m trl_dart_es.benchmark "
        in md
    )
    assert md.count("--seeds 1 2`") == 1
    assert (
        "| dart-es | 0, 1, 2 | 20.0 (20.0–20.0) | 25.0 (25.0–25.0) | 28.0 (28.0–28.0) | 32.3 (30.0–35.0) |"
        in md
    )
    assert "| grpo | 0, 1, 2 |" in md and "| 8.00 (8.00–8.00) |" in md
    # dart-es - es at 15 min: +2, -1, +3 points: the interval includes zero.
    es_row = next(line for line in md.splitlines() if line.startswith("| dart-es − es | 15 min |"))
    assert "seed 0: +2.0, seed 1: -1.0, seed 2: +3.0" in es_row and "interval includes zero" in es_row
    # dart-es - grpo at 15 min: +6, +6, +5 points: it does not.
    grpo_row = next(line for line in md.splitlines() if line.startswith("| dart-es − grpo | 15 min |"))
    assert "| +5.7 | [+4.2, +7.1] | interval excludes zero |" in grpo_row
    assert "| method | level1 | level2 |" in md and "| untrained (step 0) | 20.0 (20.0–20.0) | – |" in md

    assert "- Machine: test machine;" in md
    report = json.loads(paths["json"].read_text())
    assert len(report["runs"]) == 9 and report["summary"]["paired"]
    runs[0]["machine"] = "Other CPU, 2 cores"  # runs from two machines: the report counts each
    md = curves.write_curve_report(runs, tmp_path / "out", tmp_path / "img" / "curves.png")["md"].read_text()
    assert "- Machines (each run's file names its own): test machine (8 runs), Other CPU (1 run);" in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_step0_cache_is_keyed_by_the_held_out_rows_and_the_backend(tmp_path, monkeypatch):
    """The untrained embedded model's metrics are shared by every transformers-evaluated method and seed."""
    import torch

    monkeypatch.setenv("TRL_DART_ES_CACHE", str(tmp_path))
    args = SimpleNamespace(reward_weights=[1.0, 0.1], use_vllm=False)
    trainer = SimpleNamespace(args=args, model=torch.nn.Linear(2, 2))
    workload = replace(bench.SHORT, model="embedded:smollm2-135m", max_completion_length=40)
    key = curves._step0_cache_path(trainer, workload, "es", _split(4, "test"))
    assert key.parent == tmp_path / "baselines"
    assert curves._step0_cache_path(trainer, workload, "grpo", _split(4, "test")) == key
    assert curves._step0_cache_path(trainer, workload, "es", _split(5, "test")) != key
    vllm = SimpleNamespace(
        args=SimpleNamespace(reward_weights=[1.0, 0.1], use_vllm=True), model=trainer.model
    )
    assert curves._step0_cache_path(vllm, workload, "es", _split(4, "test")) != key
    local = replace(workload, model=str(tmp_path))  # only embedded models are cached
    assert curves._step0_cache_path(trainer, local, "es", _split(4, "test")) is None


def test_an_es_trainer_on_vllm_evaluates_through_its_engine():
    """With use_vllm, DART-ES's curve points come from DartESTrainer.evaluate_dataset, keys as evaluate_greedy's."""
    from trl_dart_es.benchmark.evaluation import evaluate_trainer

    data = _split(3, "test")
    seen = []
    trainer = SimpleNamespace(
        es_params=SimpleNamespace(is_perturbed=False),
        args=SimpleNamespace(use_vllm=True),
        evaluate_dataset=lambda d: seen.append(d) or {"eval_accuracy": 0.5, "eval_accuracy/level1": 1.0},
    )
    got = evaluate_trainer(trainer, bench.SHORT, data, vllm_path=True)
    assert got == {"accuracy": 0.5, "accuracy/level1": 1.0} and seen == [data]


# ------------------------------------------------------------------------------- end to end on a tiny model
def _split(n, split):
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i} + {i + 1}?"}] for i in range(n)],
            "answer": [str(2 * i + 1) for i in range(n)],
            "id": [f"{split}-{i}" for i in range(n)],
            "level": [1 + i % 2 for i in range(n)],
        }
    )


@pytest.fixture
def tiny_model_and_levels(tmp_path, tiny_lm, tokenizer):
    model_dir, data_dir = tmp_path / "model", tmp_path / "data"
    tiny_lm.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    DatasetDict(train=_split(16, "train"), test=_split(6, "test")).save_to_disk(str(data_dir))
    return str(model_dir), str(data_dir)


def test_curves_end_to_end_on_a_tiny_model_and_rerun_skips(tmp_path, tiny_model_and_levels, capsys):
    model_dir, data_dir = tiny_model_and_levels
    budget_s = 3.0
    args = ["--curves", "--methods", "dart-es,grpo", "--seeds", "0", "--model", model_dir, "--dataset", data_dir,
            "--population", "2", "--prompts", "2", "--max-completion-length", "4", "--eval-prompts", "4",
            "--eval-batch-size", "4", "--budget-minutes", str(budget_s / 60), "--eval-at-minutes", "0.02",
            "--runs-dir", str(tmp_path / "runs"), "--output-dir", str(tmp_path / "report"),
            "--image", str(tmp_path / "report" / "curves.png"), "--no-progress"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "trl_dart_es.benchmark", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    report = json.loads((tmp_path / "report" / "curves.json").read_text())
    assert set(report) == {"runs", "summary"}
    assert [(r["method"], r["seed"]) for r in report["runs"]] == [("dart-es", 0), ("grpo", 0)]
    for run in report["runs"]:
        assert {"method", "seed", "eval_prompts", "peak_mem_mb", "points", "machine", "date", "command",
                "settings"} <= set(run)  # fmt: skip
        assert run["eval_prompts"] == 4 and run["peak_mem_mb"] > 0 and run["status"] == "ok"
        points = run["points"]
        assert points[0]["step"] == 0 and points[0]["train_seconds"] == 0.0
        assert all(
            {"step", "train_seconds", "accuracy", "accuracy/level1", "accuracy/level2"} <= set(p)
            for p in points
        )
        assert [p["step"] for p in points] == sorted({p["step"] for p in points})
        # Training time is the steps' own: evaluation (and loading) is not in it, and it stops at the budget.
        assert run["train_seconds"] == pytest.approx(sum(run["step_times_s"]))
        assert points[-1]["train_seconds"] == pytest.approx(run["train_seconds"])
        assert run["stop"] == "budget" and budget_s <= run["train_seconds"] < budget_s + max(
            run["step_times_s"]
        )
        assert run["train_seconds"] + run["eval_seconds"] < run["wall_s"]
        assert points[-1]["marks"] == [budget_s] and any(p["marks"] == [1.2] for p in points)
        assert (tmp_path / "runs" / f"{run['method']}-seed0.json").is_file()
    md = (tmp_path / "report" / "curves.md").read_text()
    assert "| dart-es | 0 |" in md and "| grpo | 0 |" in md
    assert "| dart-es − grpo | 3 s | seed 0:" in md and "one seed: no interval" in md
    assert "| method | level1 | level2 |" in md
    assert (tmp_path / "report" / "curves.png").read_bytes()[:4] == b"\x89PNG"

    # A rerun with the same settings trains nothing (in-process: the skip happens before any child starts).
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "runs").iterdir()}
    capsys.readouterr()
    runs = bench.main(args)
    out = capsys.readouterr().out
    assert "skip dart-es seed 0" in out and "skip grpo seed 0" in out and "run dart-es" not in out
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "runs").iterdir()} == stamps
    assert [r["method"] for r in runs] == ["dart-es", "grpo"]


def test_the_step_clock_keeps_both_readings_of_the_same_steps():
    """One clock for every measurement: begin-to-end step times (a budget's training seconds) and end-to-end
    times (the side-by-side benchmark's step time, which also counts what runs between steps)."""
    from transformers import TrainerControl, TrainerState

    from trl_dart_es.benchmark.clock import StepClock

    shown: list[str] = []
    clock = StepClock(progress=shown.append)
    callback = clock.callback()
    state, control = TrainerState(max_steps=3), TrainerControl()
    callback.on_train_begin(None, state, control)
    for step in range(1, 4):
        time.sleep(0.02)  # between steps: in the end-to-end reading only
        state.global_step = step
        callback.on_step_begin(None, state, control)
        time.sleep(0.01)
        callback.on_step_end(None, state, control)
    assert len(clock.step_times) == len(clock.wall_step_times) == 3
    assert all(w >= s + 0.02 for w, s in zip(clock.wall_step_times, clock.step_times, strict=True))
    assert clock.train_seconds == pytest.approx(sum(clock.step_times))
    assert sorted(clock.at_step) == [1, 2, 3] and clock.at_step[3] == clock.train_seconds
    assert shown == ["train 0/3", "train 1/3", "train 2/3", "train 3/3"]
    assert not control.should_training_stop and not control.should_evaluate  # no budget, no evaluation asked
