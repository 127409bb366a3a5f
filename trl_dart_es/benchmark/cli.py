"""The command line of the harness, `python -m trl_dart_es.benchmark`:

python -m trl_dart_es.benchmark                          # side by side: time/step, memory, tokens/s, accuracy
python -m trl_dart_es.benchmark --full                   # more steps and evaluation prompts
python -m trl_dart_es.benchmark --methods grpo,es --steps 4 --output-dir outputs/bench
python -m trl_dart_es.benchmark --curves                 # accuracy vs training time, 3 seeds x 4 methods
python -m trl_dart_es.benchmark --curves --methods dart-es --seeds 0 --budget-minutes 5
python -m trl_dart_es.benchmark --curves --report-only   # rebuild curves.{json,md,png} from the run files
python -m trl_dart_es.benchmark --curves --preset demo demo-es --seeds 0 1 2   # the learning study's presets
python -m trl_dart_es.benchmark --curves --preset        # rebuild results/study.{json,md,png}
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

from .child import child_main
from .curves import (
    CURVES,
    DEFAULT_BUDGET_MINUTES,
    DEFAULT_EVAL_AT_MINUTES,
    DEFAULT_IMAGE,
    DEFAULT_RUNS_DIR,
    DEFAULT_SEEDS,
    curve_capable,
    curves_main,
)
from .methods import CURVE_METHODS, DEFAULT_METHODS, METHODS
from .report import merge_rows, render_markdown, write_reports
from .run import run_benchmark
from .study import DEFAULT_EVAL_EVERY, DEFAULT_EVAL_PROMPTS, study_main
from .study import DEFAULT_RUNS_DIR as STUDY_RUNS_DIR
from .workload import DEFAULT_OUTPUT_DIR, FULL, SHORT, Workload


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trl_dart_es.benchmark",
        description="DART-ES vs ES vs GRPO vs GRPO+LoRA: time per step, peak memory, tokens/s, held-out accuracy; "
        "with --curves, held-out accuracy against training time.",
    )
    p.add_argument("--methods",
                   help=f"comma-separated, from {', '.join(METHODS)} (or 'all'); default: {','.join(DEFAULT_METHODS)} "
                        f"(with --curves: {','.join(CURVE_METHODS)})")  # fmt: skip
    p.add_argument("--full", action="store_true",
                   help="the longer workload: more steps, problems and eval prompts")  # fmt: skip
    p.add_argument("--steps", type=int,
                   help="training steps per method (not with --curves: the budget decides)")  # fmt: skip
    p.add_argument("--warmup-steps", type=int, help="first steps left out of the timing")
    p.add_argument("--model", help="model for every method (hub id, local folder or embedded:<name>)")
    p.add_argument("--dataset",
                   help="task name for trl_dart_es.tasks.load_task_dataset, or a saved DatasetDict folder")  # fmt: skip
    p.add_argument("--population", type=int,
                   help="N: ES population = GRPO num_generations (default 8; with --curves: the DART-ES config's)")  # fmt: skip
    p.add_argument("--prompts", type=int,
                   help="B: problems per step (ES) = prompts per step (GRPO) (default 8; with --curves: the DART-ES "
                        "config's)")  # fmt: skip
    p.add_argument("--max-completion-length", type=int,
                   help="completion tokens for every method (default: the DART-ES config's)")  # fmt: skip
    p.add_argument("--eval-prompts", type=int,
                   help="held-out prompts for the accuracy (default 32, --full 128, --curves 512)")  # fmt: skip
    p.add_argument("--eval-batch-size", type=int,
                   help="prompts per greedy generation call in evaluation (default 32, --curves 64)")  # fmt: skip
    p.add_argument("--seed", type=int, help="training seed of the side-by-side rows (--curves: --seeds)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="model weights' dtype")
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], help="where to train (auto: CUDA if available)"
    )
    p.add_argument(
        "--config-dir", help="folder of the recipe configs (default: recipes/configs of this checkout)"
    )
    p.add_argument("--timeout", type=float,
                   help="seconds per method (--curves: per run, default 3 x budget + 1 h) before it is stopped and "
                        "reported as timeout")  # fmt: skip
    p.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR),
                   help="where latest.{json,md,png} (--curves: curves.{json,md}) go; default: %(default)s")  # fmt: skip
    p.add_argument("--work-dir", help="logs and intermediate files (default: a temporary folder)")
    p.add_argument("--merge", action="store_true",
                   help="keep rows of methods not run now from an existing latest.json measured on the same workload")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    curves = p.add_argument_group("accuracy against training time (--curves)")
    curves.add_argument("--curves", action="store_true",
                        help="train each method x seed for a budget of training seconds, evaluating at marks")  # fmt: skip
    curves.add_argument("--seeds", type=int, nargs="+",
                        help=f"training seeds, one run per method and seed; default: {list(DEFAULT_SEEDS)} "
                             "(--preset: [0])")  # fmt: skip
    curves.add_argument("--budget-minutes", type=float, default=DEFAULT_BUDGET_MINUTES,
                        help="training time per run, evaluation excluded; default: %(default)s")  # fmt: skip
    curves.add_argument("--eval-at-minutes", type=float, nargs="+", default=list(DEFAULT_EVAL_AT_MINUTES),
                        help="evaluate at the first step end after each of these training times (and at step 0 and "
                             "the budget's end); default: %(default)s")  # fmt: skip
    curves.add_argument("--set", action="append", metavar="[METHOD:]KEY=VALUE",
                        help="override a recipe-config field (a YAML scalar) for every method, or for METHOD only; "
                             "repeatable. population, prompts, max_completion_length, prompt_style and task_version "
                             "change the workload instead")  # fmt: skip
    curves.add_argument(
        "--tag", help="names these runs: <method>-seed<k>-<tag>.json and curves-<tag>.{json,md,png}"
    )
    curves.add_argument("--runs-dir",
                        help=f"one JSON per finished (method, seed) run; default: {DEFAULT_RUNS_DIR} (--preset: "
                             f"{STUDY_RUNS_DIR})")  # fmt: skip
    curves.add_argument("--image", help=f"the plot (default: {DEFAULT_IMAGE}, or curves-<tag>.png)")
    curves.add_argument("--report-only", action="store_true",
                        help="train nothing: rebuild the report from the finished runs")  # fmt: skip
    curves.add_argument("--force", action="store_true", help="rerun finished runs too")
    curves.add_argument("--preset", nargs="*", metavar="PRESET",
                        help="the learning study instead of methods: train these presets (benchmarks/"
                             "study_presets.yaml, overrides of quickstart_fullrank.yaml) for their steps in-process, "
                             "evaluated by the trainer every --eval-every steps on --eval-prompts (default "
                             f"{DEFAULT_EVAL_PROMPTS}); then write study.{{json,md,png}}. No names: the report only")  # fmt: skip
    curves.add_argument("--eval-every", type=int, default=DEFAULT_EVAL_EVERY,
                        help="--preset: steps between evaluations (a preset's own eval_every wins); "
                             "default: %(default)s")  # fmt: skip
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The workload the options describe: SHORT or FULL (--curves: CURVES) with the options given applied."""
    if getattr(args, "curves", False):
        _refuse(args, "--curves", ("full", "steps", "warmup_steps", "seed", "merge"),
                "the budget (--budget-minutes) bounds training and --seeds names the seeds")  # fmt: skip
        workload = CURVES
    else:
        workload = FULL if args.full else SHORT
    options = {
        "steps": args.steps, "warmup_steps": args.warmup_steps, "model": args.model, "dataset": args.dataset,
        "population": args.population, "prompts": args.prompts, "max_completion_length": args.max_completion_length,
        "eval_prompts": args.eval_prompts, "eval_batch_size": args.eval_batch_size, "seed": args.seed,
        "dtype": args.dtype, "device": args.device, "config_dir": args.config_dir, "timeout_s": args.timeout,
    }  # fmt: skip
    workload = replace(workload, **{k: v for k, v in options.items() if v is not None}).resolved()
    if getattr(args, "curves", False):
        return workload
    if workload.steps < 1 or workload.warmup_steps < 0:
        raise SystemExit("--steps must be >= 1 and --warmup-steps >= 0")
    if workload.steps <= workload.warmup_steps:
        print(
            f"note: {workload.steps} steps with {workload.warmup_steps} warm-up: every step is timed",
            file=sys.stderr,
        )
    return workload


def main(argv: Sequence[str] | None = None) -> list[dict] | None:
    """Run the side-by-side benchmark (or, with --curves, the curves) as the options say; return its rows/runs."""
    args = _parser().parse_args(argv)
    if args.child:
        raise SystemExit(child_main(args.child))
    if args.preset is not None:
        return _study(args)
    args.seeds = list(DEFAULT_SEEDS) if args.seeds is None else args.seeds
    args.runs_dir = args.runs_dir or str(DEFAULT_RUNS_DIR)
    default = CURVE_METHODS if args.curves else DEFAULT_METHODS
    if args.methods is None:
        methods = list(default)
    elif args.methods == "all":  # with --curves: every method that can run as a curve
        methods = [m for m in METHODS if not args.curves or curve_capable(m)]
    else:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    workload = workload_from_args(args)
    command = "python -m trl_dart_es.benchmark" + "".join(
        f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv)
    )
    if args.curves:
        return curves_main(args, methods, workload, command)
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


def _study(args: argparse.Namespace) -> None:
    """`--curves --preset`: the learning study (`study.study_main`), with the study's own defaults."""
    if not args.curves:
        raise SystemExit("--preset runs the learning study's presets as curves: add --curves")
    unused = ["methods", "set", "tag", "image", "model", "dataset", "population", "prompts", "max_completion_length",
              "eval_batch_size", "dtype", "device", "config_dir", "timeout", "work_dir", "full", "steps",
              "warmup_steps", "seed", "merge"]  # fmt: skip
    _refuse(args, "--preset", unused, "a preset sets them")
    args.seeds = [0] if args.seeds is None else args.seeds
    args.runs_dir = args.runs_dir or str(STUDY_RUNS_DIR)
    args.eval_prompts = args.eval_prompts or DEFAULT_EVAL_PROMPTS
    study_main(args, args.preset)


def _refuse(args: argparse.Namespace, mode: str, fields: Sequence[str], why: str) -> None:
    """Stop if any of `fields` was given: `mode` does not use them."""
    given = [f for f in fields if getattr(args, f) not in (None, False)]
    if given:
        raise SystemExit(f"{mode} does not use {', '.join('--' + f.replace('_', '-') for f in given)}: {why}")
