"""The learning study behind the defaults: which settings make DART-ES learn on the embedded model.

    python benchmarks/study.py --variants lr-answer32 --seeds 0      # screen one variant on one seed
    python benchmarks/study.py --variants lr-answer32 --seeds 0 1 2  # confirm (finished runs are skipped)
    python benchmarks/study.py --report                              # redraw results/study.{json,md,png}

Every variant is the pre-study demo recipe (recipes/configs/quickstart_fullrank.yaml, kept fixed) with the
overrides in `VARIANTS`, trained for the same number of rollouts (steps x N x B) unless the variant says
otherwise. Held-out: greedy accuracy of the unperturbed model on `--eval-prompts` test prompts (disjoint from
train), in the variant's prompt style and completion length, at step 0, every `--eval-every` steps and at the
last step. `train_seconds` counts ES steps only, not evaluation. Each finished (variant, seed) is written to
results/study_runs/ at once, so an interrupted study loses at most the run in progress.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RUNS_DIR = ROOT / "results" / "study_runs"
CONFIG = ROOT / "recipes" / "configs" / "quickstart_fullrank.yaml"

# The settings the quickstart had before this study (full rank, N=8, B=16, 40 tokens, 8 steps).
_OLD_QUICKSTART = {
    "perturbation": "full", "population_size": 8, "per_device_train_batch_size": 16, "max_completion_length": 40,
    "sigma": 2e-3, "learning_rate": 1e-3, "max_steps": 8, "prompt_style": "steps",
}  # fmt: skip
_LOWRANK = {
    "perturbation": "lowrank",
    "perturbation_rank": 1,
    "population_size": 8,
    "per_device_train_batch_size": 8,
}

# name -> overrides of quickstart_fullrank.yaml (plus `prompt_style`, a dataset option).
VARIANTS: dict[str, dict[str, Any]] = {
    "old-quickstart": _OLD_QUICKSTART,
    # Screens at 30 steps x 64 rollouts (= 1,920 rollouts), low rank.
    "lr-steps48": {**_OLD_QUICKSTART, **_LOWRANK, "max_completion_length": 48, "max_steps": 30},
    "lr-answer32": {
        **_OLD_QUICKSTART,
        **_LOWRANK,
        "max_completion_length": 32,
        "max_steps": 30,
        "prompt_style": "answer",
    },  # fmt: skip
}
_ANSWER32 = VARIANTS["lr-answer32"]
VARIANTS.update(
    {
        # More, antithetic members on fewer problems each: the same 64 rollouts per step.
        "lr-answer32-n16b4-anti": {
            **_ANSWER32, "population_size": 16, "per_device_train_batch_size": 4, "antithetic": True
        },
        "lr-answer32-n16b4-anti-lr2": {
            **_ANSWER32, "population_size": 16, "per_device_train_batch_size": 4, "antithetic": True,
            "learning_rate": 2e-3,
        },
        "lr-answer32-rank": {**_ANSWER32, "fitness_shaping": "rank"},
        "lr-answer24": {**_ANSWER32, "max_completion_length": 24},
    }
)  # fmt: skip
# The same, generating with vLLM (each member a LoRA adapter, the population in one generate): about twice
# the steps per minute, so these runs get an equal TRAIN-TIME budget instead of a step count.
_VLLM = {"use_vllm": True, "vllm_cpu_kvcache_space": 1, "budget_minutes": 8}
VARIANTS.update(
    {
        "vl-answer32": {**_ANSWER32, **_VLLM},
        "vl-answer32-n32b8-anti": {
            **_ANSWER32, **_VLLM, "population_size": 32, "per_device_train_batch_size": 8, "antithetic": True,
        },
        "vl-answer64-n16b8-anti": {
            **_ANSWER32, **_VLLM, "population_size": 16, "per_device_train_batch_size": 8, "antithetic": True,
            "max_completion_length": 64,
        },
        "vl-answer32-n16b8-anti-lr2": {
            **_ANSWER32, **_VLLM, "population_size": 16, "per_device_train_batch_size": 8, "antithetic": True,
            "learning_rate": 2e-3,
        },
    }
)  # fmt: skip
# Plain ES twin of the confirmed DART-ES variant: the two switches off, nothing else changed. Its DART-ES runs
# were measured before the grouped LoRA ops existed, so the twin keeps vLLM's own ops: the same code per step,
# the same train-time budget.
VARIANTS["vl-answer64-n16b8-anti-es"] = {
    **VARIANTS["vl-answer64-n16b8-anti"], "use_difficulty_reweighting": False, "use_targeted_replay": False,
    "vllm_lora_kernel": "vllm",
}  # fmt: skip
# A 4x larger step. With N = 16 each step moves a weight by about alpha / sqrt(N) = sigma / 8 at alpha = 1e-3, so
# the ~15 steps of an 8-minute budget move it about 2 sigma at most; this screens whether bigger steps pay.
VARIANTS["vl-answer64-n16b8-anti-lr4"] = {**VARIANTS["vl-answer64-n16b8-anti"], "learning_rate": 4e-3}
# One-setting screens of the confirmed variant: rank 4, a milder weight exponent, more replay, a larger sigma.
# Like the ES twin they keep vLLM's own LoRA ops, so each step runs the code the confirmed runs measured.
_CONFIRMED = {**VARIANTS["vl-answer64-n16b8-anti"], "vllm_lora_kernel": "vllm"}
VARIANTS.update(
    {
        "vl-answer64-n16b8-anti-r4": {**_CONFIRMED, "perturbation_rank": 4},
        "vl-answer64-n16b8-anti-k1": {**_CONFIRMED, "difficulty_weight_exponent": 1.0},
        "vl-answer64-n16b8-anti-replay4": {**_CONFIRMED, "replay_ratio": 0.4},
        "vl-answer64-n16b8-anti-s4": {**_CONFIRMED, "sigma": 4e-3},
        # Centred ranks instead of z-scores; the other population shapes the issue lists (same 128 rollouts
        # per step); the longest completion budget of the prompt probe.
        "vl-answer64-n16b8-anti-rank": {**_CONFIRMED, "fitness_shaping": "rank"},
        "vl-answer64-n32b4-anti": {**_CONFIRMED, "population_size": 32, "per_device_train_batch_size": 4},
        "vl-answer64-n8b16-anti": {**_CONFIRMED, "population_size": 8, "per_device_train_batch_size": 16},
        "vl-answer64-n4b32-anti": {**_CONFIRMED, "population_size": 4, "per_device_train_batch_size": 32},
        "vl-answer64-n2b64-anti": {**_CONFIRMED, "population_size": 2, "per_device_train_batch_size": 64},
        "vl-answer96-n16b8-anti": {**_CONFIRMED, "max_completion_length": 96},
    }
)
# The demo (recipes/configs/quickstart.yaml) as the study measures it: N4xB32 for a fixed 18 steps (about what
# the 8-minute budget gave), deterministic, with the default (grouped) LoRA kernel. Paired with the pre-study demo.
VARIANTS["demo"] = {
    **{k: v for k, v in VARIANTS["vl-answer64-n4b32-anti"].items() if k not in ("budget_minutes", "vllm_lora_kernel")},
    "max_steps": 18,
}  # fmt: skip
# The demo's plain-ES twin (recipes/configs/es_quickstart.yaml): the two DART-ES switches off, nothing else changed.
VARIANTS["demo-es"] = {**VARIANTS["demo"], "use_difficulty_reweighting": False, "use_targeted_replay": False}
# One-setting screens of the demo: a 2x larger step (with N = 4 the ~18 steps move a weight about sigma in all,
# and the curves level off after 5-10 minutes) and a 2x larger sigma (the best one-setting screen at N16xB8).
VARIANTS["demo-lr2"] = {**VARIANTS["demo"], "learning_rate": 2e-3}
VARIANTS["demo-s4"] = {**VARIANTS["demo"], "sigma": 4e-3}
# demo-lr2 peaked at step 10 (seed 0: 31.6%) and fell back by step 18 (29.3%): the same 2x start, decayed
# linearly to 0, so the run's mean step size is the demo's.
VARIANTS["demo-lr2-linear"] = {**VARIANTS["demo-lr2"], "lr_scheduler_type": "linear"}
# 64 problems per member at N = 4: the same 2,304 rollouts as the demo in half the steps.
VARIANTS["demo-n4b64"] = {**VARIANTS["demo"], "per_device_train_batch_size": 64, "max_steps": 9}
# Which tensors evolve (the demo evolves every linear weight, 7 per layer): the MLPs only, attention only, and
# only the two projections that write to the residual stream. Fewer dimensions per direction, same sigma.
VARIANTS["demo-mlp"] = {**VARIANTS["demo"], "lowrank_target_modules": ["gate_proj", "up_proj", "down_proj"]}
VARIANTS["demo-attn"] = {
    **VARIANTS["demo"],
    "lowrank_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
VARIANTS["demo-out"] = {**VARIANTS["demo"], "lowrank_target_modules": ["o_proj", "down_proj"]}
# Attention only perturbs a quarter of the linear weights' parameters, so a member moves its outputs less: 2x sigma.
VARIANTS["demo-attn-s4"] = {**VARIANTS["demo-attn"], "sigma": 4e-3}
# The format reward at half the weight of correctness (the demo: 0.1). Untrained, about half the greedy
# completions hit the 64-token limit before a `#### N` line; a larger format term pays members that finish.
VARIANTS["demo-fmt5"] = {**VARIANTS["demo"], "reward_weights": [1.0, 0.5]}
# Half the demo's sigma (the study screened only larger ones): fewer completions flip per member, but each flip is
# closer to the local, gradient-like regime, where a direction that fixes one problem is likelier to fix others.
VARIANTS["demo-s1"] = {**VARIANTS["demo"], "sigma": 1e-3}
# One antithetic pair on 32 problems for twice the steps (the demo's 2,304 rollouts): each step's update is a
# random direction, so at a fixed total move more, smaller steps average its noise down (noise grows as sqrt(steps)).
VARIANTS["demo-n2b32"] = {**VARIANTS["demo"], "population_size": 2, "max_steps": 36}
# Partial credit for the reference's intermediate results (gsm8k_step_reward) at half correctness's weight: members
# that no multi-step problem's 0/1 correctness tells apart are ranked by how many of its steps they get right.
VARIANTS["demo-step5"] = {
    **VARIANTS["demo"],
    "reward_funcs": ["gsm8k_accuracy_reward", "gsm8k_format_reward", "gsm8k_step_reward"],
    "reward_weights": [1.0, 0.1, 0.5],
}
# The demo run 2.7x as long (6,144 rollouts; with --eval-every 18 its step 18 is the demo's own end): does the gain
# keep growing with rollouts, or level off as the 15-minute curves do?
VARIANTS["demo-long"] = {**VARIANTS["demo"], "max_steps": 48, "eval_every": 18}
# Generation stops at the first "\nThe answer is": untrained, many completions repeat their `#### N` line as "The
# answer is N." and then loop through more guesses until the 64-token limit, where the last `####` scores. Fewer
# tokens per rollout (a faster step), and a member's first answer is the one that counts, in training and held out.
VARIANTS["demo-stop"] = {
    **VARIANTS["demo"],
    "generation_kwargs": json.dumps({"stop_strings": ["\nThe answer is"]}),
}
# Only the RMSNorm gains evolve (35,136 of 134.5M parameters, full-rank noise), on the transformers low-rank backend
# (vLLM's adapters cannot carry norms). ES's progress per rollout falls with the number of dimensions it searches;
# a gain scales a whole channel, so this small space may hold much of what a fine-tune can change. The gains are
# 0.03-1.8 in size; sigma = 3e-3 (with the demo's alpha/sigma ratio) is a choice, not a tuned value.
_NORMS = ["input_layernorm", "post_attention_layernorm", "norm"]
VARIANTS["demo-norms"] = {
    **{k: v for k, v in VARIANTS["demo"].items() if k not in ("use_vllm", "vllm_cpu_kvcache_space")},
    "lowrank_targets": "all", "lowrank_target_modules": _NORMS, "sigma": 3e-3, "learning_rate": 1.5e-3,
    "eval_every": 9,
}  # fmt: skip
# The demo with its prompt behind "You are good at math." (prompt style "answer-math"): every prompt shares 32
# tokens, one block of vLLM's CPU prefix cache, so with the cache on each member computes ~38 prompt tokens per
# prompt instead of ~70 (untrained, greedy, 256 held-out prompts: 30.9% against the demo prompt's 26.2%).
VARIANTS["demo-math-cache"] = {
    **VARIANTS["demo"],
    "prompt_style": "answer-math",
    "vllm_enable_prefix_caching": True,
}
# The same with a prompt that, untrained, behaves like the demo's (26.2%, 48.7 tokens per completion) and shares 35
# tokens: "answer" plus "Write the answer line once, then stop." (style "answer-once").
VARIANTS["demo-once-cache"] = {
    **VARIANTS["demo"],
    "prompt_style": "answer-once",
    "vllm_enable_prefix_caching": True,
}
# Train on the easier levels only (held out: all three, as always). Untrained, greedy, the embedded model solves
# 33% of level-1, 15% of level-2 and ~0% of level-3 problems (results/task_difficulty.md), and a problem
# that no member solves gives ES no signal: a quarter of the demo's rollouts are level 3, and DART-ES's replay
# refills only a fifth of each batch. Does spending every rollout where members differ learn faster, and does it
# carry over to the held-out level-3 problems?
VARIANTS["demo-l12"] = {**VARIANTS["demo"], "train_levels": [1, 2]}
VARIANTS["demo-l1"] = {**VARIANTS["demo"], "train_levels": [1]}
# DART-ES's two parts one at a time (demo-es turns both off): which of them carries the demo's gain over plain ES?
VARIANTS["demo-noweights"] = {**VARIANTS["demo"], "use_difficulty_reweighting": False}
VARIANTS["demo-noreplay"] = {**VARIANTS["demo"], "use_targeted_replay": False}
# Half the problems per member for twice the steps (the demo's 2,304 rollouts): the N x B axis at the demo's N = 4.
VARIANTS["demo-n4b16"] = {**VARIANTS["demo"], "per_device_train_batch_size": 16, "max_steps": 36}
# Partial credit for a final answer near the reference (benchmarks/closeness_reward.py) at 0.3 beside correctness
# 1.0 and format 0.1: unlike gsm8k_step_reward it needs no worked solution, and it ranks members on the half of
# each batch that no member solves by how far off their answers are.
VARIANTS["demo-close"] = {
    **VARIANTS["demo"],
    "reward_funcs": [
        "gsm8k_accuracy_reward", "gsm8k_format_reward", "benchmarks.closeness_reward.gsm8k_closeness_reward",
    ],
    "reward_weights": [1.0, 0.1, 0.3],
}  # fmt: skip
# Centred fitness over the run's mean fitness std instead of each step's own std: with N = 4 a per-step z-score
# gives every step the same length, whether the members differ by one problem or by ten; this keeps the
# differences' size, so steps with little signal move less (the first step is the demo's exactly).
VARIANTS["demo-runz"] = {**VARIANTS["demo"], "fitness_shaping": "running-zscore"}
# Twice the demo's replay ratio (0.4: 13 of 32 slots): removing replay was the largest ablation (+2.2 points for
# keeping it), and a replayed problem is one some member solved and the population has not mastered, the kind of
# problem that tells members apart. Eligible entries run short early; fresh problems fill the rest.
VARIANTS["demo-replay4"] = {**VARIANTS["demo"], "replay_ratio": 0.4}
# (method, its twin): paired by seed in the report.
PAIRS = [
    ("vl-answer64-n16b8-anti", "vl-answer64-n16b8-anti-es"),
    ("vl-answer64-n8b16-anti", "vl-answer64-n16b8-anti"),  # twice the problems per member, half the members
    ("vl-answer64-n4b32-anti", "vl-answer64-n16b8-anti"),  # four times the problems, a quarter of the members
    ("demo", "old-quickstart"),  # the demo before and after the study
    ("demo", "demo-es"),  # DART-ES against plain ES at the demo's settings
    ("demo-attn", "demo"),  # attention projections only against every linear weight
    ("demo-once-cache", "demo"),  # the one-block prompt with vLLM's prefix cache against the demo
    ("demo-l1", "demo"),  # training on level-1 problems only against all three levels
    ("demo", "demo-noweights"),  # DART-ES against DART-ES without difficulty reweighting
    ("demo", "demo-noreplay"),  # DART-ES against DART-ES without targeted replay
]


def _settings(name: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "variant": VARIANTS[name],
        "eval_prompts": args.eval_prompts,
        "eval_every": eval_every(name, args),
    }


def eval_every(name: str, args: argparse.Namespace) -> int:
    """Steps between held-out evaluations: the variant's own `eval_every` (a long run), else `--eval-every`."""
    return VARIANTS[name].get("eval_every", args.eval_every)


def _train_clock(budget_s: float | None = None):
    """The harness's step clock: seconds spent inside ES steps (evaluation left out) and the training seconds at
    each step end; it stops training once `budget_s` train seconds are spent, and evaluates the last step
    (`clock.callback(evaluate_last=True)`)."""
    from trl_dart_es.benchmark.clock import StepClock

    return StepClock(budget_s)


def _machines(runs: list[dict]) -> str:
    """The CPUs the runs came from, with their counts: one study spans several machines of this kind."""
    counts = Counter(r["machine"].split(",")[0] for r in runs)
    return ", ".join(f"{cpu} ({n} runs)" for cpu, n in counts.most_common())


def variant_config(name: str, seed: int, output_dir: str, eval_every: int) -> tuple:
    """``(script_args, DartESConfig, model_args, prompt_style, budget_minutes)`` of one (variant, seed) run:
    quickstart_fullrank.yaml with the variant's overrides; a budget replaces the step count (the clock stops
    the run)."""
    from trl_dart_es.benchmark import parse_recipe_config
    from trl_dart_es.trainer import DartESConfig

    variant = dict(VARIANTS[name])
    style = variant.pop("prompt_style", "steps")
    budget = variant.pop("budget_minutes", None)
    variant.pop("train_levels", None)  # the train split's difficulty levels: run_one's, not the config's
    variant.pop("eval_every", None)  # the caller's `eval_every` argument
    if budget:
        variant["max_steps"] = 10_000
    values = {
        **variant, "seed": seed, "output_dir": output_dir, "eval_strategy": "steps", "eval_steps": eval_every,
        "per_device_eval_batch_size": 64, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
        "disable_tqdm": True,
    }  # fmt: skip
    script_args, cfg, model_args = parse_recipe_config(DartESConfig, CONFIG, values)
    cfg.model_init_kwargs = {"dtype": model_args.dtype or "float32"}
    return script_args, cfg, model_args, style, budget


def train_split(name: str, dataset_name: str, style: str):
    """The variant's train set: the task's train split in `style`, restricted to its `train_levels` if set."""
    from trl_dart_es.tasks import load_task_dataset

    levels = VARIANTS[name].get("train_levels")
    options = {"levels": tuple(levels)} if levels else {}
    return load_task_dataset(dataset_name, "train", prompt_style=style, **options)


def run_one(name: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train one (variant, seed) run; return its held-out accuracy curve against steps and train seconds."""
    from trl_dart_es import DartESTrainer
    from trl_dart_es.benchmark import machine_description
    from trl_dart_es.tasks import load_task_dataset
    from trl_dart_es.trainer.baseline import evaluate_untrained

    with tempfile.TemporaryDirectory(prefix=f"study-{name}-{seed}-") as out:
        script_args, cfg, model_args, style, budget = variant_config(name, seed, out, eval_every(name, args))
        train = train_split(name, script_args.dataset_name, style)
        held_out = load_task_dataset(
            script_args.dataset_name, "test", prompt_style=style, num_examples=args.eval_prompts
        )
        clock = _train_clock(budget * 60 if budget else None)
        trainer = DartESTrainer(
            model=model_args.model_name_or_path,
            reward_funcs=script_args.load_reward_funcs(),
            args=cfg,
            train_dataset=train,
            eval_dataset=held_out,
            callbacks=[clock.callback(evaluate_last=True)],
        )
        # Greedy evaluation of the untrained model is deterministic: cached, keyed by all that changes it.
        at_start, _ = evaluate_untrained(trainer, held_out, model_args.model_name_or_path)
        started = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - started
        history = trainer.state.log_history

    def groups(metrics: dict[str, Any]) -> dict[str, float]:  # held-out accuracy per level and wording
        return {
            k.removeprefix("eval_accuracy/"): v for k, v in metrics.items() if k.startswith("eval_accuracy/")
        }

    points = [
        {"step": 0, "train_seconds": 0.0, "accuracy": at_start["eval_accuracy"], "groups": groups(at_start)}
    ]
    for e in history:
        if "eval_accuracy" in e:
            step = int(e["step"])
            points.append(
                {
                    "step": step,
                    "train_seconds": clock.at_step[step],
                    "accuracy": e["eval_accuracy"],
                    "groups": groups(e),
                }
            )
    train_log = [
        {k: e[k] for k in ("step", "reward", "rewards/gsm8k_format_reward/mean", "completions/mean_length",
                           "dart/frac_solved_by_none", "dart/frac_solved_by_all", "dart/buffer_size") if k in e}
        for e in history if "reward" in e
    ]  # fmt: skip
    del trainer
    gc.collect()
    return {
        "variant": name, "seed": seed, "settings": _settings(name, args), "points": points,
        "train_seconds": clock.train_seconds, "wall_s": wall, "train_log": train_log, "machine": machine_description(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }  # fmt: skip


def run_path(name: str, seed: int) -> Path:
    return RUNS_DIR / f"{name}-seed{seed}.json"


def load_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(RUNS_DIR.glob("*-seed*.json")):
        run = json.loads(path.read_text())
        if run["variant"] in VARIANTS and run["settings"] == _settings(run["variant"], args):
            runs.append(run)
    return runs


def report(args: argparse.Namespace) -> None:
    from trl_dart_es.benchmark.stats import paired_t_interval

    runs = load_runs(args)
    if not runs:
        print("no finished runs", file=sys.stderr)
        return
    rows = []
    for name in VARIANTS:
        mine = [r for r in runs if r["variant"] == name]
        if not mine:
            continue
        gains = [r["points"][-1]["accuracy"] - r["points"][0]["accuracy"] for r in mine]
        mean, lo, hi = paired_t_interval(gains)
        v = VARIANTS[name]
        rows.append({
            "variant": name, "seeds": sorted(r["seed"] for r in mine),
            "acc_start": mine[0]["points"][0]["accuracy"],
            "acc_final_mean": statistics.fmean(r["points"][-1]["accuracy"] for r in mine),
            "gain_mean": mean, "gain_ci95": [lo, hi], "gains": gains,
            "train_min": statistics.fmean(r["train_seconds"] for r in mine) / 60,
            "steps": statistics.fmean(r["points"][-1]["step"] for r in mine),
            "rollouts": mine[0]["points"][-1]["step"] * v["population_size"] * v["per_device_train_batch_size"],
        })  # fmt: skip
    out = ROOT / "results" / "study"
    out.with_suffix(".json").write_text(
        json.dumps({"rows": rows, "pairs": _paired(runs), "runs": runs}, indent=1) + "\n"
    )
    lines = [
        "# Learning study: what makes DART-ES learn on the embedded model",
        "",
        f"Held-out: greedy accuracy on {args.eval_prompts} test prompts (one prompt = "
        f"{100 / args.eval_prompts:.2f} points). Command: `python benchmarks/study.py --variants ... --seeds ...`;"
        f" runs in `results/study_runs/`. Machines (each run's file names its own): {_machines(runs)};"
        f" last run {max(r['date'] for r in runs)}. Train minutes exclude evaluation and were measured on machines"
        " of different speed, some while other jobs shared the 2 cores, so compare them only roughly.",
        "",
        "| variant | seeds | rollouts | acc. step 0 | final (mean) | gain (mean) | gain 95% CI | gains per seed | train min |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | --- | ---: |",
    ]
    for r in rows:
        ci = (
            "n/a"
            if math.isnan(r["gain_ci95"][0])
            else f"[{100 * r['gain_ci95'][0]:+.1f}, {100 * r['gain_ci95'][1]:+.1f}]"
        )
        lines.append(
            f"| {r['variant']} | {', '.join(map(str, r['seeds']))} | {r['rollouts']} | {100 * r['acc_start']:.1f}% "
            f"| {100 * r['acc_final_mean']:.1f}% | {100 * r['gain_mean']:+.1f} | {ci} "
            f"| {', '.join(f'{100 * g:+.1f}' for g in r['gains'])} | {r['train_min']:.1f} |"
        )
    pairs = _paired(runs)
    if pairs:
        lines += [
            "",
            "Paired by seed (the first minus the second, in points; 95% t-interval), on final accuracy and on the"
            " gain over each variant's own step 0:",
            "",
            "| first | second | seeds | measure | differences | mean | 95% CI | |",
            "| --- | --- | --- | --- | --- | ---: | --- | --- |",
        ]
        for p in pairs:
            for measure, key in (("final accuracy", ""), ("gain", "gain_")):
                lo, hi = p[f"{key}ci95"]
                verdict = "includes zero" if lo <= 0 <= hi else "excludes zero"
                lines.append(
                    f"| {p['first']} | {p['second']} | {', '.join(map(str, p['seeds']))} | {measure} "
                    f"| {', '.join(f'{100 * d:+.1f}' for d in p[f'{key}differences'])} "
                    f"| {100 * p[f'{key}mean']:+.1f} | [{100 * lo:+.1f}, {100 * hi:+.1f}] | {verdict} |"
                )
    lines += ["", "Variants (overrides of recipes/configs/quickstart_fullrank.yaml):", ""]
    lines += [
        f"- `{name}`: `{json.dumps(VARIANTS[name])}`"
        for name in VARIANTS
        if any(r["variant"] == name for r in rows)
    ]
    lines += ["", "![accuracy against train minutes](study.png)"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(runs, out.with_suffix(".png"))
    print(out.with_suffix(".md").read_text())


def _paired(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each of `PAIRS` with at least 2 common seeds: final-accuracy differences by seed and their t-interval,
    and the same for the gains (which differ from the former when the two start from different accuracies, as
    variants with different prompts do)."""
    from trl_dart_es.benchmark.stats import paired_t_interval

    final = {(r["variant"], r["seed"]): r["points"][-1]["accuracy"] for r in runs}
    gain = {(r["variant"], r["seed"]): r["points"][-1]["accuracy"] - r["points"][0]["accuracy"] for r in runs}
    out = []
    for first, second in PAIRS:
        seeds = sorted(s for (v, s) in final if v == first and (second, s) in final)
        if len(seeds) < 2:
            continue
        diffs = [final[first, s] - final[second, s] for s in seeds]
        gain_diffs = [gain[first, s] - gain[second, s] for s in seeds]
        mean, lo, hi = paired_t_interval(diffs)
        gain_mean, gain_lo, gain_hi = paired_t_interval(gain_diffs)
        out.append({"first": first, "second": second, "seeds": seeds, "differences": diffs, "mean": mean,
                    "ci95": [lo, hi], "gain_differences": gain_diffs, "gain_mean": gain_mean,
                    "gain_ci95": [gain_lo, gain_hi]})  # fmt: skip
    return out


def _plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Held-out gain against train minutes, one line per (variant, seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        start = run["points"][0]["accuracy"]
        xs = [p["train_seconds"] / 60 for p in run["points"]]
        ys = [100 * (p["accuracy"] - start) for p in run["points"]]
        ax.plot(xs, ys, marker="o", label=f"{run['variant']} s{run['seed']}")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("train minutes (evaluation excluded)")
    ax.set_ylabel("held-out gain (points)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=[], choices=list(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--eval-prompts", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--report", action="store_true", help="only rebuild the report")
    args = p.parse_args(argv)
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    for name in [] if args.report else args.variants:
        for seed in args.seeds:
            path = run_path(name, seed)
            if path.is_file() and json.loads(path.read_text())["settings"] == _settings(name, args):
                print(f"skip {name} seed {seed}: finished")
                continue
            print(f"run {name} seed {seed} ...", flush=True)
            result = run_one(name, seed, args)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(result, indent=1) + "\n")
            tmp.replace(path)
            curve = ", ".join(f"{p['step']}:{100 * p['accuracy']:.1f}%" for p in result["points"])
            print(
                f"done {name} seed {seed}: {curve} ({result['train_seconds'] / 60:.1f} train min)", flush=True
            )
    report(args)


if __name__ == "__main__":
    main()
