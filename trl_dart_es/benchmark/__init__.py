"""The benchmark harness: one method registry, one workload and one evaluation for time, memory and accuracy.

    python -m trl_dart_es.benchmark                  # side by side: time/step, peak memory, tokens/s, accuracy
    python -m trl_dart_es.benchmark --full           # more steps and evaluation prompts
    python -m trl_dart_es.benchmark --curves         # held-out accuracy against training time, 3 seeds
    python -m trl_dart_es.benchmark --curves --preset demo --seeds 0   # the learning study's presets

More examples in `cli`; each module's docstring says what it holds. Only the standard library is imported at
module level: the parent process stays small, and every heavy import happens in the child that runs a method.
"""

from .cli import _parser, main, workload_from_args
from .clock import StepClock
from .curves import (
    CURVES,
    CurveClock,
    curve_capable,
    curve_run_path,
    curve_settings,
    finished_run,
    load_curve_runs,
    parse_overrides,
    plot_curves,
    render_curves_markdown,
    run_curve,
    summarize_curves,
    write_curve_report,
)
from .evaluation import evaluate_greedy, evaluate_trainer, evaluate_workload
from .machine import cpu_model, machine_description
from .methods import CURVE_METHODS, DEFAULT_METHODS, METHODS, BenchMethod, _installed
from .process import launch_command, peak_memory, spawn, tail
from .report import ROW_KEYS, _add_relative, merge_rows, plot_results, render_markdown, write_reports
from .run import RUNNERS, _row, run_benchmark, summarize_run
from .stats import bootstrap_interval, paired_t_interval, t_quantile
from .trainers import _micro_batch, parse_recipe_config
from .workload import (
    DEFAULT_CONFIG_DIR,
    DEFAULT_OUTPUT_DIR,
    FULL,
    LAUNCH_CONFIG_DIR,
    REPO_ROOT,
    SHORT,
    Workload,
    held_out_set,
    load_split,
    task_reward_funcs,
)

__all__ = [
    "BenchMethod", "CURVES", "CURVE_METHODS", "CurveClock", "DEFAULT_CONFIG_DIR", "DEFAULT_METHODS",
    "DEFAULT_OUTPUT_DIR", "FULL", "LAUNCH_CONFIG_DIR", "METHODS", "REPO_ROOT", "ROW_KEYS", "RUNNERS", "SHORT",
    "StepClock", "Workload", "bootstrap_interval", "cpu_model", "curve_capable", "curve_run_path",
    "curve_settings", "evaluate_greedy", "evaluate_trainer", "evaluate_workload", "finished_run",
    "held_out_set", "launch_command", "load_curve_runs", "load_split", "machine_description", "main",
    "merge_rows", "paired_t_interval", "parse_overrides", "parse_recipe_config", "peak_memory", "plot_curves",
    "plot_results", "render_curves_markdown", "render_markdown", "run_benchmark", "run_curve", "spawn",
    "summarize_curves", "summarize_run", "t_quantile", "tail", "task_reward_funcs", "workload_from_args",
    "write_curve_report", "write_reports"
]  # fmt: skip
# Private names kept importable for the tests and older callers.
_PRIVATE = (_add_relative, _installed, _micro_batch, _parser, _row)
