"""The demo's picture: training reward and fitness per step from `log_history`, held-out accuracy before/after."""

import math

import pytest

from trl_dart_es.training_curve import plot_training_curve, training_series

HISTORY = [
    {"reward": 0.2, "reward_std": 0.05, "fitness/mean": 0.18, "step": 1},
    {"eval_accuracy": 0.3, "step": 1},  # an evaluation entry: not a training point
    {"reward": 0.25, "reward_std": 0.04, "fitness/mean": None, "step": 2},  # a None metric is skipped
    {"reward": math.nan, "step": 3},
    {"reward": 0.3, "reward_std": 0.05, "fitness/mean": 0.29, "step": 4},
    {"train_runtime": 12.0, "step": 4},
]


def test_series_keep_the_logged_training_points():
    assert training_series(HISTORY, "reward") == ([1, 2, 4], [0.2, 0.25, 0.3])
    assert training_series(HISTORY, "fitness/mean") == ([1, 4], [0.18, 0.29])


@pytest.mark.parametrize("accuracy", [(0.26, 0.30), (None, None)])
def test_plot_writes_a_png(tmp_path, accuracy):
    before, after = accuracy
    path = plot_training_curve(HISTORY, str(tmp_path / "sub" / "curve.png"), before=before, after=after)
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_training_logs_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no training `reward`"):
        plot_training_curve([{"eval_accuracy": 0.3, "step": 0}], str(tmp_path / "x.png"))
