"""The side-by-side benchmark's report: latest.json (one row per method), latest.md (a table) and latest.png;
and the helpers every report uses (tables, intervals, plots)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from .methods import METHODS
from .process import last_line
from .workload import Workload

ROW_KEYS = (
    "method", "status", "rollouts_per_step", "step_time_s_median", "peak_mem_mb", "tokens_per_s", "acc_before",
    "acc_after", "machine", "date", "command",
)  # fmt: skip


# ------------------------------------------------------------------------------ helpers of every report
def table(intro: str, header: str, align: str, rows: Sequence[str]) -> list[str]:
    """Markdown lines: a blank line, `intro`, a blank line and a table of `rows` (none without rows)."""
    return ["", intro, "", header, align, *rows] if rows else []


def interval(low: float, high: float) -> str:
    """A fraction's interval in points: `[-1.2, +3.4]`."""
    return f"[{100 * low:+.1f}, {100 * high:+.1f}]"


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only: the harness never opens a window)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def write_json_atomic(path: Path, data) -> None:
    """A run file is either complete or absent: write a temporary file, then rename it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


# ------------------------------------------------------------------------------------ latest.{json,md,png}
def _add_relative(rows: list[dict], reference: str = "grpo") -> None:
    """`step_time_vs_grpo` and `peak_mem_vs_grpo`: fractional change against GRPO (-0.3 = 30% less)."""
    ref = next((r for r in rows if r["method"] == reference and r["status"] == "ok"), None)
    for row in rows:
        for key, out in (("step_time_s_median", "step_time_vs_grpo"), ("peak_mem_mb", "peak_mem_vs_grpo")):
            ok = ref is not None and row.get(key) is not None and ref.get(key)
            row[out] = (row[key] / ref[key] - 1.0) if ok else None


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _fmt_acc(value: float | None) -> str:
    return _fmt(None if value is None else 100 * value, ".1f") + ("%" if value is not None else "")


def _fmt_rel(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:+.0f}%"


def render_markdown(rows: Sequence[dict], workload: Workload | None = None) -> str:
    """The benchmark table (plus the workload, machine, date and command) as Markdown."""
    lines = ["# Benchmark: DART-ES vs ES vs GRPO", ""]
    if rows:
        lines += [f"- Machine: {rows[0]['machine']}", f"- Date: {rows[0]['date']}",
                  f"- Command: `{rows[0]['command']}`"]  # fmt: skip
    if workload is not None:
        lines.append(
            f"- Workload: `{workload.model}` ({workload.dtype}) on `{workload.dataset}`; "
            f"{workload.rollouts_per_step} rollouts per step ({workload.population} per problem x "
            f"{workload.prompts} problems), up to {workload.max_completion_length} completion tokens; "
            f"{workload.steps} steps, the first {workload.warmup_steps} not timed; greedy held-out accuracy on "
            f"{workload.eval_prompts} `{workload.test_split}` prompts."
        )
    lines += [
        "",
        "| method | status | rollouts/step | time/step (s) | vs GRPO | peak memory (GB) | vs GRPO | tokens/s "
        "| acc. before | acc. after |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        mem = None if r.get("peak_mem_mb") is None else r["peak_mem_mb"] / 1024
        lines.append(
            f"| {r['method']} | {r['status']} | {r['rollouts_per_step']} | {_fmt(r.get('step_time_s_median'), '.1f')} "
            f"| {_fmt_rel(r.get('step_time_vs_grpo'))} | {_fmt(mem, '.2f')} | {_fmt_rel(r.get('peak_mem_vs_grpo'))} "
            f"| {_fmt(r.get('tokens_per_s'), '.1f')} | {_fmt_acc(r.get('acc_before'))} | {_fmt_acc(r.get('acc_after'))} |"
        )
    cpu_only = {r.get("mem_kind") for r in rows if r.get("mem_kind")} <= {"cpu_peak_rss"}
    memory = "peak RSS of the method's process tree (CPU)" if cpu_only else (
        "torch.cuda.max_memory_reserved (CUDA) / peak RSS (CPU)"
    )  # fmt: skip
    lines += [
        "",
        f"time/step: median wall time of one training step after warm-up. peak memory: {memory}. tokens/s: "
        "completion tokens generated per second of training (`inference`: of generation). Accuracy: greedy, same "
        "prompts and evaluation code for every method. vs GRPO: change relative to the `grpo` row (negative = "
        "less).",
    ]
    lines += _throughput_lines(rows)
    ok = [r for r in rows if r["status"] == "ok" and r.get("peak_mem_mb_max_process") is not None]
    lines += table(
        "Peak memory per process (the largest single process: what one device holds) against the whole tree:",
        "| method | processes | whole tree (GB) | largest process (GB) |", "| --- | ---: | ---: | ---: |",
        [f"| {r['method']} | {r.get('processes', 1)} | {r['peak_mem_mb'] / 1024:.2f} "
         f"| {r['peak_mem_mb_max_process'] / 1024:.2f} |" for r in ok],
    )  # fmt: skip
    for r in rows:
        if r["status"] != "ok":
            lines += ["", f"`{r['method']}` {r['status']}: `{last_line(r.get('error'), 'no output')}`"]
    return "\n".join(lines) + "\n"


def _throughput_lines(rows: Sequence[dict]) -> list[str]:
    """How close each ES row's rollout throughput comes to pure batched inference of the same rollouts."""
    ok = {r["method"]: r for r in rows if r["status"] == "ok" and r.get("tokens_per_s")}
    lines: list[str] = []

    # vLLM rows are compared with vLLM's own batched inference (bf16 rows with bf16's), the others with
    # transformers'.
    def engine(name: str) -> str:
        return ("vllm-bf16" if name.endswith("-bf16") else "vllm") if "vllm" in name else "transformers"

    for reference in ("inference", "inference-vllm", "inference-vllm-bf16"):
        if reference not in ok:
            continue
        ceiling = ok[reference]["tokens_per_s"]
        items = [
            f"- `{name}`: whole ES step {r['tokens_per_s'] / ceiling:.0%}, generation phase only "
            f"{r['generation_tokens_per_s'] / ceiling:.0%}."
            for name, r in ok.items()
            if not name.startswith("inference")
            and r.get("generation_tokens_per_s") is not None
            and engine(name) == engine(reference)
        ]
        if items:  # an inference row alone has nothing to compare with it
            lines += ["", f"Rollout throughput against pure batched inference ({ceiling:.1f} tokens/s, the "
                      f"`{reference}` row):", "", *items]  # fmt: skip
    return lines


def plot_results(rows: Sequence[dict], path: str | Path) -> None:
    """Bars of time per step and peak memory, and accuracy before/after, one group per method."""
    plt = pyplot()
    names = [r["method"] for r in rows]
    x = list(range(len(rows)))

    def values(key: str, scale: float = 1.0) -> list[float]:
        return [(r[key] * scale) if r.get(key) is not None and r["status"] == "ok" else 0.0 for r in rows]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    palette = {"dart-es": "#4c72b0", "es": "#55a868", "grpo": "#c44e52", "grpo-lora": "#dd8452"}
    colors = [palette.get(n, "#4c72b0" if n.startswith("dart-es") else "#8172b3") for n in names]
    for ax, key, scale, title in (
        (axes[0], "step_time_s_median", 1.0, "time per step (s, median)"),
        (axes[1], "peak_mem_mb", 1 / 1024, "peak memory (GB)"),
    ):
        heights = values(key, scale)
        ax.bar(x, heights, color=colors)
        for i, (h, r) in enumerate(zip(heights, rows, strict=True)):
            text = f"{h:.1f}" if r["status"] == "ok" else r["status"]
            ax.text(i, h, text, ha="center", va="bottom", fontsize=8)
        ax.set_title(title)
    width = 0.38
    before, after = values("acc_before", 100), values("acc_after", 100)
    axes[2].bar([i - width / 2 for i in x], before, width, label="before", color="#bbbbbb")
    axes[2].bar([i + width / 2 for i in x], after, width, label="after", color=colors)
    for i, (h, r) in enumerate(zip(after, rows, strict=True)):
        label = f"{h:.0f}" if r.get("acc_after") is not None else "–"
        axes[2].text(i + width / 2, h, label, ha="center", va="bottom", fontsize=8)
    axes[2].set_ylim(0, max(10.0, *before, *after) * 1.2)
    axes[2].set_title("held-out accuracy (%), greedy")
    axes[2].legend(loc="upper left", fontsize=8)
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=9)
    if rows:
        fig.suptitle(f"{rows[0]['rollouts_per_step']} rollouts per step; {rows[0]['machine']}", fontsize=9)
    save_figure(fig, path)


def write_reports(
    rows: list[dict], output_dir: str | Path, workload: Workload | None = None
) -> dict[str, Path]:
    """Write latest.json, latest.md and latest.png into `output_dir`; return their paths."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "latest.json", "md": out / "latest.md", "png": out / "latest.png"}
    paths["json"].write_text(json.dumps(rows, indent=2, default=str) + "\n")
    paths["md"].write_text(render_markdown(rows, workload))
    plot_results(rows, paths["png"])
    return paths


def merge_rows(new: list[dict], old: list[dict], workload: Workload) -> list[dict]:
    """Rows of `old` for methods not in `new`, kept only when they were measured on the same workload."""
    ran = {r["method"] for r in new}
    kept = [r for r in old if r["method"] not in ran and r.get("workload") == workload.comparable()]
    order = {name: i for i, name in enumerate(METHODS)}
    merged = sorted(kept + new, key=lambda r: order.get(r["method"], len(order)))
    _add_relative(merged)
    return merged
