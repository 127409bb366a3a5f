"""Running methods: each in its own child process (so that its peak memory is its own), timed and sampled by the
parent; the side-by-side benchmark (`run_benchmark`) is one row per method.

The parent writes a spec file and starts `python -m trl_dart_es.benchmark --child <spec>` (under `accelerate
launch` for a multi-process row); the child trains, writes its result file and exits. A spec with
`"mode": "curve"` runs one accuracy-vs-time curve instead (`trl_dart_es.benchmark.curves`).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .evaluation import evaluate_trainer, evaluate_workload
from .machine import _gpu_name, machine_description, utc_now
from .methods import METHODS, BenchMethod, _missing_requirements
from .report import ROW_KEYS, _add_relative, _fmt_acc
from .trainers import _per_step, _use_cuda, _world_size, es_trainer, grpo_trainer
from .workload import LAUNCH_CONFIG_DIR, REPO_ROOT, Workload

__all__ = ["ROW_KEYS", "RUNNERS", "run_benchmark", "summarize_run", "peak_memory"]


class _StepTimer:
    """Timestamps the end of every optimizer step, and tells the parent how far training is."""

    def __init__(self, progress: Callable[[str], None]):
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                timer.ends = [time.perf_counter()]
                progress(f"train 0/{state.max_steps}")

            def on_step_end(self, args, state, control, **kwargs):
                timer.ends.append(time.perf_counter())
                progress(f"train {state.global_step}/{state.max_steps}")

        self.ends: list[float] = []
        self.callback = Callback()

    @property
    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]


def _run_es(method: BenchMethod, workload: Workload, progress: Callable[[str], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"bench-{method.name}-") as out:
        progress("loading")
        timer = _StepTimer(progress)
        trainer, config = es_trainer(method, workload, out, [timer.callback])
        trainer.train()
        history = trainer.state.log_history
        return {
            "config": config,
            "trainer": trainer,
            "reward_weights": trainer.args.reward_weights,
            "step_times_s": timer.step_times,
            "completion_tokens": [
                m * workload.rollouts_per_step for m in _per_step(history, "completions/mean_length")
            ],
            "generation_tokens_per_s": _median_or_nan(
                _per_step(history, "tokens_per_s")[workload.warmup_steps :]
            ),
            "train_reward": _per_step(history, "reward"),
        }


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


def _run_grpo(method: BenchMethod, workload: Workload, progress: Callable[[str], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"bench-{method.name}-") as out:
        progress("loading")
        timer = _StepTimer(progress)
        trainer, config, batches = grpo_trainer(method, workload, out, [timer.callback])
        trainer.train()
        history = trainer.state.log_history
        return {
            "config": config,
            "trainer": trainer,
            "reward_weights": trainer.args.reward_weights,
            **batches,
            "step_times_s": timer.step_times,
            "completion_tokens": [
                m * workload.rollouts_per_step for m in _per_step(history, "completions/mean_length")
            ],
            "train_reward": _per_step(history, "reward"),
        }


# Runners train one method in the child process and return at least `step_times_s`, `completion_tokens` (per
# step) and the `trainer` (its model is evaluated afterwards; None: nothing was trained, no accuracy).
RUNNERS: dict[str, Callable[[BenchMethod, Workload, Callable[[str], None]], dict[str, Any]]] = {
    "es": _run_es,
    "grpo": _run_grpo,
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


def _peak_memory_mb() -> dict[str, float]:
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 / 2**20 if sys.platform == "darwin" else 1 / 1024
    out = {
        "peak_rss_self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale,
        "peak_rss_children_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale,
    }
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["peak_cuda_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
            out["peak_cuda_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    return out


def _gather_ranks(value: dict) -> list[dict]:
    """`value` from every process of a launched child (a list of one when the child runs alone)."""
    if _world_size() == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _child_main(spec_path: str) -> int:
    """Entry point of the subprocess that runs one method (or the baseline evaluation) and writes its result.

    Under `accelerate launch` (a `launch` row) every process runs this; only rank 0 reports progress and writes
    the result, which carries every process's peak memory (`ranks`).
    """
    spec = json.loads(Path(spec_path).read_text())
    workload = Workload(**spec["workload"])
    progress_path = Path(spec["progress_path"])
    rank = int(os.environ.get("RANK", "0"))

    def progress(text: str) -> None:
        if rank != 0:
            return
        with contextlib.suppress(OSError):
            progress_path.write_text(text)

    started = time.perf_counter()
    if spec.get("mode") == "curve":
        from .curves import curve_child

        result = curve_child(spec, workload, progress)
    elif spec["method"] == "_baseline":
        result = _baseline(workload, progress)
    else:
        method = METHODS[spec["method"]]
        result = RUNNERS[method.kind](method, workload, progress)
        trainer = result.pop("trainer")
        if trainer is not None:
            progress("evaluating")
            result["eval"] = evaluate_trainer(trainer, workload)
    result.pop("reward_weights", None)
    result.update(_peak_memory_mb())
    if _world_size() > 1:
        result["ranks"] = _gather_ranks(_peak_memory_mb())
        result["processes"] = len(result["ranks"])
        if rank != 0:
            return 0
    with contextlib.suppress(Exception):
        import torch

        result["device"] = (
            f"cuda ({torch.cuda.get_device_name(0)})"
            if _use_cuda(workload)
            else f"cpu ({torch.get_num_threads()} threads)"
        )
    result["wall_s"] = time.perf_counter() - started
    Path(spec["result_path"]).write_text(json.dumps(result, default=str))
    return 0


# ---------------------------------------------------------------------------------------------- summaries
def _median_or_nan(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def summarize_run(step_times: Sequence[float], completion_tokens: Sequence[float], warmup_steps: int) -> dict:
    """Median step time and rollout throughput over the steps after warm-up.

    With no step left after warm-up, every step counts (and `timed_steps` says how many did).
    """
    times = list(step_times)
    timed = times[warmup_steps:] if len(times) > warmup_steps else times
    first = len(times) - len(timed)
    tokens = list(completion_tokens)[first : first + len(timed)]
    rate = (
        sum(tokens) / sum(timed[: len(tokens)]) if tokens and sum(timed[: len(tokens)]) > 0 else float("nan")
    )
    return {"step_time_s_median": _median_or_nan(timed), "tokens_per_s": rate, "timed_steps": len(timed)}


def _tree_rss(pid: int) -> tuple[int, int]:
    """RSS in bytes of a process and all its descendants, and of the largest single one of them ((0, 0) if
    it is gone)."""
    try:
        import psutil
    except ImportError:  # the child's own ru_maxrss still gives a peak
        return 0, 0
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    sizes = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            sizes.append(p.memory_info().rss)
    return sum(sizes), max(sizes, default=0)


def _tail(path: Path, lines: int = 25) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


# ------------------------------------------------------------------------------------------ parent: runs
def _spawn(
    name: str,
    workload: Workload,
    work_dir: Path,
    bar=None,
    *,
    extra: dict[str, Any] | None = None,
    stem: str | None = None,
) -> tuple[dict | None, dict]:
    """Run one child to completion; return its result (None on failure) and what the parent observed.

    `extra` is added to the child's spec (e.g. a curve's mode, seed and budget); `stem` names its files in
    `work_dir` (default: `name`).
    """
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or name
    spec_path, result_path = work_dir / f"{stem}.spec.json", work_dir / f"{stem}.result.json"
    progress_path, log_path = work_dir / f"{stem}.progress", work_dir / f"{stem}.log"
    for path in (result_path, progress_path):
        path.unlink(missing_ok=True)
    spec = {"method": name, "workload": asdict(workload), "result_path": str(result_path),
            "progress_path": str(progress_path), **(extra or {})}  # fmt: skip
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "trl_dart_es.benchmark", "--child", str(spec_path)]
    method = METHODS.get(name)
    if method is not None and method.launch is not None:
        cmd, launch_env = _launch_command(method, workload, cmd[1:])
        env.update(launch_env)
    started = time.monotonic()
    peak, peak_one, timed_out, shown = 0, 0, False, ""
    with open(log_path, "w") as log:
        # Its own session, so that a timeout can stop the child and its workers (and nothing else).
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while proc.poll() is None:
                total, largest = _tree_rss(proc.pid)
                peak, peak_one = max(peak, total), max(peak_one, largest)
                if bar is not None:
                    with contextlib.suppress(OSError):
                        text = progress_path.read_text().strip()
                        if text != shown:  # redraw only on change: logs of the bar stay short
                            bar.set_postfix_str(text, refresh=True)
                            shown = text
                if time.monotonic() - started > workload.timeout_s:
                    timed_out = True
                    _stop(proc)
                    break
                time.sleep(0.5)
        except BaseException:
            _stop(proc)
            raise
    observed = {"rc": proc.returncode, "wall_s": time.monotonic() - started, "peak_tree_rss_mb": peak / 2**20,
                "peak_process_rss_mb": peak_one / 2**20, "log": str(log_path), "timed_out": timed_out}  # fmt: skip
    if proc.returncode == 0 and result_path.is_file():
        return json.loads(result_path.read_text()), observed
    return None, observed


def _launch_command(method: BenchMethod, workload: Workload, child: list[str]) -> tuple[list[str], dict]:
    """`accelerate launch` of the child module with the method's Accelerate config (its CPU or its CUDA one)
    on `method.processes` processes, and the environment it needs (threads split over the processes, a
    persistent cache for DeepSpeed's compiled CPU op)."""
    import socket

    cpu_config, cuda_config = method.launch
    on_cuda = workload.device == "cuda" or (workload.device == "auto" and _gpu_name() is not None)
    with socket.socket() as s:  # a free port: other jobs on the machine may launch at the same time
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(LAUNCH_CONFIG_DIR / (cuda_config if on_cuda else cpu_config)),
        "--num_processes", str(method.processes), "--main_process_port", str(port), *child,
    ]  # fmt: skip
    env = {
        "TORCH_EXTENSIONS_DIR": os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".cache" / "torch_extensions")
        )
    }
    if not on_cuda:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // method.processes))
    return cmd, env


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)  # the group the child leads (start_new_session): only what we started
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)


def peak_memory(result: dict, observed: dict) -> dict[str, Any]:
    """A child's peak memory from what it reported (`result`) and what the parent sampled (`observed`).

    `peak_mem_mb`: on CPU the peak RSS of the whole process tree (the parent's samples, or the kernel's
    `ru_maxrss`, whichever is larger); on CUDA the sum over processes of `max_memory_reserved`.
    `peak_mem_mb_max_process`: the largest single process, what one device must hold.
    """
    cuda = result.get("peak_cuda_reserved_mb")
    cpu_peak = max(observed.get("peak_tree_rss_mb", 0.0), result.get("peak_rss_self_mb", 0.0),
                   result.get("peak_rss_children_mb", 0.0))  # fmt: skip
    # The largest single process (what one device must hold): the kernel's peak of each training process, or
    # the parent's samples of the largest process in the tree, whichever is larger.
    ranks = result.get("ranks") or [result]
    one_peak = max(
        [observed.get("peak_process_rss_mb", 0.0)] + [r.get("peak_rss_self_mb", 0.0) for r in ranks]
    )
    if cuda is not None:
        cuda_ranks = [r.get("peak_cuda_reserved_mb") or 0.0 for r in ranks]
        cuda, one_peak = sum(cuda_ranks), max(cuda_ranks)
    return {
        "peak_mem_mb": cuda if cuda is not None else cpu_peak,
        "peak_mem_mb_max_process": one_peak,
        "processes": result.get("processes", 1),
        "mem_kind": "cuda_max_memory_reserved" if cuda is not None else "cpu_peak_rss",
        "peak_rss_mb": cpu_peak,
    }


def _row(method: BenchMethod, workload: Workload, result: dict | None, observed: dict, context: dict) -> dict:
    row: dict[str, Any] = {
        "method": method.name,
        "description": method.description,
        "status": "ok",
        "rollouts_per_step": workload.rollouts_per_step,
        "step_time_s_median": None,
        "peak_mem_mb": None,
        "peak_mem_mb_max_process": None,
        "tokens_per_s": None,
        "acc_before": context["acc_before"],
        "acc_after": None,
        **{k: context[k] for k in ("machine", "date", "command")},
        "workload": workload.comparable(),
    }
    if result is None:
        row["status"] = "timeout" if observed.get("timed_out") else "failed"
        row["error"] = observed.get("error") or (_tail(Path(observed["log"])) if observed.get("log") else "")
        row["wall_s"] = observed.get("wall_s")
        return row
    summary = summarize_run(result["step_times_s"], result["completion_tokens"], workload.warmup_steps)
    memory = peak_memory(result, observed)
    row.update(
        step_time_s_median=summary["step_time_s_median"],
        **memory,
        tokens_per_s=summary["tokens_per_s"],
        acc_after=result["eval"]["accuracy"] if "eval" in result else None,
        timed_steps=summary["timed_steps"],
        step_times_s=result["step_times_s"],
        eval=result.get("eval"),
        config=result.get("config"),
        device=result.get("device"),
        wall_s=observed["wall_s"],
    )
    for key in ("peak_cuda_allocated_mb", "generation_tokens_per_s", "micro_batch", "gradient_accumulation_steps",
                "train_reward"):  # fmt: skip
        if key in result:
            row[key] = result[key]
    return row


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
    work_dir = Path(work_dir)
    workload = workload.resolved()
    context = {
        "machine": machine_description(),
        "date": utc_now(),
        "command": command,
        "acc_before": None,
    }
    rows = []
    with tqdm(total=len(methods) + 1, desc="baseline eval", unit="run", disable=not show_progress) as bar:
        result, observed = _spawn("_baseline", workload, work_dir, bar)
        if result is not None:
            context["acc_before"] = result["eval"]["accuracy"]
            context["baseline_eval"] = result["eval"]
        else:
            tqdm.write(f"baseline evaluation failed (rc {observed['rc']}); see {observed['log']}")
        bar.update()
        for name in methods:
            method = METHODS[name]
            bar.set_description(f"{name}")
            missing = _missing_requirements(method)
            if missing:
                result, observed = None, {"error": f"missing modules: {', '.join(missing)}", "wall_s": 0.0}
            else:
                result, observed = _spawn(name, workload, work_dir, bar)
            row = _row(method, workload, result, observed, context)
            rows.append(row)
            tqdm.write(_one_line(row))
            bar.update()
    _add_relative(rows)
    return rows


def _one_line(row: dict) -> str:
    if row["status"] != "ok":
        tail = (row.get("error") or "").strip().splitlines()
        return f"{row['method']:<16} {row['status'].upper()}: {tail[-1] if tail else ''}"
    return (
        f"{row['method']:<16} {row['step_time_s_median']:8.1f} s/step  {row['peak_mem_mb'] / 1024:6.2f} GB  "
        f"{row['tokens_per_s']:7.1f} tok/s  acc {_fmt_acc(row['acc_before'])} -> {_fmt_acc(row['acc_after'])}"
    )
