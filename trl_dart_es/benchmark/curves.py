"""Accuracy against training wall-clock time (`python -m trl_dart_es.benchmark --curves`).

Each (method, seed) trains in its own child process on the side-by-side benchmark's workload (model, data,
rewards, completion length, rollouts per step; the rest from the method's recipe config) until a budget of
training seconds, the sum of step durations (evaluation never eats into it). The harness's greedy held-out
accuracy (`evaluate_trainer`) is taken at step 0 and at the first step end at or after each evaluation mark.
Every finished run goes to `<runs-dir>/<method>-seed<k>[-<tag>].json` at once and a rerun skips finished runs
with the same settings, so a long study can run in pieces; the report (`curves.{json,md,png}`) covers every
finished run with the current settings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..digest import json_digest
from .clock import StepClock
from .machine import machine_description, machines_summary, utc_now
from .methods import METHODS
from .process import failure, last_line, peak_memory, spawn
from .report import interval, pyplot, save_figure, table, write_json_atomic
from .stats import includes_zero, paired_t_interval
from .workload import DEFAULT_OUTPUT_DIR, REPO_ROOT, Workload, _config_path

# The curves' workload: rollouts per step and completion length from the DART-ES config (the demo), 512 held-out
# prompts (one prompt = 0.2 points), evaluated 64 at a time.
CURVES = Workload(population=None, prompts=None, eval_prompts=512, eval_batch_size=64)
DEFAULT_BUDGET_MINUTES = 15.0
DEFAULT_EVAL_AT_MINUTES = (2.5, 5.0, 7.5, 10.0, 12.5, 15.0)
DEFAULT_SEEDS = (0, 1, 2)
REPORT_MINUTES = (5.0, 10.0, 15.0)
DEFAULT_RUNS_DIR = DEFAULT_OUTPUT_DIR / "curves_runs"
DEFAULT_IMAGE = Path("docs") / "img" / "curves.png"
# Training runs until the budget stops it: max_steps only has to be out of reach (the recipes' step size and
# GRPO's learning rate are constant, so it changes no schedule).
_MAX_STEPS = 10_000_000
# Metrics of an evaluation kept in each point, besides `accuracy` and every `accuracy/<group>`.
_POINT_METRICS = ("reward", "completions/mean_length", "completions/clipped_ratio")
# Override keys that change the workload (of every method when not prefixed), not one recipe config.
_WORKLOAD_KEYS = {
    "population": "population", "population_size": "population", "prompts": "prompts",
    "max_completion_length": "max_completion_length", "prompt_style": "prompt_style", "task_version": "task_version",
    "model_name_or_path": "model", "dataset_name": "dataset", "dtype": "dtype",
}  # fmt: skip
_TAG = re.compile(r"^[A-Za-z0-9._-]+$")


# ----------------------------------------------------------------------------------------- the clock
class CurveClock(StepClock):
    """The step clock with evaluation at marks of training time (evaluation left out of it) and a budget.

    `step_end` evaluates when the step crosses one or more marks (one evaluation serves them all). It runs in
    `on_step_end` rather than through `control.should_evaluate`: GRPOTrainer's own evaluate() would sample with
    its own settings, while this is the harness's greedy evaluation, the same for every method.
    """

    def __init__(
        self,
        budget_s: float,
        eval_at_s: Iterable[float],
        evaluate: Callable[[], Mapping[str, float]] | None = None,
        progress: Callable[[str], None] | None = None,
    ):
        if budget_s <= 0:
            raise ValueError(f"the budget must be positive, got {budget_s} s")
        super().__init__(budget_s, progress)
        self.marks = _eval_marks(self.budget_s, eval_at_s)
        self.evaluate = evaluate
        self.eval_seconds = 0.0
        self.points: list[dict[str, Any]] = []
        self._next_mark = 0

    def step_end(self, step: int) -> bool:
        """Count the step just ended; evaluate if it crossed a mark; True when training should stop."""
        self._count(step)
        crossed = []
        while self._next_mark < len(self.marks) and self.marks[self._next_mark] <= self.train_seconds:
            crossed.append(self.marks[self._next_mark])
            self._next_mark += 1
        if crossed:
            self.record(step, crossed)
        last = f", acc {100 * self.points[-1]['accuracy']:.1f}%" if self.points else ""
        self.progress(f"train {self.train_seconds:.0f}/{self.budget_s:.0f} s, step {step}{last}")
        return self.spent()

    def record(self, step: int, marks: Sequence[float], metrics: Mapping[str, float] | None = None) -> dict:
        """Evaluate now (unless `metrics` are given) and add the point; its time goes to `eval_seconds` only."""
        started = time.perf_counter()
        if metrics is None:
            if self.evaluate is None:
                raise RuntimeError("CurveClock has no evaluate function")
            self.progress(f"evaluating at step {step}")
            metrics = self.evaluate()
        spent = time.perf_counter() - started
        self.eval_seconds += spent
        point = {"step": int(step), "train_seconds": self.train_seconds, "accuracy": float(metrics["accuracy"]),
                 "marks": [float(m) for m in marks], "eval_seconds": spent}  # fmt: skip
        point.update(
            (k, float(v)) for k, v in metrics.items() if k.startswith("accuracy/") or k in _POINT_METRICS
        )
        self.points.append(point)
        return point

    def finish(self, step: int) -> None:
        """After training: evaluate the last step if it has no point yet (training ended before the budget)."""
        if not self.points or self.points[-1]["step"] != step:
            self.record(step, [])


# ----------------------------------------------------------------------------------------- settings
def curve_capable(method: str) -> bool:
    """Whether `method` trains (ES or GRPO) in one process: the budget's clock and stop are per process."""
    m = METHODS[method]
    return m.kind in ("es", "grpo") and m.launch is None


def parse_overrides(items: Iterable[str]) -> dict[str, dict[str, Any]]:
    """`--set` items, `key=value` (every method) or `method:key=value` (one method), the value parsed as a YAML
    scalar (`0.003`, `1e-3`, `true`, `lowrank`); returns {"*": {...}, "<method>": {...}}."""
    import yaml

    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set wants [method:]key=value, got {item!r}")
        scope, _, key = key.strip().rpartition(":")
        if scope and scope not in METHODS:
            raise ValueError(f"--set {item!r}: unknown method {scope!r}; known: {', '.join(METHODS)}")
        value = yaml.safe_load(text) if text.strip() else None
        # YAML 1.1 reads `1e-3` (no dot) as a string; a learning rate written that way is meant as a number.
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(value)
        out.setdefault(scope or "*", {})[key.strip()] = value
    return out


def overrides_for(method: str, parsed: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The overrides of one method: those for every method, then the method's own."""
    return {**parsed.get("*", {}), **parsed.get(method, {})}


def split_overrides(workload: Workload, overrides: Mapping[str, Any]) -> tuple[Workload, dict[str, Any]]:
    """(workload with the workload keys of `overrides` applied, the remaining recipe-config overrides)."""
    changes = {_WORKLOAD_KEYS[k]: v for k, v in overrides.items() if k in _WORKLOAD_KEYS}
    return replace(workload, **changes), {k: v for k, v in overrides.items() if k not in _WORKLOAD_KEYS}


def _eval_marks(budget_s: float, eval_at_s: Iterable[float]) -> list[float]:
    """The marks within the budget, and the budget's end (marks past it are never reached)."""
    return sorted({float(m) for m in eval_at_s if 0 < m < budget_s} | {float(budget_s)})


def curve_settings(
    method: str,
    workload: Workload,
    budget_s: float,
    eval_at_s: Iterable[float],
    overrides: Mapping[str, Any] | None = None,
    tag: str | None = None,
) -> dict[str, Any]:
    """What makes two runs of `method` comparable (a finished run with the same settings is not run again): the
    workload, budget and marks, the recipe config (its path and a hash of its values, so that editing a comment
    does not make runs stale), the method's own fields and the run's overrides."""
    workload, config_overrides = split_overrides(workload.resolved(), overrides or {})
    workload = workload.resolved()
    keys = ("model", "dataset", "train_split", "test_split", "population", "prompts", "max_completion_length",
            "prompt_style", "eval_prompts", "eval_batch_size", "dtype", "device")  # fmt: skip
    config = _config_path(METHODS[method], workload)
    digest = None
    if config is not None:
        digest = config_digest(config)
        path = Path(config).resolve()
        config = str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)
    if workload.task_version is not None:  # only when set: runs measured before the field existed stay fresh
        keys += ("task_version",)
    return {
        "workload": {k: getattr(workload, k) for k in keys},
        "budget_s": float(budget_s),
        "eval_at_s": _eval_marks(budget_s, eval_at_s),
        "config": config,
        "config_sha256": digest,
        "method_overrides": dict(METHODS[method].overrides),
        "overrides": dict(config_overrides),
        "tag": tag,
    }


def config_digest(path: str | Path) -> str:
    """A hash of a YAML config's content (keys and values, not comments or layout)."""
    import yaml

    return json_digest(yaml.safe_load(Path(path).read_text()), 16)


def curve_run_path(runs_dir: str | Path, method: str, seed: int, tag: str | None = None) -> Path:
    """Where the run of (method, seed[, tag]) is written."""
    return Path(runs_dir) / (f"{method}-seed{seed}" + (f"-{tag}" if tag else "") + ".json")


def finished_run(path: str | Path, settings: Mapping[str, Any]) -> dict | None:
    """The run stored at `path` if it finished with `settings`, else None."""
    with contextlib.suppress(ValueError, OSError):
        run = json.loads(Path(path).read_text())
        if run.get("status") == "ok" and run.get("settings") == dict(settings):
            return run
    return None


# ----------------------------------------------------------------------------------------- child: one curve
def _step0_cache_path(trainer, workload: Workload, kind: str, held_out) -> Path | None:
    """Where the untrained model's metrics are cached (the one cache of `trl_dart_es.trainer.baseline`, for an
    embedded model only), keyed by all that changes the harness's evaluation, the held-out rows included."""
    from ..trainer.baseline import generation_precision, untrained_cache_file

    args = trainer.args
    parts = {
        "rows": json_digest(held_out.to_dict()),
        "workload": {k: getattr(workload, k) for k in ("model", "dtype", "dataset", "test_split", "eval_prompts",
                                                         "eval_batch_size", "max_completion_length", "prompt_style")},
        # The evaluation path: transformers (plain or PEFT-wrapped model) or DART-ES's vLLM engine.
        "backend": "vllm" if kind == "es" and getattr(args, "use_vllm", False) else "transformers",
        "peft": hasattr(trainer.model, "peft_config"),
        "reward_weights": [float(w) for w in (args.reward_weights or [])],
        "device": str(next(trainer.model.parameters()).device.type),
        **(generation_precision(trainer) if kind == "es" else {}),
    }  # fmt: skip
    return untrained_cache_file(workload.model, parts, prefix="harness-")


def curve_child(
    spec: Mapping[str, Any], workload: Workload, progress: Callable[[str], None]
) -> dict[str, Any]:
    """In the child process: train one (method, seed) for the budget and return its curve."""
    from ..scoring import ACCURACY_GROUPS
    from ..trainer.baseline import read_cached, write_cached
    from .evaluation import evaluate_trainer
    from .trainers import _per_step, build_trainer
    from .workload import held_out_set

    method = METHODS[spec["method"]]
    overrides = {"max_steps": _MAX_STEPS, **spec.get("overrides", {})}
    clock = CurveClock(spec["budget_s"], spec["eval_at_s"], progress=progress)
    with tempfile.TemporaryDirectory(prefix=f"curve-{method.name}-") as out:
        progress("loading")
        trainer, config, batches = build_trainer(method, workload, out, [clock.callback()], overrides)
        held_out = held_out_set(workload)
        # How many held-out prompts each group has (a per-level accuracy over few prompts is noisy).
        group_sizes = {
            f"{label}{value}": held_out[column].count(value)
            for column, label in ACCURACY_GROUPS.items()
            if column in held_out.column_names
            for value in sorted(set(held_out[column]))
        }
        clock.evaluate = lambda: evaluate_trainer(trainer, workload, held_out, vllm_path=True)
        # Step 0: the untrained model, from the cache when it cannot have changed.
        cache = _step0_cache_path(trainer, workload, method.kind, held_out)
        cached = read_cached(cache)
        point = clock.record(0, [0.0], cached)
        point["cached"] = cached is not None
        if cached is None:
            write_cached(
                cache, {k: v for k, v in point.items() if k == "accuracy" or k in _POINT_METRICS or "/" in k}
            )
        started, eval_before = time.perf_counter(), clock.eval_seconds
        trainer.train()
        # train() from start to end without the evaluations in it: also counts logging and data loading.
        train_wall = time.perf_counter() - started - (clock.eval_seconds - eval_before)
        clock.finish(trainer.state.global_step)
        history = trainer.state.log_history
        train_log = [
            {k: v for k, v in e.items() if k == "step" or k in ("reward", "completions/mean_length")
             or k.startswith(("rewards/", "dart/", "completions/clipped"))}
            for e in history if "reward" in e
        ]  # fmt: skip
        return {
            "config": config, **batches, "points": clock.points, "steps": trainer.state.global_step,
            "train_seconds": clock.train_seconds, "eval_seconds": clock.eval_seconds, "train_wall_s": train_wall,
            "step_times_s": clock.step_times, "train_reward": _per_step(history, "reward"), "train_log": train_log,
            "stop": "budget" if clock.train_seconds >= clock.budget_s else "max_steps", "group_sizes": group_sizes,
        }  # fmt: skip


# ----------------------------------------------------------------------------------------- parent: runs
def run_curve(
    method: str,
    seed: int,
    workload: Workload,
    budget_s: float,
    eval_at_s: Sequence[float],
    overrides: Mapping[str, Any] | None = None,
    tag: str | None = None,
    *,
    runs_dir: str | Path | None = None,
    work_dir: str | Path | None = None,
    command: str = "",
    timeout_s: float | None = None,
    force: bool = False,
    bar=None,
) -> dict[str, Any]:
    """Train `method` with `seed` on `workload` for `budget_s` training seconds in a child process; return the
    run: `method`, `seed`, `status`, `eval_prompts`, `peak_mem_mb`, `points` (first at step 0), ...

    `overrides` are recipe-config fields (workload keys change the workload instead: `split_overrides`); `tag`
    names the run and its file. With `runs_dir`, a finished run with the same settings there is returned as is
    (unless `force`), and a new finished run is written there at once. `work_dir` holds the child's files
    (default: a temporary folder); `timeout_s` stops the child (default: 3 x budget + 1 h, for evaluations).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    if not curve_capable(method):
        raise ValueError(f"{method}: curves need a single-process training method (es or grpo kind)")
    if tag is not None and not _TAG.match(tag):
        raise ValueError(f"tag {tag!r}: use letters, digits, '.', '_' and '-' only")
    settings = curve_settings(method, workload, budget_s, eval_at_s, overrides, tag)
    path = curve_run_path(runs_dir, method, seed, tag) if runs_dir is not None else None
    if path is not None and not force and (done := finished_run(path, settings)) is not None:
        return done
    run_workload, config_overrides = split_overrides(workload.resolved(), overrides or {})
    timeout = timeout_s if timeout_s is not None else 3 * budget_s + 3600.0
    run_workload = replace(run_workload.resolved(), seed=seed, timeout_s=timeout)
    extra = {"mode": "curve", "budget_s": float(budget_s), "eval_at_s": settings["eval_at_s"],
             "overrides": config_overrides}  # fmt: skip
    stem = f"curve-{method}-seed{seed}" + (f"-{tag}" if tag else "")
    with contextlib.ExitStack() as stack:
        work = work_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="trl-dart-es-curve-"))
        result, observed = spawn(method, run_workload, Path(work), bar, extra=extra, stem=stem)
    run: dict[str, Any] = {"method": method, "seed": seed, "tag": tag, "status": "ok",
                           "eval_prompts": run_workload.eval_prompts,
                           "rollouts_per_step": run_workload.rollouts_per_step, "budget_s": float(budget_s)}  # fmt: skip
    run.update(failure(observed) if result is None else {**peak_memory(result, observed), **result})
    run.update(wall_s=observed.get("wall_s"), machine=machine_description(), date=utc_now(), command=command,
               settings=settings)  # fmt: skip
    if path is not None and run["status"] == "ok":
        write_json_atomic(path, run)
    return run


def load_curve_runs(
    runs_dir: str | Path, settings_by_method: Mapping[str, Mapping[str, Any]]
) -> tuple[list[dict], list[Path]]:
    """Finished runs in `runs_dir` whose settings are those given for their method, in the methods' order
    (then by seed); and the run files left out (other settings or other methods)."""
    runs, ignored = [], []
    for path in sorted(Path(runs_dir).glob("*.json")):
        with contextlib.suppress(ValueError, OSError):
            run = json.loads(path.read_text())
            wanted = settings_by_method.get(run.get("method"))
            if run.get("status") == "ok" and wanted is not None and run.get("settings") == dict(wanted):
                runs.append(run)
                continue
        ignored.append(path)
    order = {m: i for i, m in enumerate(settings_by_method)}
    runs.sort(key=lambda r: (order[r["method"]], r["seed"]))
    return runs, ignored


# ----------------------------------------------------------------------------------------- summaries
def point_at(run: Mapping[str, Any], t_s: float) -> dict | None:
    """The run's accuracy at `t_s` training seconds: the point evaluated for that mark (the first step end at
    or after it), else the last point at or before it."""
    for point in run["points"]:
        if any(abs(m - t_s) < 1e-6 for m in point.get("marks", [])):
            return point
    before = [p for p in run["points"] if p["train_seconds"] <= t_s]
    return before[-1] if before else None


def report_times(budget_s: float, eval_marks_s: Iterable[float] | None = None) -> list[float]:
    """The times of the report's table: 5, 10 and 15 minutes where within the budget, and the budget's end.
    Given the marks every run was evaluated at, those times are kept only if each is such a mark; else the
    marks themselves are the times, so that no column repeats an earlier evaluation under a later label."""
    times = [60 * m for m in REPORT_MINUTES if 60 * m <= budget_s + 1e-9]
    times = times if times and abs(times[-1] - budget_s) < 1e-6 else [*times, float(budget_s)]
    if eval_marks_s is None:
        return times
    marks = sorted({float(m) for m in eval_marks_s})
    if not marks or all(any(abs(t - m) < 1e-6 for m in marks) for t in times):
        return times
    return marks


def common_eval_marks(runs: Sequence[Mapping[str, Any]]) -> list[float] | None:
    """The evaluation marks (seconds, the budget's end included) that every run's settings share; None when a
    run does not record them."""
    sets = [r.get("settings", {}).get("eval_at_s") for r in runs]
    if not sets or any(s is None for s in sets):
        return None
    return sorted(set.intersection(*(set(map(float, s)) for s in sets)))


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize_curves(runs: Sequence[Mapping[str, Any]], times_s: Sequence[float]) -> dict[str, Any]:
    """Per method (in run order): seeds, accuracy at each time (mean, min, max over seeds), steps, peak memory,
    per-group accuracy at the end; and the paired differences of the first method against each other one."""
    methods = list(dict.fromkeys(r["method"] for r in runs))
    out: dict[str, Any] = {"times_s": list(times_s), "methods": {}, "paired": []}
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        at = {}
        for t in times_s:
            values = [p["accuracy"] for r in mine if (p := point_at(r, t)) is not None]
            at[str(t)] = _spread(values) if values else None
        first, last = [r["points"][0] for r in mine], [r["points"][-1] for r in mine]
        groups = sorted({k for p in last for k in p if k.startswith("accuracy/")})
        out["methods"][method] = {
            "seeds": [r["seed"] for r in mine],
            "start": _spread([p["accuracy"] for p in first]),
            "at": at,
            "end": _spread([p["accuracy"] for p in last]),
            "groups_end": {g: _spread([p[g] for p in last if g in p]) for g in groups},
            "groups_start": {
                g: _spread([p[g] for p in first if g in p]) for g in groups if any(g in p for p in first)
            },
            "steps": _spread([r["steps"] for r in mine]),
            "peak_mem_mb": _spread([r["peak_mem_mb"] for r in mine]),
        }
    for other in methods[1:]:
        for t in times_s:
            diffs = paired_differences(runs, methods[0], other, t)
            if diffs:
                mean, lo, hi = paired_t_interval([d for _, d in diffs])
                out["paired"].append({"a": methods[0], "b": other, "t_s": t, "diffs": diffs, "mean": mean,
                                      "low": lo, "high": hi, "includes_zero": includes_zero(lo, hi)})  # fmt: skip
    return out


def paired_differences(
    runs: Sequence[Mapping[str, Any]], a: str, b: str, t_s: float
) -> list[tuple[int, float]]:
    """(seed, accuracy of `a` minus accuracy of `b` at `t_s`) for every seed both methods finished."""
    acc = {(r["method"], r["seed"]): p["accuracy"] for r in runs if (p := point_at(r, t_s)) is not None}
    seeds = sorted({s for m, s in acc if m == a} & {s for m, s in acc if m == b})
    return [(s, acc[a, s] - acc[b, s]) for s in seeds]


# ----------------------------------------------------------------------------------------- report
def _when(t_s: float) -> str:
    return f"{t_s / 60:g} min" if t_s >= 60 else f"{t_s:g} s"


def _spread_text(
    s: Mapping[str, float] | None, scale: float = 100, fmt: str = ".1f", mean_fmt: str = ""
) -> str:
    """`mean` of one value, `mean (min–max)` of several (`mean_fmt` for the mean then), scaled; "–" of none."""
    if not s:
        return "–"
    if s["n"] == 1:
        return format(scale * s["mean"], fmt)
    low, high = format(scale * s["min"], fmt), format(scale * s["max"], fmt)
    return f"{format(scale * s['mean'], mean_fmt or fmt)} ({low}–{high})"


def machine_line(runs: Sequence[Mapping[str, Any]]) -> str:
    """The machine of every run; where they differ, each CPU with its number of runs (compare a seed's methods
    with each other, not seeds across CPUs)."""
    machines = list(dict.fromkeys(r["machine"] for r in runs))
    if len(machines) == 1:
        return f"Machine: {machines[0]}"
    return f"Machines (each run's file names its own): {machines_summary(runs)}"


def render_curves_markdown(runs: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> str:
    """curves.md: accuracy at fixed training times with peak memory, paired differences, accuracy per group."""
    lines = ["# Accuracy against training time: DART-ES vs ES vs GRPO vs GRPO+LoRA", ""]
    if not runs:
        return "\n".join([*lines, "No finished runs.", ""])
    first = runs[0]
    s, w = first["settings"], first["settings"]["workload"]
    rollouts = f"{w['population']} x {w['prompts']} = {w['population'] * w['prompts']}"
    commands = list(dict.fromkeys(r["command"] for r in runs))  # each run records the invocation that made it
    lines += [
        f"- {machine_line(runs)}; runs finished {min(r['date'] for r in runs)} to "
        f"{max(r['date'] for r in runs)}.",
        f"- Command{'s' if len(commands) > 1 else ''}: {', '.join(f'`{c}`' for c in commands)} (finished runs are "
        "skipped on rerun; `--report-only` rebuilds this page).",
        f"- Workload: `{w['model']}` ({w['dtype']}) on `{w['dataset']}`"
        + (f", prompt style `{w['prompt_style']}`" if w.get("prompt_style") else "")
        + (f", task version {w['task_version']}" if w.get("task_version") is not None else "")
        + f"; {rollouts} rollouts per step, up to {w['max_completion_length']} completion tokens; each method's "
        "other hyperparameters from its recipe config.",
        f"- Budget: {_when(s['budget_s'])} of training per run, counted as the sum of step durations (evaluation "
        f"excluded); greedy held-out accuracy on {w['eval_prompts']} test prompts (one prompt = "
        f"{100 / w['eval_prompts']:.2f} points) at step 0 and at the first step end after "
        + ", ".join(_when(t) for t in s["eval_at_s"])
        + ", with the same evaluation function for every method.",
        "",
    ]
    times = summary["times_s"]
    lines += [
        "Accuracy (%), mean (min–max) over seeds; the value at a time is the evaluation at the first step end at "
        "or after it. Steps: optimizer steps in the budget. Peak memory: the run's process tree (CPU RSS) or "
        "CUDA `max_memory_reserved`, over the whole run (loading and evaluation included).",
        "",
        "| method | seeds | step 0 | "
        + " | ".join(f"at {_when(t)}" for t in times)
        + " | steps | peak memory (GB) |",
        "| --- | --- | ---: | " + " | ".join("---:" for _ in times) + " | ---: | ---: |",
    ]
    for method, m in summary["methods"].items():
        cells = " | ".join(_spread_text(m["at"][str(t)]) for t in times)
        lines.append(
            f"| {method} | {', '.join(map(str, m['seeds']))} | {_spread_text(m['start'])} | {cells} "
            f"| {_spread_text(m['steps'], 1, '.0f', '.1f')} | {_spread_text(m['peak_mem_mb'], 1 / 1024, '.2f')} |"
        )
    paired = []
    for p in summary["paired"]:
        per_seed = ", ".join(f"seed {seed}: {100 * d:+.1f}" for seed, d in p["diffs"])
        if math.isnan(p["low"]):
            ci, verdict = "–", "one seed: no interval"
        else:
            ci = interval(p["low"], p["high"])
            verdict = "interval includes zero" if p["includes_zero"] else "interval excludes zero"
        paired.append(f"| {p['a']} − {p['b']} | {_when(p['t_s'])} | {per_seed} | {100 * p['mean']:+.1f} | {ci} "
                      f"| {verdict} |")  # fmt: skip
    lines += table(
        "Paired differences by seed (accuracy points, first method minus the other, same seed), mean and 95% "
        "t-interval:",
        "| difference | at | per seed | mean | 95% interval | |", "| --- | --- | --- | ---: | --- | --- |",
        paired,
    )  # fmt: skip
    groups = sorted({g for m in summary["methods"].values() for g in m["groups_end"]})
    if groups:
        start = next(iter(summary["methods"].values()))["groups_start"]
        rows = [("untrained (step 0)", start)] if start else []
        rows += [(method, m["groups_end"]) for method, m in summary["methods"].items()]
        lines += table(
            "Accuracy (%) per group of the held-out set at the end of the budget (level = arithmetic operations; "
            "wording_held_out = phrasings never seen in training), mean (min–max) over seeds:",
            "| method | " + " | ".join(g.removeprefix("accuracy/") for g in groups) + " |",
            "| --- | " + " | ".join("---:" for _ in groups) + " |",
            [f"| {name} | " + " | ".join(_spread_text(values.get(g)) for g in groups) + " |" for name, values in rows],
        )  # fmt: skip
        if first.get("group_sizes"):
            lines += [
                "",
                "Prompts per group: " + ", ".join(f"{k}: {v}" for k, v in first["group_sizes"].items()) + ".",
            ]
    return "\n".join(lines) + "\n"


def plot_curves(runs: Sequence[Mapping[str, Any]], path: str | Path) -> None:
    """Accuracy against training minutes: per method, the mean over seeds at each mark with a min–max band,
    and each seed's own curve faintly."""
    palette = {"dart-es": "#4c72b0", "es": "#55a868", "grpo": "#c44e52", "grpo-lora": "#dd8452",
               "dart-es-vllm-lowrank": "#4c72b0", "es-vllm-lowrank": "#55a868", "dart-es-demo": "#4c72b0",
               "es-demo": "#55a868"}  # fmt: skip
    fig, ax = pyplot().subplots(figsize=(7.5, 4.5))
    for i, method in enumerate(dict.fromkeys(r["method"] for r in runs)):
        mine = [r for r in runs if r["method"] == method]
        color = palette.get(method, f"C{i + 4}")
        for r in mine:
            minutes, acc = (
                [p["train_seconds"] / 60 for p in r["points"]],
                [100 * p["accuracy"] for p in r["points"]],
            )
            ax.plot(minutes, acc, color=color, alpha=0.25, linewidth=0.8)
        # Align the seeds on their marks (step 0 is mark 0): x is the mean training time of those points.
        marks = sorted({m for r in mine for p in r["points"] for m in p.get("marks", [])})
        xs, mean, low, high = [], [], [], []
        for mark in marks:
            pts = [p for r in mine for p in r["points"] if mark in p.get("marks", [])]
            acc = [100 * p["accuracy"] for p in pts]
            xs.append(statistics.fmean(p["train_seconds"] for p in pts) / 60)
            mean.append(statistics.fmean(acc))
            low.append(min(acc))
            high.append(max(acc))
        label = f"{method} ({len(mine)} seed{'s' if len(mine) != 1 else ''})"
        ax.plot(xs, mean, marker="o", markersize=3, color=color, label=label)
        ax.fill_between(xs, low, high, color=color, alpha=0.18, linewidth=0)
    if runs:
        w = runs[0]["settings"]["workload"]
        title = (
            f"{w['model']} on {w['dataset']}, {w['eval_prompts']} held-out prompts; band: min–max over seeds"
        )
        ax.set_title(title, fontsize=9)
    ax.set_xlabel("training time (min), evaluation excluded")
    ax.set_ylabel("held-out accuracy (%), greedy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    save_figure(fig, path)


def write_curve_report(
    runs: Sequence[Mapping[str, Any]], output_dir: str | Path, image: str | Path, name: str = "curves"
) -> dict[str, Path]:
    """Write `<output_dir>/<name>.json` ({"runs": [...], "summary": ...}), `<name>.md` and the plot `image`."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    budget = max((r["budget_s"] for r in runs), default=60 * DEFAULT_BUDGET_MINUTES)
    summary = summarize_curves(runs, report_times(budget, common_eval_marks(runs)))
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md", "png": Path(image)}
    paths["json"].write_text(
        json.dumps({"runs": list(runs), "summary": summary}, indent=1, default=str) + "\n"
    )
    paths["md"].write_text(render_curves_markdown(runs, summary))
    plot_curves(runs, paths["png"])
    return paths


# ----------------------------------------------------------------------------------------- CLI
def curves_main(
    args: argparse.Namespace, methods: Sequence[str], workload: Workload, command: str
) -> list[dict]:
    """`--curves`: run every (method, seed) not finished yet, then write the report over all finished runs."""
    from tqdm.auto import tqdm

    methods = list(dict.fromkeys(methods))
    parsed = parse_overrides(args.set or [])
    unknown = [m for m in [*methods, *(k for k in parsed if k != "*")] if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    unable = [m for m in methods if not curve_capable(m)]
    if unable:
        raise SystemExit(f"--curves trains single-process ES or GRPO methods only, not {', '.join(unable)}")
    if args.tag is not None and not _TAG.match(args.tag):
        raise SystemExit(f"--tag {args.tag!r}: use letters, digits, '.', '_' and '-' only")
    budget_s = 60 * args.budget_minutes
    eval_at_s = [60 * m for m in args.eval_at_minutes]
    overrides = {m: overrides_for(m, parsed) for m in methods}
    settings = {m: curve_settings(m, workload, budget_s, eval_at_s, overrides[m], args.tag) for m in methods}
    runs_dir = Path(args.runs_dir)
    if not args.report_only:
        todo = []
        for seed in args.seeds:
            for m in methods:
                path = curve_run_path(runs_dir, m, seed, args.tag)
                if not args.force and finished_run(path, settings[m]) is not None:
                    print(f"skip {m} seed {seed}: finished ({path})", flush=True)
                else:
                    todo.append((m, seed))
        with (
            contextlib.ExitStack() as stack,
            tqdm(total=len(todo), unit="run", disable=args.no_progress) as bar,
        ):
            work = args.work_dir or stack.enter_context(
                tempfile.TemporaryDirectory(prefix="trl-dart-es-curves-")
            )
            for m, seed in todo:
                bar.set_description(f"{m} seed {seed}")
                tqdm.write(f"run {m} seed {seed} ...")
                run = run_curve(m, seed, workload, budget_s, eval_at_s, overrides[m], args.tag, runs_dir=runs_dir,
                                work_dir=work, command=command, timeout_s=args.timeout, force=True, bar=bar)  # fmt: skip
                if run["status"] == "ok":
                    curve = ", ".join(f"{p['step']}:{100 * p['accuracy']:.1f}%" for p in run["points"])
                    tqdm.write(f"done {m} seed {seed}: {run['steps']} steps, {curve}")
                else:
                    tqdm.write(f"{m} seed {seed} {run['status'].upper()}: {last_line(run.get('error'))}")
                bar.update()
    runs, ignored = load_curve_runs(runs_dir, settings)
    if ignored:
        print(
            f"note: {len(ignored)} run file(s) in {runs_dir} with other methods or settings left out",
            file=sys.stderr,
        )
    if not runs:
        print(f"no finished runs with these settings in {runs_dir}", file=sys.stderr)
        return []
    name = "curves" + (f"-{args.tag}" if args.tag else "")
    image = Path(args.image) if args.image else DEFAULT_IMAGE.with_name(f"{name}.png")
    paths = write_curve_report(runs, args.output_dir, image, name)
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return runs
