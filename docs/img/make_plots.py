"""Draw the two figures of docs/method.md (no model involved; runs in a few seconds).

    .venv/bin/python docs/img/make_plots.py

* weight_curve.png: the DART weight w(pbar) = w_floor + exp(-kappa * pbar).
* buffer.png: the replay buffer of a simulated DART-ES run. Each problem j has a hidden difficulty d_j; at
  step t member n solves it with probability sigmoid(4 * (s_t + u_n - d_j)), where the model skill s_t
  grows over the run and u_n is the member's small random offset (its perturbation).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from trl_dart_es.difficulty import difficulty_weight  # noqa: E402
from trl_dart_es.strategy import DartES  # noqa: E402

OUT = Path(__file__).resolve().parent


def weight_curve() -> None:
    p = np.linspace(0, 1, 201)
    fig, ax = plt.subplots(figsize=(5.2, 3.4), dpi=150)
    for kappa, style in [(1.0, ":"), (3.0, "-"), (6.0, "--")]:
        label = f"κ = {kappa:g}" + (" (reference)" if kappa == 3.0 else "")
        ax.plot(
            p, difficulty_weight(p, 0.8, kappa), style, color="C0", lw=2 if kappa == 3.0 else 1.2, label=label
        )
    ax.axhline(1.0, color="gray", lw=1, label="plain ES (w = 1)")
    ax.axvline(0.5, color="C3", lw=1, ls="-.", label="τ = 0.5 (mastered)")
    ax.set_xlabel("pass-rate EMA  p̄ⱼ")
    ax.set_ylabel("weight  wⱼ = 0.8 + exp(−κ p̄ⱼ)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0.75, 1.85)
    ax.legend(fontsize=8, frameon=False)
    ax.set_title("DART difficulty weight", fontsize=10)
    fig.tight_layout()
    fig.savefig(OUT / "weight_curve.png")
    plt.close(fig)


def buffer_run(steps: int = 60, n_problems: int = 400, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = [f"q{j}" for j in range(n_problems)]
    difficulty = dict(zip(ids, rng.normal(0.0, 1.0, n_problems), strict=True))
    strategy = DartES(ids, population_size=16, batch_size=40, seed=seed)
    tau = strategy.difficulty.replay_pass_threshold
    log = {
        k: []
        for k in ("buffer", "replayed", "added", "mastered", "unsolvable", "pbar_replayed", "pbar_fresh")
    }
    for t in range(steps):
        batch, members = strategy.ask()
        skill = -1.0 + 1.5 * t / steps
        offsets = rng.normal(0.0, 0.35, len(members))
        d = np.array([difficulty[i] for i in batch.ids])
        prob = 1 / (1 + np.exp(-4 * (skill + offsets[:, None] - d[None, :])))
        solved = (rng.random(prob.shape) < prob).astype(float)
        pbar_before = [strategy.difficulty.pass_rate(i) for i in batch.ids]
        before = strategy.difficulty.replay_buffer
        strategy.tell(batch, solved[None])
        after = strategy.difficulty.replay_buffer
        removed = before - after
        log["buffer"].append(len(after))
        log["replayed"].append(batch.num_replayed)
        log["added"].append(len(after - before))
        log["mastered"].append(sum(strategy.difficulty.pass_rate(i) >= tau for i in removed))
        log["unsolvable"].append(sum(strategy.difficulty.pass_rate(i) < tau for i in removed))
        rep = [p for p, r in zip(pbar_before, batch.replayed, strict=True) if r]
        fresh = [p for p, r in zip(pbar_before, batch.replayed, strict=True) if not r and p is not None]
        log["pbar_replayed"].append(np.mean(rep) if rep else np.nan)
        log["pbar_fresh"].append(np.mean(fresh) if fresh else np.nan)
    return {k: np.asarray(v, dtype=float) for k, v in log.items()}


def buffer_plot() -> None:
    log = buffer_run()
    t = np.arange(len(log["buffer"]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9.6, 3.4), dpi=150)
    ax1.plot(t, log["buffer"], color="C0", lw=2, label="buffer size")
    ax1.bar(t, log["replayed"], color="C2", alpha=0.6, label="replayed this step (R = 8 slots)")
    ax1.plot(t, np.cumsum(log["mastered"]), color="C3", ls="--", label="left: mastered (cumulative)")
    ax1.plot(t, np.cumsum(log["unsolvable"]), color="C7", ls=":", label="left: unsolvable (cumulative)")
    ax1.set_xlabel("ES step")
    ax1.set_ylabel("problems")
    ax1.legend(fontsize=7, frameon=False)
    ax1.set_title("Replay buffer (400 problems, B = 40, N = 16)", fontsize=10)
    ax2.plot(t, log["pbar_replayed"], "o", ms=3, color="C2", label="replayed problems")
    ax2.plot(t, log["pbar_fresh"], "s", ms=3, color="C1", label="fresh problems seen before")
    ax2.axhline(0.5, color="C3", lw=1, ls="-.", label="τ")
    ax2.set_xlabel("ES step")
    ax2.set_ylabel("mean p̄ before the step")
    ax2.set_ylim(0, 1)
    ax2.legend(fontsize=7, frameon=False)
    ax2.set_title("Replay targets hard-but-solvable problems", fontsize=10)
    fig.tight_layout()
    fig.savefig(OUT / "buffer.png")
    plt.close(fig)


if __name__ == "__main__":
    weight_curve()
    buffer_plot()
    print(f"wrote {OUT / 'weight_curve.png'} and {OUT / 'buffer.png'}")
