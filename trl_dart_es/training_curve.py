"""A picture of how a run moved: training reward and fitness per ES step, and held-out accuracy before and after.

    from trl_dart_es.training_curve import plot_training_curve
    plot_training_curve(trainer.state.log_history, "out/training_curve.png", before=0.26, after=0.30)

`make demo` writes one to its output folder. The values are read from `Trainer.state.log_history`, the same
entries every `report_to` tracker receives.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence


def training_series(log_history: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of one logged metric (training logs only; missing or None values skipped)."""
    steps, values = [], []
    for entry in log_history:
        value = entry.get(key)
        if value is None or "step" not in entry or isinstance(value, str):
            continue
        if math.isfinite(float(value)):
            steps.append(int(entry["step"]))
            values.append(float(value))
    return steps, values


def plot_training_curve(
    log_history: Sequence[dict],
    path: str,
    before: float | None = None,
    after: float | None = None,
    title: str = "DART-ES training",
) -> str:
    """Write a PNG with two panels and return its path.

    Left: the population's mean training reward (`reward`, shaded ± `reward_std` across members) and mean fitness
    (`fitness/mean`) per logged step. Right: held-out accuracy `before` and `after` training (fractions), when
    given.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps, reward = training_series(log_history, "reward")
    if not steps:
        raise ValueError("log_history has no training `reward` entries to plot")
    _, reward_std = training_series(log_history, "reward_std")
    fit_steps, fitness = training_series(log_history, "fitness/mean")

    with_accuracy = before is not None or after is not None
    fig, axes = plt.subplots(
        1,
        2 if with_accuracy else 1,
        figsize=(10 if with_accuracy else 7, 4),
        gridspec_kw={"width_ratios": [3, 1]} if with_accuracy else None,
        squeeze=False,
    )
    ax = axes[0][0]
    ax.plot(steps, reward, marker="o", ms=3, color="tab:blue", label="reward (mean over members)")
    if len(reward_std) == len(reward):
        low = [r - s for r, s in zip(reward, reward_std, strict=True)]
        high = [r + s for r, s in zip(reward, reward_std, strict=True)]
        ax.fill_between(steps, low, high, color="tab:blue", alpha=0.15, label="± std across members")
    if fitness:
        ax.plot(fit_steps, fitness, marker="s", ms=3, color="tab:orange", label="fitness (mean)")
    ax.set_xlabel("ES step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("training reward / fitness")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)

    if with_accuracy:
        ax = axes[0][1]
        labels, values = [], []
        for label, value in (("before", before), ("after", after)):
            if value is not None:
                labels.append(label)
                values.append(100 * value)
        bars = ax.bar(labels, values, color=["tab:gray", "tab:green"][: len(values)])
        for bar, value in zip(bars, values, strict=True):
            ax.annotate(f"{value:.1f}%", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom")
        ax.set_ylim(0, max(values) * 1.25 if values and max(values) > 0 else 1)
        ax.set_ylabel("held-out accuracy (%)")
        ax.set_title("held-out")

    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
