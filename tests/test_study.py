"""The learning study's presets of `--curves` (trl_dart_es/benchmark/study.py, benchmarks/study_presets.yaml):
every preset is a valid trainer config."""

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from trl_dart_es.benchmark import study
from trl_dart_es.benchmark.clock import StepClock

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(study.presets()))
def test_every_variant_builds_a_valid_config(name, tmp_path):
    # A misspelled or out-of-range override fails here (DartESConfig checks its values), not an hour into a run.
    overrides = study.presets()[name]
    script_args, cfg, _, style, budget = study.preset_config(
        name, seed=3, output_dir=str(tmp_path), eval_every=10
    )
    for key, value in overrides.items():
        if key not in (*study.HARNESS_KEYS, "max_steps", "reward_funcs"):
            if isinstance(getattr(cfg, key), dict) and isinstance(value, str):  # a dict field given as JSON
                value = json.loads(value)
            assert getattr(cfg, key) == value, key
    # A variant's reward functions reach the recipe's TaskArguments, one weight per function.
    assert script_args.reward_funcs == overrides.get("reward_funcs")
    funcs = script_args.load_reward_funcs()
    assert [f.__name__ for f in funcs][:2] == ["gsm8k_accuracy_reward", "gsm8k_format_reward"]
    assert cfg.reward_weights is None or len(cfg.reward_weights) == len(funcs)
    assert cfg.seed == 3
    assert style == overrides.get("prompt_style", "steps")
    assert budget == overrides.get("budget_minutes")
    version = overrides.get("task_version")
    assert study.task_options(name) == ({} if version is None else {"version": version})
    # A time budget replaces the step count; otherwise the variant's (or the quickstart's) steps stand.
    quickstart_steps = yaml.safe_load(study.CONFIG.read_text())["max_steps"]
    assert cfg.max_steps == (10_000 if budget else overrides.get("max_steps", quickstart_steps))


def test_a_misspelled_override_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setitem(study.presets(), "typo", {**study.presets()["lr-answer32"], "sigmaa": 1e-3})
    with pytest.raises((ValueError, TypeError), match="sigmaa"):
        study.preset_config("typo", seed=0, output_dir=str(tmp_path), eval_every=10)


def test_pairs_name_defined_variants():
    for first, second in study.pairs():
        assert first in study.presets() and second in study.presets()


def test_train_clock_evaluates_the_last_step_and_stops_at_the_budget():
    from transformers import TrainerControl, TrainerState

    clock = StepClock(budget_s=None)
    callback = clock.callback(evaluate_last=True)
    state, control = TrainerState(max_steps=8), TrainerControl()
    for step in range(1, 9):
        state.global_step = step
        callback.on_step_begin(None, state, control)
        callback.on_step_end(None, state, control)
        assert control.should_evaluate == (step == 8), step
        control.should_evaluate = False
    assert not control.should_training_stop and sorted(clock.at_step) == list(range(1, 9))

    timed = StepClock(budget_s=0.0).callback(evaluate_last=True)  # any step spends the budget
    state, control = TrainerState(max_steps=100), TrainerControl()
    state.global_step = 1
    timed.on_step_begin(None, state, control)
    timed.on_step_end(None, state, control)
    assert control.should_training_stop and control.should_evaluate


def test_the_v1_demo_config_is_the_study_variant_it_names():
    """quickstart_v1.yaml (the demo before the wider task) runs the study's `demo` variant: N4xB32 for a fixed
    step count, default LoRA kernel."""
    demo = yaml.safe_load((ROOT / "recipes" / "configs" / "quickstart_v1.yaml").read_text())
    variant = study.presets()["demo"]
    assert {k: demo.get(k) for k in variant} == variant
    base = yaml.safe_load(study.CONFIG.read_text())  # what the variant does not override is the study's base
    # Where it writes and what it logs do not change the trajectory.
    logging = {"report_to", "project", "log_completions", "num_completions_to_print"}
    rest = set(demo) - set(variant) - {"output_dir", "eval_num_examples"} - logging
    assert {k: demo[k] for k in rest} == {k: base.get(k) for k in rest}
    assert "vllm_lora_kernel" not in demo and demo["eval_num_examples"] >= 256
    # Against the confirmed N4xB32 variant only the run length (steps, not a time budget) and the kernel differ.
    confirmed = study.presets()["vl-answer64-n4b32-anti"]
    differ = {k for k in {*confirmed, *variant} if confirmed.get(k) != variant.get(k)}
    assert differ == {"budget_minutes", "vllm_lora_kernel", "max_steps"}


def _as_measured(config: dict) -> dict:
    """A recipe config with `generation_dtype: auto` as the study ran it: bf16 (its machines compute bf16)."""
    return {**config, "generation_dtype": "bfloat16"} if config.get("generation_dtype") == "auto" else config


def test_the_demo_config_is_the_study_variant_it_names():
    """quickstart.yaml (the demo) is the v1 demo with v2-n16b8-lr2's overrides, `auto` generation precision (bf16
    where the study measured it) and the study's 512 held-out prompts, so the study's five seeds
    are its measurements; its settings reach the recipe's parser."""
    from trl import ModelConfig, TrlParser

    from trl_dart_es import DartESConfig
    from trl_dart_es.precision import resolve_generation_dtype
    from trl_dart_es.tasks.arguments import TaskArguments

    configs = ROOT / "recipes" / "configs"
    demo = yaml.safe_load((configs / "quickstart.yaml").read_text())
    v1 = yaml.safe_load((configs / "quickstart_v1.yaml").read_text())
    # eval_every is the study's clock, not a config field.
    variant = {k: v for k, v in study.presets()["v2-n16b8-lr2"].items() if k != "eval_every"}
    assert demo["generation_dtype"] == "auto"
    assert {k: _as_measured(demo).get(k) for k in variant} == variant
    assert demo["eval_num_examples"] == 512
    where = {"output_dir", "project", "eval_num_examples", "completions_print_steps"}  # console only
    assert {k: v for k, v in demo.items() if k not in {*variant, *where}} == {
        k: v for k, v in v1.items() if k not in {*variant, *where}
    }
    task, args, _ = TrlParser((TaskArguments, DartESConfig, ModelConfig)).parse_args_and_config(
        ["--config", str(configs / "quickstart.yaml"), "--output_dir", "unused"]
    )
    assert task.task_version == 2 and task.eval_num_examples == 512
    assert (args.population_size, args.per_device_train_batch_size, args.learning_rate) == (16, 8, 0.002)
    # `auto` is the study's bf16 on a CPU with bf16 units, and fp32 on one without.
    for flags, dtype in (("avx512f amx_bf16", torch.bfloat16), ("avx2", torch.float32)):
        cpuinfo = f"flags\t: fpu {flags}\n"
        assert (
            resolve_generation_dtype(args.generation_dtype, torch.float32, on_cuda=False, cpuinfo=cpuinfo)
            == dtype
        )
    assert ("v2-n16b8-lr2", "v2-demo") in study.pairs()


def test_the_plain_es_twins_differ_only_in_the_two_dart_switches():
    """`demo-es` and `v2-n16b8-lr2-es` are their presets with DART-ES's two switches off, nothing else changed;
    es_quickstart.yaml is the demo's twin as the study runs it."""
    for dart, twin in (("demo", "demo-es"), ("v2-n16b8-lr2", "v2-n16b8-lr2-es")):
        on, off = study.presets()[dart], study.presets()[twin]
        differ = {k for k in {*on, *off} if on.get(k) != off.get(k)}
        assert differ == {"use_difficulty_reweighting", "use_targeted_replay"}, twin
        assert not off["use_difficulty_reweighting"] and not off["use_targeted_replay"]
        assert (dart, twin) in study.pairs()
    es = _as_measured(yaml.safe_load((ROOT / "recipes" / "configs" / "es_quickstart.yaml").read_text()))
    twin = {k: v for k, v in study.presets()["v2-n16b8-lr2-es"].items() if k != "eval_every"}
    assert {k: es.get(k) for k in twin} == twin


def test_pairs_compare_final_accuracy_and_gain_by_seed():

    def run(variant, seed, start, end):
        return {"variant": variant, "seed": seed, "points": [{"accuracy": start}, {"accuracy": end}]}

    runs = [
        run("a", 0, 0.30, 0.40),
        run("a", 1, 0.30, 0.36),
        run("b", 0, 0.20, 0.25),
        run("b", 1, 0.20, 0.24),
    ]
    runs.append(run("b", 2, 0.20, 0.30))  # no twin: not paired
    (pair,) = study._paired(runs, [("a", "b")])
    assert pair["seeds"] == [0, 1]
    assert pair["differences"] == pytest.approx([0.15, 0.12])
    assert pair["gain_differences"] == pytest.approx([0.05, 0.02])
    assert pair["gain_mean"] == pytest.approx(0.035) and pair["gain_ci95"][0] < 0.035 < pair["gain_ci95"][1]
    assert pair["seeds_on_two_cpus"] == []
    # One seed's twin ran on another CPU model (bf16 rounds differently there): the pair names it.
    for r in runs:
        r["machine"] = "AMD EPYC, 2 cores" if (r["variant"], r["seed"]) == ("b", 1) else "Intel Xeon, 2 cores"
    (pair,) = study._paired(runs, [("a", "b")])
    assert pair["seeds_on_two_cpus"] == [1]


def test_a_variant_may_set_its_own_eval_interval(tmp_path):
    import argparse

    args = argparse.Namespace(eval_prompts=256, eval_every=10)
    assert study.eval_every("demo", args) == 10
    assert study.eval_every("demo-long", args) == study.presets()["demo-long"]["eval_every"] != 10
    every = study.eval_every("demo-long", args)
    _, cfg, *_ = study.preset_config("demo-long", seed=0, output_dir=str(tmp_path), eval_every=every)
    assert cfg.eval_steps == every
    # A rerun at another interval is another run.
    assert study._settings("demo-long", args)["eval_every"] == every


def test_a_variant_may_train_on_some_levels_only():
    # The train set keeps only the variant's levels (the held-out set is the study's, all levels).
    levels = study.presets()["demo-l12"]["train_levels"]
    train = study.train_split("demo-l12", "embedded:gsm8k", "answer")
    assert sorted(set(train["level"])) == sorted(levels) and len(train) > 0
    assert sorted(set(study.train_split("demo", "embedded:gsm8k", "answer")["level"])) == [1, 2, 3]


def test_the_closeness_reward_scores_distance_to_the_answer():
    sys.path.insert(0, str(ROOT))
    from benchmarks.closeness_reward import gsm8k_closeness_reward as closeness

    scores = closeness(["#### 10", "#### 20", "so 15", "no number", "#### 3"], ["10", "10", "10", "10", "x"])
    assert scores[0] == 1.0 and scores[1] == pytest.approx(0.5) and scores[3] == 0.0 and scores[4] is None
    assert scores[1] < scores[2] < scores[0]  # nearer is better, by the last number when there is no ####


def test_a_preset_applies_its_bases_then_drops_then_its_own_keys(tmp_path):
    path = tmp_path / "presets.yaml"
    path.write_text(
        "_a: {x: 1, y: 2, z: 3}\n_b: {y: 20}\n"
        "p: {base: [_a, _b], drop: [z], x: 10, w: 4}\n"
        "q: {base: p, drop: [w], z: 30}\n"
        "_pairs: [[p, q]]\n"
    )
    presets, pairs = study.load_presets(path)
    assert list(presets) == ["p", "q"] and pairs == [("p", "q")]
    assert list(presets["p"].items()) == [("x", 10), ("y", 20), ("w", 4)]  # a base's key keeps its place
    assert list(presets["q"].items()) == [("x", 10), ("y", 20), ("z", 30)]


def test_the_study_report_rebuilds_from_the_run_files_through_the_harness(tmp_path, capsys):
    """`--curves --preset` (no names) writes study.{json,md,png} from the finished runs; old runs still count."""
    from trl_dart_es import benchmark as bench

    runs = tmp_path / "runs"
    runs.mkdir()
    settings = {"variant": study.presets()["demo"], "eval_prompts": 256, "eval_every": 10}
    for seed, end in ((0, 0.30), (1, 0.32)):
        run = {"variant": "demo", "seed": seed, "settings": settings, "train_seconds": 600.0,
               "points": [{"step": 0, "train_seconds": 0.0, "accuracy": 0.25, "groups": {}},
                          {"step": 18, "train_seconds": 600.0, "accuracy": end, "groups": {}}],
               "machine": "cpu, 2 cores", "date": "2026-12-01 00:00 UTC"}  # fmt: skip
        (runs / f"demo-seed{seed}.json").write_text(json.dumps(run))
    stale = {**run, "seed": 2, "settings": {**settings, "eval_prompts": 128}}  # other settings: left out
    (runs / "demo-seed2.json").write_text(json.dumps(stale))
    bench.main(["--curves", "--preset", "--runs-dir", str(runs), "--output-dir", str(tmp_path / "out")])
    md = (tmp_path / "out" / "study.md").read_text()
    assert "| demo | 0, 1 | 2304 | 25.0% | 31.0% | +6.0 |" in md
    command = "`python -m trl_dart_es.benchmark --curves --preset <variant> --seeds <seeds>"
    assert f"{command} --runs-dir {runs} --output-dir {tmp_path / 'out'}`" in md  # the flags that rebuild it
    assert (tmp_path / "out" / "study.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="unknown presets"):
        bench.main(["--curves", "--preset", "no-such-preset", "--runs-dir", str(runs)])
    with pytest.raises(SystemExit, match="--methods"):
        bench.main(["--curves", "--preset", "demo", "--methods", "grpo"])


def test_a_preset_runs_end_to_end_through_the_harness_and_a_rerun_skips(tmp_path, monkeypatch, capsys):
    """`--curves --preset` trains in-process on the embedded model, evaluates at step 0 (through the one cache of
    the untrained score) and every --eval-every steps, and writes the run; a rerun trains nothing."""
    from trl_dart_es import benchmark as bench

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRL_DART_ES_CACHE", str(tmp_path / "cache"))
    tiny = {**study.presets()["lr-answer32"], "population_size": 2, "per_device_train_batch_size": 2,
            "max_completion_length": 4, "max_steps": 2, "validation_prompts": 3}  # fmt: skip
    monkeypatch.setitem(study.presets(), "tiny", tiny)
    argv = ["--curves", "--preset", "tiny", "--seeds", "0", "--eval-prompts", "4", "--eval-every", "1",
            "--runs-dir", str(tmp_path / "runs"), "--output-dir", str(tmp_path / "out")]  # fmt: skip
    bench.main(argv)
    run = json.loads((tmp_path / "runs" / "tiny-seed0.json").read_text())
    assert run["settings"] == {"variant": tiny, "eval_prompts": 4, "eval_every": 1}
    assert [p["step"] for p in run["points"]] == [0, 1, 2]
    seconds = [p["train_seconds"] for p in run["points"]]
    assert seconds[0] == 0.0 < seconds[1] < seconds[2] == pytest.approx(run["train_seconds"])
    assert len(list((tmp_path / "cache" / "baselines").glob("*.json"))) == 1
    # Scored on validation wherever scored on test: the report picks a checkpoint on it.
    assert all(0.0 <= p["validation_accuracy"] <= 1.0 for p in run["points"])
    page = (tmp_path / "out" / "study.md").read_text()
    assert "| tiny | 0 | 8 |" in page
    picked = study.picked_on_validation(run)
    assert f"| tiny | 0 | {picked['step']} |" in page
    capsys.readouterr()
    bench.main(argv)
    assert "skip tiny seed 0: finished" in capsys.readouterr().out


def test_a_task_version_preset_trains_and_evaluates_on_that_version():
    train = study.train_split("v2-demo", "embedded:gsm8k", "answer")
    assert "template" in train.column_names  # version 2's column
    assert "template" not in study.train_split("demo", "embedded:gsm8k", "answer").column_names


def test_the_transfer_table_gives_each_gain_with_its_interval_and_smallest_seed():
    """Held-out templates and wordings: before -> after over the seeds, the gain's t-interval and its minimum."""
    from trl_dart_es.benchmark.stats import paired_t_interval

    keys = ("template_held_out", "template_seen", "wording_held_out", "wording_seen")
    runs = []
    for seed, (start, end) in enumerate(((0.10, 0.14), (0.12, 0.13), (0.11, 0.17))):
        groups0 = {k: start for k in keys}
        groups1 = {k: end if k == "template_held_out" else start for k in keys}
        runs.append({"variant": "v2-demo", "seed": seed, "points": [
            {"step": 0, "accuracy": 0.2, "groups": groups0}, {"step": 18, "accuracy": 0.2, "groups": groups1}]})  # fmt: skip
    lines = study._transfer_table(runs)
    row = next(line for line in lines if line.startswith("| v2-demo |"))
    gains = [0.04, 0.01, 0.06]
    _, lo, hi = paired_t_interval(gains)
    held_out = row.split(" | ")[2]
    assert held_out == f"11.0% → 14.7% (+3.7 [{100 * lo:+.1f}, {100 * hi:+.1f}], min +1.0)"
    assert row.split(" | ")[3] == "11.0% → 11.0% (+0.0 [+0.0, +0.0], min +0.0)"
    one_seed = study._transfer_table(runs[:1])
    assert "11.0%" not in one_seed[-1] and one_seed[-1].split(" | ")[2] == "10.0% → 14.0% (+4.0)"


def test_the_checkpoint_picked_on_validation_is_the_first_best_and_its_test_gain_is_reported():
    """Each run's point with the best validation accuracy (the first of equals, as load_best_model_at_end keeps
    it); the table gives its test gain against the last point's, paired by run."""
    from trl_dart_es.benchmark.stats import paired_t_interval

    def run(seed, accs, vals, held):
        points = [
            {"step": 9 * i, "accuracy": a, "validation_accuracy": v, "groups": {"template_held_out": h}}
            for i, (a, v, h) in enumerate(zip(accs, vals, held, strict=True))
        ]
        return {"variant": "v2-n16b8-lr2-val", "seed": seed, "points": points}

    runs = [
        run(0, [0.20, 0.25, 0.22], [0.30, 0.34, 0.34], [0.10, 0.12, 0.08]),  # a tie: the first of the two
        run(1, [0.20, 0.19, 0.24], [0.30, 0.29, 0.33], [0.10, 0.09, 0.13]),  # the last
        run(2, [0.21, 0.18, 0.19], [0.30, 0.28, 0.29], [0.10, 0.09, 0.08]),  # none better than before: step 0
    ]
    assert [study.picked_on_validation(r)["step"] for r in runs] == [9, 18, 0]
    assert study.picked_on_validation({"points": [{"step": 0, "accuracy": 0.2}]}) is None
    row = next(line for line in study._picked_table(runs) if line.startswith("| v2-n16b8-lr2-val |"))
    cells = row.split(" | ")
    assert cells[2] == "9, 18, 0"
    gains = [0.05, 0.04, 0.0]
    _, lo, hi = paired_t_interval(gains)
    assert cells[3] == f"+3.0 [{100 * lo:+.1f}, {100 * hi:+.1f}]; +5.0, +4.0, +0.0"
    assert cells[4] == "+1.3"  # the last points: +2.0, +4.0, -2.0
    _, lo, hi = paired_t_interval([0.03, 0.0, 0.02])
    assert cells[5] == f"+1.7 [{100 * lo:+.1f}, {100 * hi:+.1f}]"
    assert cells[6] == "+1.7, min +0.0 |"  # +2.0, +3.0, +0.0
    # Runs without validation scores get no row.
    assert study._picked_table([{**runs[0], "points": [{"step": 0, "accuracy": 0.2}]}]) == []
