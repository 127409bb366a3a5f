"""The side-by-side benchmark (`run_benchmark`): one row per method, each trained in its own child process
(`process.spawn`, so that its peak memory is its own); the runners here are what the child runs."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .clock import StepClock
from .evaluation import evaluate_workload
from .machine import machine_description, utc_now
from .methods import METHODS, BenchMethod
from .process import failure, last_line, peak_memory, spawn
from .report import ROW_KEYS, _add_relative, _fmt_acc
from .trainers import _per_step, _use_cuda, build_trainer, es_trainer
from .workload import Workload

__all__ = ["ROW_KEYS", "RUNNERS", "run_benchmark", "summarize_run"]


def _run_training(method: BenchMethod, workload: Workload, progress: Callable[[str], None]) -> dict[str, Any]:
    """ES or GRPO: the workload's steps, timed end to end by the step clock."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{method.name}-") as out:
        progress("loading")
        clock = StepClock(progress=progress)
        trainer, config, batches = build_trainer(method, workload, out, [clock.callback()])
        trainer.train()
        history = trainer.state.log_history
        tokens = [m * workload.rollouts_per_step for m in _per_step(history, "completions/mean_length")]
        result = {"config": config, "trainer": trainer, "reward_weights": trainer.args.reward_weights, **batches,
                  "step_times_s": clock.wall_step_times, "completion_tokens": tokens,
                  "train_reward": _per_step(history, "reward")}  # fmt: skip
        if method.kind == "es":  # DART-ES logs its generation throughput; GRPO does not
            generation = _per_step(history, "tokens_per_s")[workload.warmup_steps :]
            result["generation_tokens_per_s"] = _median_or_nan(generation)
        return result


def _run_inference(
    method: BenchMethod, workload: Workload, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Generate each step's N x B rollouts with the unperturbed model, as one batch (the trainer's own rollout)."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{method.name}-") as out:
        progress("loading")
        trainer, config = es_trainer(method, workload, out, [])
        data = trainer.train_dataset
        times, tokens = [], []
        for step in range(workload.steps):
            progress(f"step {step + 1}/{workload.steps}")
            rows = range(step * workload.prompts, (step + 1) * workload.prompts)
            prompts = [data[i % len(data)]["prompt"] for i in rows] * workload.population
            started = time.perf_counter()
            gen = trainer.rollout.generate(prompts)
            times.append(time.perf_counter() - started)
            tokens.append(gen.num_tokens)
        return {"config": config, "trainer": None, "step_times_s": times, "completion_tokens": tokens}


# Runners train one method in the child process and return at least `step_times_s`, `completion_tokens` (per
# step) and the `trainer` (its model is evaluated afterwards; None: nothing was trained, no accuracy).
RUNNERS: dict[str, Callable[[BenchMethod, Workload, Callable[[str], None]], dict[str, Any]]] = {
    "es": _run_training,
    "grpo": _run_training,
    "inference": _run_inference,
}


def _baseline(workload: Workload, progress: Callable[[str], None]) -> dict[str, Any]:
    """Held-out metrics of the untrained model: every row's `acc_before` (greedy, so one run serves all)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..embedded import resolve_model_path

    progress("loading")
    path = resolve_model_path(workload.model)
    device = "cuda" if _use_cuda(workload) else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, workload.dtype)).to(device)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    progress("evaluating")
    return {"eval": evaluate_workload(model, tokenizer, workload)}


def _median_or_nan(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def summarize_run(step_times: Sequence[float], completion_tokens: Sequence[float], warmup_steps: int) -> dict:
    """Median step time and rollout throughput over the steps after warm-up (every step, and `timed_steps`
    says so, when none is left after warm-up)."""
    times = list(step_times)
    timed = times[warmup_steps:] if len(times) > warmup_steps else times
    first = len(times) - len(timed)
    tokens = list(completion_tokens)[first : first + len(timed)]
    seconds = sum(timed[: len(tokens)])
    rate = sum(tokens) / seconds if tokens and seconds > 0 else float("nan")
    return {"step_time_s_median": _median_or_nan(timed), "tokens_per_s": rate, "timed_steps": len(timed)}


def _row(method: BenchMethod, workload: Workload, result: dict | None, observed: dict, context: dict) -> dict:
    row: dict[str, Any] = {
        "method": method.name, "description": method.description, "status": "ok",
        "rollouts_per_step": workload.rollouts_per_step, "step_time_s_median": None, "peak_mem_mb": None,
        "peak_mem_mb_max_process": None, "tokens_per_s": None, "acc_before": context["acc_before"],
        "acc_after": None, **{k: context[k] for k in ("machine", "date", "command")},
        "workload": workload.comparable(),
    }  # fmt: skip
    if result is None:
        return {**row, **failure(observed), "wall_s": observed.get("wall_s")}
    summary = summarize_run(result["step_times_s"], result["completion_tokens"], workload.warmup_steps)
    row.update(
        step_time_s_median=summary["step_time_s_median"],
        **peak_memory(result, observed),
        tokens_per_s=summary["tokens_per_s"],
        acc_after=result["eval"]["accuracy"] if "eval" in result else None,
        timed_steps=summary["timed_steps"],
        step_times_s=result["step_times_s"],
        eval=result.get("eval"),
        config=result.get("config"),
        device=result.get("device"),
        wall_s=observed["wall_s"],
    )
    extra = ("peak_cuda_allocated_mb", "generation_tokens_per_s", "micro_batch", "gradient_accumulation_steps",
             "train_reward")  # fmt: skip
    return {**row, **{k: result[k] for k in extra if k in result}}


def run_benchmark(
    methods: Sequence[str],
    workload: Workload,
    *,
    work_dir: str | Path,
    command: str = "",
    show_progress: bool = True,
) -> list[dict]:
    """Run the baseline evaluation and then each method in its own subprocess; return one row per method."""
    from tqdm.auto import tqdm

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; known: {sorted(METHODS)}")
    workload = workload.resolved()
    context = {"machine": machine_description(), "date": utc_now(), "command": command, "acc_before": None}
    rows = []
    with tqdm(total=len(methods) + 1, desc="baseline eval", unit="run", disable=not show_progress) as bar:
        result, observed = spawn("_baseline", workload, work_dir, bar)
        if result is not None:
            context["acc_before"] = result["eval"]["accuracy"]
            context["baseline_eval"] = result["eval"]
        else:
            tqdm.write(f"baseline evaluation failed (rc {observed['rc']}); see {observed['log']}")
        bar.update()
        for name in methods:
            bar.set_description(f"{name}")
            result, observed = spawn(name, workload, work_dir, bar)
            rows.append(_row(METHODS[name], workload, result, observed, context))
            tqdm.write(_one_line(rows[-1]))
            bar.update()
    _add_relative(rows)
    return rows


def _one_line(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['method']:<16} {row['status'].upper()}: {last_line(row.get('error'))}"
    return (
        f"{row['method']:<16} {row['step_time_s_median']:8.1f} s/step  {row['peak_mem_mb'] / 1024:6.2f} GB  "
        f"{row['tokens_per_s']:7.1f} tok/s  acc {_fmt_acc(row['acc_before'])} -> {_fmt_acc(row['acc_after'])}"
    )
