"""The command line of the harness, `python -m trl_dart_es.benchmark`:

python -m trl_dart_es.benchmark                          # side by side: time/step, memory, tokens/s, accuracy
python -m trl_dart_es.benchmark --full                   # more steps and evaluation prompts
python -m trl_dart_es.benchmark --methods grpo,es --steps 4 --output-dir outputs/bench
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from .methods import DEFAULT_METHODS, METHODS
from .report import merge_rows, render_markdown, write_reports
from .run import _child_main, run_benchmark
from .workload import DEFAULT_OUTPUT_DIR, FULL, SHORT, Workload


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trl_dart_es.benchmark",
        description="DART-ES vs ES vs GRPO vs GRPO+LoRA: time per step, peak memory, tokens/s, held-out accuracy.",
    )
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, from {', '.join(METHODS)} (or 'all'); default: %(default)s")  # fmt: skip
    p.add_argument(
        "--full", action="store_true", help="the longer workload: more steps, problems and eval prompts"
    )
    p.add_argument("--steps", type=int, help="training steps per method")
    p.add_argument("--warmup-steps", type=int, help="first steps left out of the timing")
    p.add_argument("--model", help="model for every method (hub id, local folder or embedded:<name>)")
    p.add_argument(
        "--dataset", help="task name for trl_dart_es.tasks.load_task_dataset, or a saved DatasetDict folder"
    )
    p.add_argument("--population", type=int, help="N: ES population = GRPO num_generations")
    p.add_argument("--prompts", type=int, help="B: problems per step (ES) = prompts per step (GRPO)")
    p.add_argument("--max-completion-length", type=int)
    p.add_argument("--eval-prompts", type=int, help="held-out prompts for the accuracy before/after")
    p.add_argument("--eval-batch-size", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--config-dir", help="folder of the recipe configs (default: recipes/configs of this checkout)"
    )
    p.add_argument(
        "--timeout", type=float, help="seconds per method before it is stopped and reported as timeout"
    )
    p.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR), help="where latest.{json,md,png} go")
    p.add_argument(
        "--work-dir", default=None, help="logs and intermediate files (default: a temporary folder)"
    )
    p.add_argument("--merge", action="store_true",
                   help="keep rows of methods not run now from an existing latest.json measured on the same workload")  # fmt: skip
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def workload_from_args(args: argparse.Namespace) -> Workload:
    workload = FULL if args.full else SHORT
    options = {
        "steps": args.steps, "warmup_steps": args.warmup_steps, "model": args.model, "dataset": args.dataset,
        "population": args.population, "prompts": args.prompts, "max_completion_length": args.max_completion_length,
        "eval_prompts": args.eval_prompts, "eval_batch_size": args.eval_batch_size, "seed": args.seed,
        "dtype": args.dtype, "device": args.device, "config_dir": args.config_dir, "timeout_s": args.timeout,
    }  # fmt: skip
    workload = replace(workload, **{k: v for k, v in options.items() if v is not None}).resolved()
    if workload.steps < 1 or workload.warmup_steps < 0:
        raise SystemExit("--steps must be >= 1 and --warmup-steps >= 0")
    if workload.steps <= workload.warmup_steps:
        print(
            f"note: {workload.steps} steps with {workload.warmup_steps} warm-up: every step is timed",
            file=sys.stderr,
        )
    return workload


def main(argv: Sequence[str] | None = None) -> list[dict] | None:
    args = _parser().parse_args(argv)
    if args.child:
        raise SystemExit(_child_main(args.child))
    methods = (
        list(METHODS) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    )
    workload = workload_from_args(args)
    command = "python -m trl_dart_es.benchmark" + "".join(
        f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv)
    )
    with contextlib.ExitStack() as stack:
        work_dir = args.work_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="trl-dart-es-bench-")
        )
        rows = run_benchmark(
            methods, workload, work_dir=work_dir, command=command, show_progress=not args.no_progress
        )
    latest = Path(args.output_dir) / "latest.json"
    if args.merge and latest.is_file():
        rows = merge_rows(rows, json.loads(latest.read_text()), workload)
    paths = write_reports(rows, args.output_dir, workload)
    print(render_markdown(rows, workload))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return rows
