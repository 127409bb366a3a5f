"""The learning study's runner (benchmarks/study.py): every variant is a valid trainer config."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def _load_study():
    spec = importlib.util.spec_from_file_location("dart_es_study", ROOT / "benchmarks" / "study.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


study = _load_study()


@pytest.mark.parametrize("name", sorted(study.VARIANTS))
def test_every_variant_builds_a_valid_config(name, tmp_path):
    # A misspelled or out-of-range override fails here (DartESConfig checks its values), not an hour into a run.
    overrides = study.VARIANTS[name]
    script_args, cfg, _, style, budget = study.variant_config(
        name, seed=3, output_dir=str(tmp_path), eval_every=10
    )
    for key, value in overrides.items():
        if key not in (
            "prompt_style",
            "budget_minutes",
            "max_steps",
            "reward_funcs",
            "eval_every",
            "train_levels",
        ):
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
    # A time budget replaces the step count; otherwise the variant's (or the quickstart's) steps stand.
    quickstart_steps = yaml.safe_load(study.CONFIG.read_text())["max_steps"]
    assert cfg.max_steps == (10_000 if budget else overrides.get("max_steps", quickstart_steps))


def test_a_misspelled_override_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setitem(study.VARIANTS, "typo", {**study.VARIANTS["lr-answer32"], "sigmaa": 1e-3})
    with pytest.raises((ValueError, TypeError), match="sigmaa"):
        study.variant_config("typo", seed=0, output_dir=str(tmp_path), eval_every=10)


def test_pairs_name_defined_variants():
    for first, second in study.PAIRS:
        assert first in study.VARIANTS and second in study.VARIANTS


def test_train_clock_evaluates_the_last_step_and_stops_at_the_budget():
    from transformers import TrainerControl, TrainerState

    clock = study._train_clock(budget_s=None)
    callback = clock.callback(evaluate_last=True)
    state, control = TrainerState(max_steps=8), TrainerControl()
    for step in range(1, 9):
        state.global_step = step
        callback.on_step_begin(None, state, control)
        callback.on_step_end(None, state, control)
        assert control.should_evaluate == (step == 8), step
        control.should_evaluate = False
    assert not control.should_training_stop and sorted(clock.at_step) == list(range(1, 9))

    timed = study._train_clock(budget_s=0.0).callback(evaluate_last=True)  # any step spends the budget
    state, control = TrainerState(max_steps=100), TrainerControl()
    state.global_step = 1
    timed.on_step_begin(None, state, control)
    timed.on_step_end(None, state, control)
    assert control.should_training_stop and control.should_evaluate


def test_the_demo_config_is_the_study_variant_it_names():
    """quickstart.yaml runs the study's `demo` variant: N4xB32 for a fixed step count, default LoRA kernel."""
    demo = yaml.safe_load((study.ROOT / "recipes" / "configs" / "quickstart.yaml").read_text())
    variant = study.VARIANTS["demo"]
    assert {k: demo.get(k) for k in variant} == variant
    base = yaml.safe_load(study.CONFIG.read_text())  # what the variant does not override is the study's base
    rest = set(demo) - set(variant) - {"output_dir", "eval_num_examples"}
    assert {k: demo[k] for k in rest} == {k: base.get(k) for k in rest}
    assert "vllm_lora_kernel" not in demo and demo["eval_num_examples"] >= 256
    # Against the confirmed N4xB32 variant only the run length (steps, not a time budget) and the kernel differ.
    confirmed = study.VARIANTS["vl-answer64-n4b32-anti"]
    differ = {k for k in {*confirmed, *variant} if confirmed.get(k) != variant.get(k)}
    assert differ == {"budget_minutes", "vllm_lora_kernel", "max_steps"}


def test_the_demo_es_twin_differs_only_in_the_two_dart_switches():
    """`demo-es` is es_quickstart.yaml as the study runs it: DART-ES's two switches off, nothing else changed."""
    demo, twin = study.VARIANTS["demo"], study.VARIANTS["demo-es"]
    differ = {k for k in {*demo, *twin} if demo.get(k) != twin.get(k)}
    assert differ == {"use_difficulty_reweighting", "use_targeted_replay"}
    assert not twin["use_difficulty_reweighting"] and not twin["use_targeted_replay"]
    es = yaml.safe_load((study.ROOT / "recipes" / "configs" / "es_quickstart.yaml").read_text())
    assert {k: es.get(k) for k in twin} == twin
    assert ("demo", "demo-es") in study.PAIRS


def test_pairs_compare_final_accuracy_and_gain_by_seed(monkeypatch):
    monkeypatch.setattr(study, "PAIRS", [("a", "b")])

    def run(variant, seed, start, end):
        return {"variant": variant, "seed": seed, "points": [{"accuracy": start}, {"accuracy": end}]}

    runs = [
        run("a", 0, 0.30, 0.40),
        run("a", 1, 0.30, 0.36),
        run("b", 0, 0.20, 0.25),
        run("b", 1, 0.20, 0.24),
    ]
    runs.append(run("b", 2, 0.20, 0.30))  # no twin: not paired
    (pair,) = study._paired(runs)
    assert pair["seeds"] == [0, 1]
    assert pair["differences"] == pytest.approx([0.15, 0.12])
    assert pair["gain_differences"] == pytest.approx([0.05, 0.02])
    assert pair["gain_mean"] == pytest.approx(0.035) and pair["gain_ci95"][0] < 0.035 < pair["gain_ci95"][1]


def test_a_variant_may_set_its_own_eval_interval(tmp_path):
    import argparse

    args = argparse.Namespace(eval_prompts=256, eval_every=10)
    assert study.eval_every("demo", args) == 10
    assert study.eval_every("demo-long", args) == study.VARIANTS["demo-long"]["eval_every"] != 10
    every = study.eval_every("demo-long", args)
    _, cfg, *_ = study.variant_config("demo-long", seed=0, output_dir=str(tmp_path), eval_every=every)
    assert cfg.eval_steps == every
    # A rerun at another interval is another run.
    assert study._settings("demo-long", args)["eval_every"] == every


def test_a_variant_may_train_on_some_levels_only():
    # The train set keeps only the variant's levels (the held-out set is the study's, all levels).
    levels = study.VARIANTS["demo-l12"]["train_levels"]
    train = study.train_split("demo-l12", "embedded:gsm8k", "answer")
    assert sorted(set(train["level"])) == sorted(levels) and len(train) > 0
    assert sorted(set(study.train_split("demo", "embedded:gsm8k", "answer")["level"])) == [1, 2, 3]


def test_the_closeness_reward_scores_distance_to_the_answer():
    sys.path.insert(0, str(ROOT))
    from benchmarks.closeness_reward import gsm8k_closeness_reward as closeness

    scores = closeness(["#### 10", "#### 20", "so 15", "no number", "#### 3"], ["10", "10", "10", "10", "x"])
    assert scores[0] == 1.0 and scores[1] == pytest.approx(0.5) and scores[3] == 0.0 and scores[4] is None
    assert scores[1] < scores[2] < scores[0]  # nearer is better, by the last number when there is no ####
