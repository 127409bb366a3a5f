import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from trl_dart_es.noise import gaussian
from trl_dart_es.perturb import EvolvedParameters
from trl_dart_es.strategy import DartES

nan = float("nan")


class TwoParams(nn.Module):
    def __init__(self):
        super().__init__()
        self.theta = nn.Parameter(torch.tensor([0.5, -0.25]))


def rewards_for(batch, per_problem: dict[str, list[float]], fmt: list[float]) -> np.ndarray:
    """K=2 x N x B rewards: correctness per problem (over members), and a per-member format reward."""
    r0 = np.array([per_problem[i] for i in batch.ids]).T
    r1 = np.tile(np.array(fmt)[:, None], (1, len(batch.ids)))
    return np.stack([r0, r1])


def test_full_step_by_hand():
    """One DART-ES step on paper: N = 4, B = 3, beta = (1, 0.1), default lambda, tau, P, kappa, w_floor."""
    strategy = DartES(["x", "y", "z"], population_size=4, batch_size=3, reward_weights=[1.0, 0.1], seed=7)
    batch, members = strategy.ask()
    assert sorted(batch.ids) == ["x", "y", "z"] and batch.num_replayed == 0  # empty buffer: fresh fill
    assert len({m.seed for m in members}) == 4

    # Who solves what: x by member 0 only, y by members 0 and 1, z by nobody.
    solved = {"x": [1, 0, 0, 0], "y": [1, 1, 0, 0], "z": [0, 0, 0, 0]}
    fmt = [1.0, 1.0, 0.1, 0.5]
    result = strategy.tell(batch, rewards_for(batch, solved, fmt))

    col = {i: k for k, i in enumerate(batch.ids)}
    # Step 4: pass rates p = (1/4, 1/2, 0).  Step 5: first visit, pbar = p; zero streak of z = 1.
    assert [result.pass_rate[col[i]] for i in "xyz"] == [0.25, 0.5, 0.0]
    assert [strategy.difficulty.pass_rate(i) for i in "xyz"] == [0.25, 0.5, 0.0]
    assert [strategy.difficulty.zero_streak(i) for i in "xyz"] == [0, 0, 1]
    # Step 6: x rare solvable -> in; y at tau = 0.5 -> mastered; z unsolved but streak 1 < P = 2.
    assert strategy.difficulty.replay_buffer == {"x"}
    # Step 7: w = 0.8 + exp(-3 pbar).
    w = {"x": 0.8 + math.exp(-0.75), "y": 0.8 + math.exp(-1.5), "z": 1.8}  # 1.27237, 1.02313, 1.8
    np.testing.assert_allclose(result.weights, [w[i] for i in batch.ids])
    # Step 8: F_n = (1/3) sum_j w_j r0[n, j] + 0.1 * fmt_n.
    fitness = [(w["x"] + w["y"]) / 3 + 0.1, w["y"] / 3 + 0.1, 0.01, 0.05]  # 0.86517, 0.44104, 0.01, 0.05
    np.testing.assert_allclose(result.fitness, fitness)
    # Step 9: population z-scores. mean 0.341552, std 0.346049.
    np.testing.assert_allclose(result.z, [1.51312005, 0.28750614, -0.95810842, -0.84251777], atol=1e-7)
    np.testing.assert_array_equal(result.solved[:, col["y"]], [1, 1, 0, 0])

    m = result.metrics
    assert m["dart/pass_rate_mean"] == pytest.approx(0.25)
    assert m["dart/frac_solved_by_none"] == pytest.approx(1 / 3) and m["dart/frac_solved_by_all"] == 0.0
    assert m["dart/buffer_size"] == 1 and m["dart/num_replayed"] == 0 and m["es/skipped"] == 0
    assert m["dart/weight_max"] == 1.8 and m["dart/weight_mean"] == pytest.approx(sum(w.values()) / 3)
    assert m["fitness/mean"] == pytest.approx(0.34155224) and m["fitness/std"] == pytest.approx(0.34604877)

    # Step 10: theta <- theta + (lr / N) sum_n z_n eps_n, with eps_n fetched by (seed_n, "theta").
    model = TwoParams()
    params = EvolvedParameters(model, sigma=0.1)
    for member in members:
        with params.perturbed(member):
            pass
    norm = params.update(members, result.z, lr=0.2)
    eps = [gaussian(mem.seed, "theta", (2,)).double() for mem in members]
    delta = 0.2 / 4 * sum(zn * e for zn, e in zip(result.z, eps, strict=True))
    expected = torch.tensor([0.5, -0.25], dtype=torch.float64) + delta
    torch.testing.assert_close(model.theta.detach().double(), expected, rtol=0, atol=1e-6)
    assert norm == pytest.approx(delta.norm().item(), rel=1e-5)
    assert strategy.step == 1


def test_plain_es_switches():
    ids = [f"q{i}" for i in range(12)]
    plain = DartES(
        ids, population_size=4, batch_size=5, use_difficulty_reweighting=False, use_targeted_replay=False
    )
    assert plain.planner.num_replay_slots == 0
    rng = np.random.default_rng(0)
    for _ in range(4):
        batch, _ = plain.ask()
        assert batch.num_replayed == 0
        result = plain.tell(batch, rng.integers(0, 2, size=(1, 4, 5)).astype(float))
        np.testing.assert_array_equal(result.weights, np.ones(5))
    assert len(plain.difficulty) > 0  # still tracked (for logs), just not used


def test_replay_happens_with_dart():
    ids = [f"q{i}" for i in range(30)]
    strategy = DartES(ids, population_size=4, batch_size=10, replay_ratio=0.3, seed=1)
    rng = np.random.default_rng(1)
    replayed = 0
    for _ in range(6):
        batch, _ = strategy.ask()
        replayed += batch.num_replayed
        strategy.tell(batch, (rng.random((1, 4, 10)) < 0.2).astype(float))
    assert replayed > 0


def test_no_signal_skips():
    strategy = DartES(["a", "b"], population_size=3, batch_size=2)
    batch, _ = strategy.ask()
    result = strategy.tell(batch, np.ones((1, 3, 2)))
    assert result.z is None and result.skipped and result.metrics["es/skipped"] == 1.0
    assert result.metrics["dart/frac_solved_by_all"] == 1.0


def test_nan_rewards_count_as_unsolved():
    strategy = DartES(["a", "b"], population_size=2, batch_size=2)
    batch, _ = strategy.ask()
    rewards = np.array([[[1.0, nan], [0.0, 1.0]]])
    result = strategy.tell(batch, rewards)
    assert result.solved.sum() == 2 and result.z is not None


def test_ask_tell_contract():
    strategy = DartES([f"q{i}" for i in range(6)], population_size=4, batch_size=3, antithetic=True)
    batch, members = strategy.ask()
    again, members_again = strategy.ask()
    assert again is batch and members_again == members
    assert [m.sign for m in members] == [1, -1, 1, -1]
    with pytest.raises(ValueError, match=r"\(1, 4, 3\)"):
        strategy.tell(batch, np.zeros((1, 4, 2)))
    strategy.tell(batch, np.eye(4, 3)[None])
    with pytest.raises(RuntimeError, match="ask"):
        strategy.tell(batch, np.eye(4, 3)[None])
    _, next_members = strategy.ask()
    assert {m.seed for m in next_members}.isdisjoint({m.seed for m in members})
    assert strategy.members(0) == members


def test_constructor_validation():
    with pytest.raises(ValueError, match="even"):
        DartES(["a", "b"], population_size=3, batch_size=1, antithetic=True)
    with pytest.raises(ValueError, match="fitness_shaping"):
        DartES(["a", "b"], population_size=2, batch_size=1, fitness_shaping="centered")
    with pytest.raises(ValueError, match="primary_index"):
        DartES(["a", "b"], population_size=2, batch_size=1, primary_index=1)


def test_state_dict_resume_is_exact():
    ids = [f"q{i}" for i in range(25)]
    kwargs = dict(population_size=4, batch_size=8, replay_ratio=0.25, seed=3)

    def run(strategy, steps, seed):
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(steps):
            batch, members = strategy.ask()
            result = strategy.tell(batch, (rng.random((1, 4, 8)) < 0.3).astype(float))
            out.append((batch.ids, batch.replayed, members, None if result.z is None else result.z.tolist()))
        return out

    first = DartES(ids, **kwargs)
    run(first, 4, seed=0)
    first.ask()  # a pending ask is not part of the state: the resumed run plans the same batch again
    saved = json.loads(json.dumps(first.state_dict()))
    expected = run(first, 5, seed=1)

    resumed = DartES(ids, **kwargs)
    resumed.load_state_dict(saved)
    assert resumed.step == 4
    assert run(resumed, 5, seed=1) == expected


def test_running_zscore_scales_by_the_mean_std_so_far_and_resumes():
    ids = [f"q{i}" for i in range(40)]
    kwargs = dict(population_size=4, batch_size=8, seed=1, fitness_shaping="running-zscore")
    strategy = DartES(ids, use_difficulty_reweighting=False, **kwargs)
    small = np.zeros((1, 4, 8))
    small[0, 0, 0] = 1.0  # one member solves one problem: a weak signal
    large = np.zeros((1, 4, 8))
    large[0, 1, :] = 1.0  # one member solves all eight
    batch, _ = strategy.ask()
    first = strategy.tell(batch, large)
    assert np.linalg.norm(first.z) == pytest.approx(2.0)  # the first step is a plain z-score: |z| = sqrt(N)
    batch, _ = strategy.ask()
    second = strategy.tell(batch, small)
    # a per-step z-score would give this weak step the first one's length; here it is divided by the mean std
    std_small, std_large = second.fitness.std(), first.fitness.std()
    np.testing.assert_allclose(
        second.z, (second.fitness - second.fitness.mean()) / ((std_small + std_large) / 2)
    )
    assert np.linalg.norm(second.z) < 0.5

    saved = json.loads(json.dumps(strategy.state_dict()))
    resumed = DartES(ids, use_difficulty_reweighting=False, **kwargs)
    resumed.load_state_dict(saved)
    after = [s.tell(s.ask()[0], large).z for s in (strategy, resumed)]
    np.testing.assert_array_equal(after[0], after[1])


@pytest.mark.parametrize(
    "module", ["noise", "perturb", "difficulty", "replay", "fitness", "layout", "strategy"]
)
def test_core_modules_import_no_model_or_trainer_code(module):
    import ast
    import importlib.util

    path = importlib.util.find_spec(f"trl_dart_es.{module}").origin
    tree = ast.parse(Path(path).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(("." * node.level) + (node.module or "").split(".")[0])
    allowed = {"__future__", "contextlib", "dataclasses", "hashlib", "math", "os", "threading", "typing"}
    allowed |= {"warnings", "collections", "concurrent", "numpy", "torch"}
    allowed |= {".noise", ".difficulty", ".fitness", ".layout", ".replay"}
    assert imported <= allowed, imported - allowed


def test_resume_warns_on_a_changed_config_but_not_on_keys_an_older_state_lacks():
    ids = [f"q{i}" for i in range(20)]
    saved = DartES(ids, population_size=4, batch_size=4, fitness_shaping="rank").state_dict()
    with pytest.warns(UserWarning, match=r"fitness_shaping.*'rank', 'zscore'"):
        DartES(ids, population_size=4, batch_size=4).load_state_dict(saved)

    del saved["config"]["fitness_shaping"]  # as saved before the key existed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DartES(ids, population_size=4, batch_size=4).load_state_dict(saved)


def test_running_zscore_rejects_non_finite_fitness_without_touching_its_scale():
    ids = [f"q{i}" for i in range(20)]
    strategy = DartES(ids, population_size=4, batch_size=4, fitness_shaping="running-zscore")
    before = strategy.state_dict()["fitness_std"]
    with pytest.raises(ValueError, match="finite"):
        strategy._shape(np.array([0.1, np.nan, 0.2, 0.3]))
    assert strategy.state_dict()["fitness_std"] == before
