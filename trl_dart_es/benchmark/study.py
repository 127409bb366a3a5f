"""The learning study behind the defaults, as presets of `--curves`: which settings make DART-ES learn on the
embedded model (usage: docs/benchmarks.md).

Every preset is the pre-study demo recipe (recipes/configs/quickstart_fullrank.yaml, kept fixed) with the
overrides in benchmarks/study_presets.yaml, trained in-process for its steps (or its train-time budget). Unlike a
curve, a preset keeps the study's schedule, so that its numbers mean what they meant: the trainer's own greedy
evaluation (`DartESTrainer.evaluate`, `--eval-prompts` test prompts in the preset's prompt style and length) at
step 0 (the one cache of the untrained score), every `--eval-every` steps (or the preset's `eval_every`) and at
the last step; training time is the harness's `StepClock`. Each finished (preset, seed) is written at once.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .clock import StepClock
from .curves import curve_run_path
from .machine import machine_description, machines_summary, utc_now
from .report import interval, pyplot, save_figure, table, write_json_atomic
from .stats import paired_t_interval
from .workload import REPO_ROOT

CONFIG = REPO_ROOT / "recipes" / "configs" / "quickstart_fullrank.yaml"
PRESETS_FILE = REPO_ROOT / "benchmarks" / "study_presets.yaml"
DEFAULT_RUNS_DIR = Path("results") / "study_runs"
DEFAULT_EVAL_PROMPTS = 256
DEFAULT_EVAL_EVERY = 10
# Preset keys that the harness reads, not DartESConfig: the prompt, the time budget, the train split's levels,
# the steps between evaluations, the task generator's version and the size of the validation set.
HARNESS_KEYS = (
    "prompt_style",
    "budget_minutes",
    "train_levels",
    "eval_every",
    "task_version",
    "validation_prompts",
)
_TRANSFER = ("template_held_out", "template_seen", "wording_held_out", "wording_seen")
_TRAIN_LOG_KEYS = ("step", "reward", "rewards/gsm8k_format_reward/mean", "completions/mean_length",
                   "dart/frac_solved_by_none", "dart/frac_solved_by_all", "dart/buffer_size")  # fmt: skip


# ----------------------------------------------------------------------------------------- presets
def load_presets(path: str | Path = PRESETS_FILE) -> tuple[dict[str, dict[str, Any]], list[tuple[str, str]]]:
    """(preset name -> overrides of quickstart_fullrank.yaml, in file order; the (first, second) pairs of the
    report). A preset's `base` presets are applied first, in order, then its `drop` keys removed, then its own
    keys set (so a key keeps its base's place); names starting with `_` are bases only."""
    import yaml

    raw = yaml.safe_load(Path(path).read_text())
    pairs = [tuple(pair) for pair in raw.pop("_pairs", [])]
    resolved: dict[str, dict[str, Any]] = {}
    for name, spec in raw.items():
        spec = dict(spec)
        bases = spec.pop("base", [])
        values: dict[str, Any] = {}
        for base in [bases] if isinstance(bases, str) else bases:
            values.update(resolved[base])
        for key in spec.pop("drop", []):
            del values[key]
        resolved[name] = {**values, **spec}
    return {k: v for k, v in resolved.items() if not k.startswith("_")}, pairs


@functools.cache
def _presets_and_pairs() -> tuple[dict[str, dict[str, Any]], list[tuple[str, str]]]:
    return load_presets()  # read on first use: the harness's parent reads no file it does not need


def presets() -> dict[str, dict[str, Any]]:
    """The presets of benchmarks/study_presets.yaml."""
    return _presets_and_pairs()[0]


def pairs() -> list[tuple[str, str]]:
    """The (first, second) presets the report pairs by seed."""
    return _presets_and_pairs()[1]


def eval_every(name: str, args: argparse.Namespace) -> int:
    """Steps between held-out evaluations: the preset's own `eval_every` (a long run), else `--eval-every`."""
    return presets()[name].get("eval_every", args.eval_every)


def _settings(name: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "variant": presets()[name],
        "eval_prompts": args.eval_prompts,
        "eval_every": eval_every(name, args),
    }


def preset_config(name: str, seed: int, output_dir: str, eval_every: int) -> tuple:
    """``(script_args, DartESConfig, model_args, prompt_style, budget_minutes)`` of one (preset, seed) run:
    quickstart_fullrank.yaml with the preset's overrides; a budget replaces the step count (the clock stops
    the run)."""
    from ..trainer import DartESConfig
    from .trainers import parse_recipe_config

    variant = {k: v for k, v in presets()[name].items() if k not in HARNESS_KEYS}
    style = presets()[name].get("prompt_style", "steps")
    budget = presets()[name].get("budget_minutes")
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


def task_options(name: str) -> dict[str, Any]:
    """The preset's task generator version (`task_version`), as `load_task_dataset` takes it; {} for the default."""
    version = presets()[name].get("task_version")
    return {"version": version} if version is not None else {}


def _split(name: str, dataset_name: str, split: str, style: str, **options: Any):
    from ..tasks import load_task_dataset

    return load_task_dataset(dataset_name, split, prompt_style=style, **options, **task_options(name))


def train_split(name: str, dataset_name: str, style: str):
    """The preset's train set: the task's train split in `style` (and `task_version`), restricted to its
    `train_levels` if set."""
    levels = presets()[name].get("train_levels")
    return _split(name, dataset_name, "train", style, **({"levels": tuple(levels)} if levels else {}))


# ----------------------------------------------------------------------------------------- runs
def run_preset(name: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train one (preset, seed) run in this process; return its held-out accuracy curve against steps and train
    seconds."""
    from ..trainer import DartESTrainer
    from ..trainer.baseline import evaluate_untrained

    with tempfile.TemporaryDirectory(prefix=f"study-{name}-{seed}-") as out:
        script_args, cfg, model_args, style, budget = preset_config(name, seed, out, eval_every(name, args))
        dataset = script_args.dataset_name
        train = train_split(name, dataset, style)
        held_out = _split(name, dataset, "test", style, num_examples=args.eval_prompts)
        clock = StepClock(budget * 60 if budget else None)
        validation = _validation_scores(name, dataset, style)
        trainer = DartESTrainer(
            model=model_args.model_name_or_path,
            reward_funcs=script_args.load_reward_funcs(),
            args=cfg,
            train_dataset=train,
            eval_dataset=held_out,
            callbacks=[clock.callback(evaluate_last=True), validation],
        )
        validation.trainer = trainer
        # Greedy evaluation of the untrained model is deterministic: cached, keyed by all that changes it.
        at_start, _ = evaluate_untrained(trainer, held_out, model_args.model_name_or_path)
        validation.score(0)
        started = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - started
        history = trainer.state.log_history

    def point(step: int, seconds: float, metrics: dict[str, Any]) -> dict[str, Any]:
        groups = {
            k.removeprefix("eval_accuracy/"): v for k, v in metrics.items() if k.startswith("eval_accuracy/")
        }
        out = {"step": step, "train_seconds": seconds, "accuracy": metrics["eval_accuracy"], "groups": groups}
        if step in validation.accuracy:
            out["validation_accuracy"] = validation.accuracy[step]
        return out

    points = [point(0, 0.0, at_start)]
    points += [
        point(int(e["step"]), clock.at_step[int(e["step"])], e) for e in history if "eval_accuracy" in e
    ]
    train_log = [{k: e[k] for k in _TRAIN_LOG_KEYS if k in e} for e in history if "reward" in e]
    del trainer
    gc.collect()
    return {
        "variant": name, "seed": seed, "settings": _settings(name, args), "points": points,
        "train_seconds": clock.train_seconds, "wall_s": wall, "train_log": train_log, "machine": machine_description(),
        "date": utc_now(),
    }  # fmt: skip


def _validation_scores(name: str, dataset_name: str, style: str):
    """A callback that, with the preset's `validation_prompts`, scores greedy accuracy on that many prompts of the
    validation split (no question shared with train or test) wherever the test set is evaluated, so that the
    report can pick each run's checkpoint on validation, as `load_best_model_at_end` would. `.accuracy` maps step
    to accuracy; set `.trainer` before training."""
    from transformers import TrainerCallback

    size = int(presets()[name].get("validation_prompts", 0))
    data = _split(name, dataset_name, "validation", style, num_examples=size) if size else None

    class ValidationScores(TrainerCallback):
        def __init__(self):
            self.trainer = None
            self.accuracy: dict[int, float] = {}

        def score(self, step: int) -> None:
            if data is not None:
                self.accuracy[step] = self.trainer.evaluate_dataset(data, "validation")["validation_accuracy"]

        def on_evaluate(self, args, state, control, **kwargs):
            self.score(state.global_step)

    return ValidationScores()


def load_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The finished runs in `args.runs_dir` of known presets whose settings are the current ones."""
    runs = [json.loads(path.read_text()) for path in sorted(Path(args.runs_dir).glob("*-seed*.json"))]
    return [r for r in runs if r["variant"] in presets() and r["settings"] == _settings(r["variant"], args)]


def study_main(args: argparse.Namespace, names: list[str]) -> None:
    """`--curves --preset`: run every (preset, seed) not finished yet, then write the report over all finished
    runs."""
    unknown = [name for name in names if name not in presets()]
    if unknown:
        raise SystemExit(f"unknown presets {unknown}; known: {', '.join(presets())}")
    Path(args.runs_dir).mkdir(parents=True, exist_ok=True)
    for name in names:
        for seed in args.seeds:
            path = curve_run_path(args.runs_dir, name, seed)
            if (
                not args.force
                and path.is_file()
                and json.loads(path.read_text())["settings"] == _settings(name, args)
            ):
                print(f"skip {name} seed {seed}: finished")
                continue
            print(f"run {name} seed {seed} ...", flush=True)
            result = run_preset(name, seed, args)
            write_json_atomic(path, result)
            curve = ", ".join(f"{p['step']}:{100 * p['accuracy']:.1f}%" for p in result["points"])
            print(
                f"done {name} seed {seed}: {curve} ({result['train_seconds'] / 60:.1f} train min)", flush=True
            )
    report(args)


# ----------------------------------------------------------------------------------------- report
def _rollouts_per_step(variant: dict[str, Any]) -> int:
    from ..layout import PopulationLayout

    layout = PopulationLayout(variant.get("population_layout", "shared"), variant.get("members_per_group"))
    return layout.rollouts(variant["population_size"], variant["per_device_train_batch_size"])


def _by_variant(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The runs of each preset that has any, in the presets' order."""
    return {name: mine for name in presets() if (mine := [r for r in runs if r["variant"] == name])}


def _seeds(mine: list[dict[str, Any]]) -> str:
    return ", ".join(str(r["seed"]) for r in mine)


def _ci(values: list[float]) -> str:
    """The 95% t-interval of `values` in points, or "n/a" for fewer than 2."""
    return interval(*paired_t_interval(values)[1:]) if len(values) >= 2 else "n/a"


def report(args: argparse.Namespace) -> None:
    """Write `<output_dir>/study.{json,md,png}` over every finished run with the current settings."""
    runs = load_runs(args)
    if not runs:
        print("no finished runs", file=sys.stderr)
        return
    rows = []
    for name, mine in _by_variant(runs).items():
        gains = [r["points"][-1]["accuracy"] - r["points"][0]["accuracy"] for r in mine]
        mean, lo, hi = paired_t_interval(gains)
        rows.append({
            "variant": name, "seeds": sorted(r["seed"] for r in mine),
            "acc_start": mine[0]["points"][0]["accuracy"],
            "acc_final_mean": statistics.fmean(r["points"][-1]["accuracy"] for r in mine),
            "gain_mean": mean, "gain_ci95": [lo, hi], "gains": gains,
            "train_min": statistics.fmean(r["train_seconds"] for r in mine) / 60,
            "steps": statistics.fmean(r["points"][-1]["step"] for r in mine),
            "rollouts": mine[0]["points"][-1]["step"] * _rollouts_per_step(presets()[name]),
        })  # fmt: skip
    out = Path(args.output_dir) / "study"
    out.parent.mkdir(parents=True, exist_ok=True)
    paired = _paired(runs, pairs())
    out.with_suffix(".json").write_text(
        json.dumps({"rows": rows, "pairs": paired, "runs": runs}, indent=1) + "\n"
    )
    lines = [
        "# Learning study: what makes DART-ES learn on the embedded model",
        "",
        f"Held-out: greedy accuracy on {args.eval_prompts} test prompts (one prompt = "
        f"{100 / args.eval_prompts:.2f} points). Command (a row: its variant and seeds): `python -m"
        f" trl_dart_es.benchmark --curves --preset <variant> --seeds <seeds>{_flags(args)}` (finished runs are"
        f" skipped; without `<variant> --seeds <seeds>` it rebuilds this page); runs in `{args.runs_dir}/`. Machines"
        f" (each run's file names its own): {machines_summary(runs)};"
        f" last run {max(r['date'] for r in runs)}. Train minutes exclude evaluation and were measured on machines"
        " of different speed, some while other jobs shared the 2 cores, so compare them only roughly.",
        "",
        "| variant | seeds | rollouts | acc. step 0 | final (mean) | gain (mean) | gain 95% CI | gains per seed | train min |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | --- | ---: |",
    ]
    for r in rows:
        ci = "n/a" if math.isnan(r["gain_ci95"][0]) else interval(*r["gain_ci95"])
        lines.append(
            f"| {r['variant']} | {', '.join(map(str, r['seeds']))} | {r['rollouts']} | {100 * r['acc_start']:.1f}% "
            f"| {100 * r['acc_final_mean']:.1f}% | {100 * r['gain_mean']:+.1f} | {ci} "
            f"| {', '.join(f'{100 * g:+.1f}' for g in r['gains'])} | {r['train_min']:.1f} |"
        )
    lines += _paired_table(paired) + _steps_table(runs) + _transfer_table(runs) + _picked_table(runs)
    lines += [
        "",
        "Variants (overrides of recipes/configs/quickstart_fullrank.yaml, from benchmarks/study_presets.yaml):",
        "",
    ]
    shown = {r["variant"] for r in rows}
    lines += [f"- `{name}`: `{json.dumps(v)}`" for name, v in presets().items() if name in shown]
    lines += ["", "![accuracy against train minutes](study.png)"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(runs, out.with_suffix(".png"))
    print(out.with_suffix(".md").read_text())


def _flags(args: argparse.Namespace) -> str:
    """The command-line flags that make this study differ from the default one."""
    flags = ""
    if args.eval_prompts != DEFAULT_EVAL_PROMPTS:
        flags += f" --eval-prompts {args.eval_prompts}"
    if Path(args.runs_dir) != DEFAULT_RUNS_DIR:
        flags += f" --runs-dir {args.runs_dir}"
    if Path(args.output_dir) != Path("results"):
        flags += f" --output-dir {args.output_dir}"
    return flags


def _paired_table(paired: list[dict[str, Any]]) -> list[str]:
    rows = []
    for p in paired:
        for measure, key in (("final accuracy", ""), ("gain", "gain_")):
            lo, hi = p[f"{key}ci95"]
            verdict = "includes zero" if lo <= 0 <= hi else "excludes zero"
            if p.get("seeds_on_two_cpus"):
                verdict += f"; seeds {', '.join(map(str, p['seeds_on_two_cpus']))} ran on two CPU models"
            rows.append(
                f"| {p['first']} | {p['second']} | {', '.join(map(str, p['seeds']))} | {measure} "
                f"| {', '.join(f'{100 * d:+.1f}' for d in p[f'{key}differences'])} "
                f"| {100 * p[f'{key}mean']:+.1f} | {interval(lo, hi)} | {verdict} |"
            )
    return table(
        "Paired by seed (the first minus the second, in points; 95% t-interval), on final accuracy and on the"
        " gain over each variant's own step 0:",
        "| first | second | seeds | measure | differences | mean | 95% CI | |",
        "| --- | --- | --- | --- | --- | ---: | --- | --- |",
        rows,
    )


def _steps_table(runs: list[dict[str, Any]]) -> list[str]:
    """Mean held-out accuracy at every evaluated step, for variants evaluated more than once after step 0."""
    rows = []
    for name, mine in _by_variant(runs).items():
        steps = sorted({p["step"] for r in mine for p in r["points"]})
        if len(steps) < 3:
            continue
        cells = []
        for step in steps:
            accs = [p["accuracy"] for r in mine for p in r["points"] if p["step"] == step]
            cells.append(
                f"{step}: {100 * statistics.fmean(accs):.1f}%" + ("" if len(accs) == len(mine) else "*")
            )
        rows.append(f"| {name} | {_seeds(mine)} | {'; '.join(cells)} |")
    return table(
        "Held-out accuracy at each evaluated step (mean over the seeds):",
        "| variant | seeds | step: accuracy |",
        "| --- | --- | --- |",
        rows,
    )


def _transfer_table(runs: list[dict[str, Any]]) -> list[str]:
    """Before -> after (mean over seeds) on held-out and seen templates and wordings, where the task has them, with
    the gain's 95% t-interval over the seeds and its smallest seed (issue 45's target: >= +2 on average, never
    below zero)."""
    rows = []
    for name, mine in _by_variant(runs).items():
        if not all(k in r["points"][0].get("groups", {}) for r in mine for k in _TRANSFER):
            continue
        cells = []
        for key in _TRANSFER:
            before = statistics.fmean(r["points"][0]["groups"][key] for r in mine)
            after = statistics.fmean(r["points"][-1]["groups"][key] for r in mine)
            gains = [r["points"][-1]["groups"][key] - r["points"][0]["groups"][key] for r in mine]
            cell = f"{100 * before:.1f}% → {100 * after:.1f}% ({100 * (after - before):+.1f}"
            if len(gains) > 1:
                cell += f" {_ci(gains)}, min {100 * min(gains):+.1f}"
            cells.append(cell + ")")
        rows.append(f"| {name} | {_seeds(mine)} | {' | '.join(cells)} |")
    return table(
        "Transfer: accuracy before → after training (mean over the seeds) on rows that use a template, or names"
        " and objects, held out of the train split, and on rows that do not; in brackets the gain's 95% t-interval"
        " over the seeds, then the smallest seed's gain:",
        "| variant | seeds | templates held out | templates seen | wordings held out | wordings seen |",
        "| --- | --- | --- | --- | --- | --- |",
        rows,
    )


def picked_on_validation(run: dict[str, Any]) -> dict[str, Any] | None:
    """The run's point with the best validation accuracy (the first of equals, as `load_best_model_at_end` keeps
    the first best checkpoint), or None unless every point has a validation score."""
    points = run["points"]
    if not all("validation_accuracy" in p for p in points):
        return None
    return max(points, key=lambda p: p["validation_accuracy"])  # max() returns the first maximum


def _picked_table(runs: list[dict[str, Any]]) -> list[str]:
    """For variants scored on validation: the test gain of each run's checkpoint picked on validation, against
    its last checkpoint's, paired by run."""
    rows = []
    for name, mine in _by_variant(runs).items():
        picked = [picked_on_validation(r) for r in mine]
        if any(p is None for p in picked):
            continue
        start = [r["points"][0] for r in mine]
        gains = [p["accuracy"] - s["accuracy"] for p, s in zip(picked, start, strict=True)]
        final = [r["points"][-1]["accuracy"] - s["accuracy"] for r, s in zip(mine, start, strict=True)]
        held = [
            p["groups"]["template_held_out"] - s["groups"]["template_held_out"]
            for p, s in zip(picked, start, strict=True)
            if "template_held_out" in p.get("groups", {})
        ]
        diffs = [g - f for g, f in zip(gains, final, strict=True)]
        rows.append(
            f"| {name} | {_seeds(mine)} | {', '.join(str(p['step']) for p in picked)} "
            f"| {100 * statistics.fmean(gains):+.1f} {_ci(gains)}; {', '.join(f'{100 * g:+.1f}' for g in gains)} "
            f"| {100 * statistics.fmean(final):+.1f} | {100 * statistics.fmean(diffs):+.1f} {_ci(diffs)} "
            f"| {f'{100 * statistics.fmean(held):+.1f}, min {100 * min(held):+.1f}' if held else 'n/a'} |"
        )
    return table(
        "Checkpoint picked on validation (the best validation accuracy among the evaluated steps, as"
        " `load_best_model_at_end` keeps it): its test gain over step 0 (mean [95% CI]; per seed), the last"
        " checkpoint's gain, their paired difference, and the picked checkpoint's gain on held-out templates (mean,"
        " smallest seed):",
        "| variant | seeds | steps picked | gain, picked | gain, last | picked − last | templates held out, picked |",
        "| --- | --- | --- | --- | ---: | --- | --- |",
        rows,
    )


def _paired(runs: list[dict[str, Any]], pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """For each of `pairs` with at least 2 common seeds: final-accuracy differences by seed and their t-interval,
    and the same for the gains (which differ from the former when the two start from different accuracies, as
    variants with different prompts do)."""
    final = {(r["variant"], r["seed"]): r["points"][-1]["accuracy"] for r in runs}
    gain = {(r["variant"], r["seed"]): r["points"][-1]["accuracy"] - r["points"][0]["accuracy"] for r in runs}
    # bf16 rounds differently on different CPUs (AMX or avx512_bf16), so one seed's two runs are a clean pair only
    # on one CPU model: the seeds whose runs came from two are named.
    cpu = {(r["variant"], r["seed"]): r.get("machine", "").split(",")[0] for r in runs}
    out = []
    for first, second in pairs:
        seeds = sorted(s for (v, s) in final if v == first and (second, s) in final)
        if len(seeds) < 2:
            continue
        diffs = [final[first, s] - final[second, s] for s in seeds]
        gain_diffs = [gain[first, s] - gain[second, s] for s in seeds]
        mean, lo, hi = paired_t_interval(diffs)
        gain_mean, gain_lo, gain_hi = paired_t_interval(gain_diffs)
        mixed = [s for s in seeds if cpu[first, s] != cpu[second, s]]
        out.append({"first": first, "second": second, "seeds": seeds, "differences": diffs, "mean": mean,
                    "ci95": [lo, hi], "gain_differences": gain_diffs, "gain_mean": gain_mean,
                    "gain_ci95": [gain_lo, gain_hi], "seeds_on_two_cpus": mixed})  # fmt: skip
    return out


def _plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Held-out gain against train minutes, one line per (variant, seed)."""
    fig, ax = pyplot().subplots(figsize=(7, 4))
    for run in runs:
        start = run["points"][0]["accuracy"]
        xs = [p["train_seconds"] / 60 for p in run["points"]]
        ys = [100 * (p["accuracy"] - start) for p in run["points"]]
        ax.plot(xs, ys, marker="o", label=f"{run['variant']} s{run['seed']}")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("train minutes (evaluation excluded)")
    ax.set_ylabel("held-out gain (points)")
    ax.legend(fontsize=7)
    save_figure(fig, path)
