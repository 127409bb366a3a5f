"""Learning benchmark: DART-ES vs plain ES over several seeds at an equal budget, held-out accuracy per step.

    python benchmarks/learning.py                                  # 3 seeds x {dart-es, es}, quickstart config
    python benchmarks/learning.py --methods dart-es --seeds 0      # one piece; rerun later for the rest
    python benchmarks/learning.py --report-only                    # redraw the plot/table from finished runs

Both methods run from the same recipe config (recipes/configs/quickstart.yaml); plain ES only switches off
difficulty reweighting and targeted replay, so both see the same population, problems per step, steps and
completion length: the same number of rollouts. Each run evaluates the unperturbed model greedily on the same
held-out prompts before training and every `--eval-every` steps (the trainer's own evaluation, eval_strategy
"steps"), and writes `<runs-dir>/<method>-seed<seed>.json` when it finishes. Finished runs with the same settings
are skipped, so the benchmark can be run in pieces. The report (docs/benchmarks/learning.{json,md} and
docs/img/learning.png: mean over seeds with a min-max band) covers every finished run.
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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trl_dart_es.benchmark import (
    DEFAULT_CONFIG_DIR,
    load_split,
    machine_description,
    parse_recipe_config,
    task_reward_funcs,
)

ROOT = Path(__file__).resolve().parent.parent
METHOD_SWITCHES = {
    "dart-es": {"use_difficulty_reweighting": True, "use_targeted_replay": True},
    "es": {"use_difficulty_reweighting": False, "use_targeted_replay": False},
    # Issue 7's proof 3: the same DART-ES run with rank-r noise and one batched generation per population.
    "dart-es-lowrank": {
        "use_difficulty_reweighting": True,
        "use_targeted_replay": True,
        "perturbation": "lowrank",
    },
}
DEFAULT_METHODS = ["dart-es", "es"]


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """What makes two runs comparable (stored in each run file; a run with other settings is redone)."""
    config = Path(args.config).resolve()
    script_args, cfg, model_args = parse_recipe_config(
        _config_cls(), config, {"output_dir": "unused", **_overrides(args)}
    )
    return {
        "config": str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config),
        "model": model_args.model_name_or_path,
        "dataset": script_args.dataset_name,
        "population_size": cfg.population_size,
        "problems_per_step": cfg.per_device_train_batch_size,
        "max_completion_length": cfg.max_completion_length,
        "sigma": cfg.sigma,
        "learning_rate": cfg.learning_rate,
        "steps": cfg.max_steps,
        "eval_every": args.eval_every,
        "eval_prompts": args.eval_prompts,
    }


def _config_cls():
    from trl_dart_es import DartESConfig

    return DartESConfig


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    values = {
        "model_name_or_path": args.model,
        "dataset_name": args.dataset,
        "max_steps": args.steps,
        "population_size": args.population,
        "per_device_train_batch_size": args.prompts,
        "max_completion_length": args.max_completion_length,
        "learning_rate": args.learning_rate,
        "sigma": args.sigma,
    }
    return {k: v for k, v in values.items() if v is not None}


def run_one(method: str, seed: int, args: argparse.Namespace, settings: dict[str, Any]) -> dict[str, Any]:
    """Train one (method, seed) run and return its accuracy curve."""
    from trl import get_peft_config

    from trl_dart_es import DartESTrainer

    with tempfile.TemporaryDirectory(prefix=f"learning-{method}-{seed}-") as out:
        values = {
            **_overrides(args),
            **METHOD_SWITCHES[method],
            "seed": seed,
            "output_dir": out,
            "eval_strategy": "steps",
            "eval_steps": args.eval_every,
            "per_device_eval_batch_size": args.eval_batch_size,
            "logging_steps": 1,
            "save_strategy": "no",
            "report_to": "none",
            "disable_tqdm": True,
        }
        script_args, cfg, model_args = parse_recipe_config(_config_cls(), args.config, values)
        cfg.model_init_kwargs = {"dtype": model_args.dtype or "float32", **(cfg.model_init_kwargs or {})}
        train = load_split(script_args.dataset_name, script_args.dataset_train_split)
        held_out = load_split(script_args.dataset_name, script_args.dataset_test_split)
        held_out = held_out.select(range(min(args.eval_prompts, len(held_out))))
        trainer = DartESTrainer(
            model=model_args.model_name_or_path,
            reward_funcs=task_reward_funcs(script_args.dataset_name),
            args=cfg,
            train_dataset=train,
            eval_dataset=held_out,
            peft_config=get_peft_config(model_args),
        )
        started = time.perf_counter()
        # Step 0 (the untrained model); train() starts a new log history, so keep this one aside.
        at_start = trainer.evaluate()["eval_accuracy"]
        trainer.train()  # evaluates every `eval_every` steps and after the last one
        wall = time.perf_counter() - started
        history = trainer.state.log_history
    by_step = {0: float(at_start)}
    by_step.update({int(e["step"]): float(e["eval_accuracy"]) for e in history if "eval_accuracy" in e})
    curve = [[step, acc] for step, acc in sorted(by_step.items())]
    rewards = [
        [int(e["step"]), float(e["reward"])] for e in history if "reward" in e and "eval_accuracy" not in e
    ]
    del trainer
    gc.collect()
    return {
        "method": method,
        "seed": seed,
        "settings": settings,
        "curve": curve,
        "train_reward": rewards,
        "rollouts_per_step": settings["population_size"] * settings["problems_per_step"],
        "wall_s": wall,
        "machine": machine_description(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def run_path(runs_dir: Path, method: str, seed: int) -> Path:
    return runs_dir / f"{method}-seed{seed}.json"


def load_runs(runs_dir: Path, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Finished runs measured with `settings` (others are ignored)."""
    runs = []
    for path in sorted(runs_dir.glob("*-seed*.json")):
        run = json.loads(path.read_text())
        if run.get("settings") == settings:
            runs.append(run)
    return runs


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: the curve's mean, min and max over seeds at each step, and the start/final accuracy."""
    out: dict[str, Any] = {}
    for method in sorted({r["method"] for r in runs}, key=lambda m: list(METHOD_SWITCHES).index(m)):
        mine = [r for r in runs if r["method"] == method]
        steps = sorted(set.intersection(*[{s for s, _ in r["curve"]} for r in mine]))
        by_step = {s: [dict(r["curve"])[s] for r in mine] for s in steps}
        finals = [r["curve"][-1][1] for r in mine]
        starts = [dict(r["curve"]).get(0, math.nan) for r in mine]
        out[method] = {
            "seeds": sorted(r["seed"] for r in mine),
            "steps": steps,
            "mean": [statistics.fmean(by_step[s]) for s in steps],
            "min": [min(by_step[s]) for s in steps],
            "max": [max(by_step[s]) for s in steps],
            "acc_start_mean": statistics.fmean(starts),
            "acc_final_mean": statistics.fmean(finals),
            "acc_final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "gain_mean": statistics.fmean(f - s for f, s in zip(finals, starts, strict=True)),
            "wall_s_mean": statistics.fmean(r["wall_s"] for r in mine),
        }
    return out


def render_markdown(summary: dict[str, Any], settings: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    rollouts = settings["population_size"] * settings["problems_per_step"]
    lines = [
        "# Learning benchmark: DART-ES vs plain ES (and low-rank DART-ES)",
        "",
        f"- Config: `{settings['config']}` (`{settings['model']}` on `{settings['dataset']}`), population "
        f"{settings['population_size']} x {settings['problems_per_step']} problems = {rollouts} rollouts per step, "
        f"{settings['steps']} steps, sigma {settings['sigma']}, learning rate {settings['learning_rate']}, up to "
        f"{settings['max_completion_length']} completion tokens.",
        f"- Held-out: greedy accuracy on {settings['eval_prompts']} test prompts, every {settings['eval_every']} steps.",
    ]
    if runs:
        lines.append(f"- Machine: {runs[0]['machine']}; last run {max(r['date'] for r in runs)}.")
    lines += [
        f"- Command: `python benchmarks/learning.py --methods {' '.join(summary)} --seeds "
        f"{' '.join(str(x) for x in sorted({r['seed'] for r in runs}))}` (finished runs are skipped; "
        "wall times depend on what else ran on the machine).",
        "",
        "| method | seeds | acc. at step 0 | final acc. (mean ± std) | gain (mean) | wall time per run |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for method, s in summary.items():
        lines.append(
            f"| {method} | {', '.join(map(str, s['seeds']))} | {100 * s['acc_start_mean']:.1f}% "
            f"| {100 * s['acc_final_mean']:.1f}% ± {100 * s['acc_final_std']:.1f} | {100 * s['gain_mean']:+.1f} pts "
            f"| {s['wall_s_mean'] / 60:.1f} min |"
        )
    for a, b in (("dart-es", "es"), ("dart-es-lowrank", "dart-es")):
        paired = _paired_differences(runs, a, b)
        if paired:
            diffs = ", ".join(f"seed {seed}: {100 * d:+.1f}" for seed, d in paired)
            mean = statistics.fmean(d for _, d in paired)
            lines += [
                "",
                f"Final accuracy, {a} minus {b}, paired by seed (points): {diffs}; mean {100 * mean:+.1f}.",
            ]
    return "\n".join(lines) + "\n"


def _paired_differences(runs: list[dict[str, Any]], a: str, b: str) -> list[tuple[int, float]]:
    final = {(r["method"], r["seed"]): r["curve"][-1][1] for r in runs}
    seeds = sorted({s for m, s in final if m == a} & {s for m, s in final if m == b})
    return [(s, final[a, s] - final[b, s]) for s in seeds]


def plot(summary: dict[str, Any], settings: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"dart-es": "#4c72b0", "es": "#55a868", "dart-es-lowrank": "#c44e52"}
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for method, s in summary.items():
        color = colors.get(method)
        mean = [100 * v for v in s["mean"]]
        ax.plot(
            s["steps"], mean, marker="o", color=color, label=f"{method} (mean of {len(s['seeds'])} seeds)"
        )
        ax.fill_between(
            s["steps"], [100 * v for v in s["min"]], [100 * v for v in s["max"]], color=color, alpha=0.2
        )
    rollouts = settings["population_size"] * settings["problems_per_step"]
    ax.set_xlabel(f"ES step ({rollouts} rollouts each)")
    ax.set_ylabel("held-out accuracy (%), greedy")
    ax.set_title(f"{settings['model']} on {settings['dataset']}; band: min-max over seeds", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(
    runs_dir: Path, settings: dict[str, Any], output_dir: Path, image: Path
) -> dict[str, Any] | None:
    runs = load_runs(runs_dir, settings)
    if not runs:
        print(f"no finished runs with these settings in {runs_dir}", file=sys.stderr)
        return None
    summary = summarize(runs)
    output_dir.mkdir(parents=True, exist_ok=True)
    report = {"settings": settings, "summary": summary, "runs": runs}
    (output_dir / "learning.json").write_text(json.dumps(report, indent=2) + "\n")
    (output_dir / "learning.md").write_text(render_markdown(summary, settings, runs))
    plot(summary, settings, image)
    print((output_dir / "learning.md").read_text())
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHOD_SWITCHES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument(
        "--config", default=str(DEFAULT_CONFIG_DIR / "quickstart.yaml"), help="DART-ES recipe config"
    )
    p.add_argument("--steps", type=int, help="ES steps per run (default: the config's max_steps)")
    p.add_argument(
        "--eval-every", type=int, default=4, help="evaluate every k steps (and at steps 0 and the last)"
    )
    p.add_argument("--eval-prompts", type=int, default=128)
    p.add_argument("--eval-batch-size", type=int, default=64)
    p.add_argument("--model", help="override the config's model")
    p.add_argument(
        "--dataset", help="override the config's dataset (a task name or a saved DatasetDict folder)"
    )
    p.add_argument("--population", type=int)
    p.add_argument("--prompts", type=int, help="problems per step B")
    p.add_argument("--max-completion-length", type=int)
    p.add_argument("--learning-rate", type=float, help="override the config's learning rate (alpha)")
    p.add_argument("--sigma", type=float, help="override the config's noise scale")
    p.add_argument(
        "--runs-dir", default="docs/benchmarks/learning_runs", help="one JSON per finished (method, seed) run"
    )
    p.add_argument("--output-dir", default="docs/benchmarks", help="learning.json and learning.md go here")
    p.add_argument("--image", default="docs/img/learning.png")
    p.add_argument("--force", action="store_true", help="rerun finished runs too")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from finished runs")
    args = p.parse_args(argv)
    if args.eval_every < 1:
        p.error("--eval-every must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    settings = settings_from_args(args)
    runs_dir = Path(args.runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for seed in args.seeds:
            for method in args.methods:
                path = run_path(runs_dir, method, seed)
                if (
                    path.is_file()
                    and not args.force
                    and json.loads(path.read_text()).get("settings") == settings
                ):
                    print(f"skip {method} seed {seed}: finished ({path})")
                    continue
                print(f"run {method} seed {seed} ...", flush=True)
                result = run_one(method, seed, args, settings)
                tmp = path.with_suffix(".json.tmp")
                tmp.write_text(json.dumps(result, indent=2) + "\n")
                tmp.replace(path)  # a run file is either complete or absent
                curve = ", ".join(f"{s}:{100 * a:.1f}%" for s, a in result["curve"])
                print(f"done {method} seed {seed} in {result['wall_s'] / 60:.1f} min: {curve}", flush=True)
    return write_report(runs_dir, settings, Path(args.output_dir), Path(args.image))


if __name__ == "__main__":
    main()
