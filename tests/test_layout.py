"""Population layouts: the arithmetic of the grouped layout, per-group fitness normalisation, antithetic pairs inside
groups, the learning-rate rule for matched update size, and a grouped step on every generation backend."""

import numpy as np
import pytest
import torch
from conftest import backend_params, backend_trainer, toy_dataset

from trl_dart_es.fitness import shape_fitness
from trl_dart_es.layout import PopulationLayout, centre_fitness, matched_learning_rate
from trl_dart_es.noise import population
from trl_dart_es.strategy import DartES


# ------------------------------------------------------------------------------------------ arithmetic
def test_grouped_layout_gives_each_group_its_own_block_of_problems():
    layout = PopulationLayout("grouped", members_per_group=4)
    cols = layout.columns(16, 8)  # 4 groups of 4 members, 2 problems per group
    assert [cols[n] for n in (0, 3, 4, 15)] == [[0, 1], [0, 1], [2, 3], [6, 7]]
    mask = layout.mask(16, 8)
    assert (mask.sum(axis=0) == 4).all()  # every problem scored by its group's 4 members
    assert (mask.sum(axis=1) == 2).all()
    assert layout.rollouts(16, 8) == 4 * 8  # members_per_group x batch size
    # one problem per group: EGGROLL's "one prompt, M members"
    assert PopulationLayout("grouped", 2).columns(8, 4) == [[0], [0], [1], [1], [2], [2], [3], [3]]
    shared = PopulationLayout()
    assert shared.columns(3, 2) == [[0, 1]] * 3 and shared.rollouts(3, 2) == 6


@pytest.mark.parametrize(
    "kind, m, n, b, antithetic, fragment",
    [
        ("grouped", 3, 8, 8, False, "population_size=8 is not a multiple of members_per_group=3"),
        ("grouped", 2, 8, 6, False, "do not split into 4 equal blocks"),
        ("grouped", 3, 6, 4, True, "members_per_group must be even"),
        ("grouped", None, 8, 8, False, "members_per_group >= 2"),
        ("shared", 4, 8, 8, False, "population_layout is 'shared'"),
        ("stacked", None, 8, 8, False, "population_layout must be one of"),
    ],
)
def test_layout_errors_name_the_bad_value(kind, m, n, b, antithetic, fragment):
    with pytest.raises(ValueError, match=fragment):
        PopulationLayout(kind, m).check(n, b, antithetic)


def test_config_rejects_a_layout_that_does_not_fit(tmp_path):
    from conftest import tiny_es_config

    with pytest.raises(ValueError, match="DartESConfig: .*members_per_group=3"):
        tiny_es_config(tmp_path, population_layout="grouped", members_per_group=3)
    with pytest.raises(ValueError, match="fitness_shaping"):
        tiny_es_config(tmp_path, population_layout="grouped", members_per_group=2, fitness_shaping="rank")


# -------------------------------------------------------------------------------------- normalisation
def test_per_group_normalisation_centres_each_group_and_divides_by_one_std():
    rng = np.random.default_rng(0)
    f = rng.normal(size=12)
    groups = np.repeat(np.arange(3), 4)
    z = shape_fitness(f, "zscore", groups=groups)
    centred = f - np.repeat(f.reshape(3, 4).mean(axis=1), 4)
    np.testing.assert_allclose(z, centred / (centred.std() + 1e-8), rtol=1e-12)
    for g in range(3):
        assert abs(z[groups == g].sum()) < 1e-12  # each group sums to zero
    # A problem block that is easier for everyone in its group moves nothing: offsets per group cancel.
    shifted = f + np.repeat([10.0, -3.0, 0.5], 4)
    np.testing.assert_allclose(shape_fitness(shifted, "zscore", groups=groups), z, atol=1e-9)
    # ... which the population-wide z-score does not do.
    assert not np.allclose(shape_fitness(shifted, "zscore"), shape_fitness(f, "zscore"))


def test_a_group_with_equal_fitness_gives_exact_zeros_and_all_equal_groups_give_no_signal():
    f = np.array([0.1, 0.1, 0.1, 0.3, 0.2, 0.2])
    groups = np.array([0, 0, 0, 1, 1, 1])
    z = shape_fitness(f, "zscore", groups=groups)
    assert (z[:3] == 0).all()  # 0.1 * 3 / 3 != 0.1 in floats: no rounding residue counts as signal
    assert z[3] > 0 > z[4]
    assert shape_fitness(np.array([0.1, 0.1, 0.7, 0.7]), "zscore", groups=np.array([0, 0, 1, 1])) is None
    np.testing.assert_array_equal(centre_fitness([2.0, 2.0]), [0.0, 0.0])
    with pytest.raises(ValueError, match="rank shaping is not defined"):
        shape_fitness(f, "rank", groups=groups)
    z_run = shape_fitness(f, "running-zscore", scale=0.5, groups=groups)
    np.testing.assert_allclose(z_run, centre_fitness(f, groups) / 0.5, rtol=1e-7)


def test_antithetic_pairs_never_straddle_groups():
    members = population(123, 12, antithetic=True)
    groups = PopulationLayout("grouped", 4).groups(12)
    for n in range(0, 12, 2):
        assert members[n].seed == members[n + 1].seed and members[n].sign == -members[n + 1].sign
        assert groups[n] == groups[n + 1]


# ------------------------------------------------------------------------------------------- strategy
def _grouped_strategy(**kw):
    ids = [f"q{i}" for i in range(16)]
    base = dict(
        population_size=8,
        batch_size=4,
        antithetic=True,
        reward_weights=(1.0, 1.0),
        population_layout="grouped",
        members_per_group=4,
    )
    return DartES(ids, **{**base, **kw})


def test_grouped_tell_reads_each_members_own_block_only():
    rng = np.random.default_rng(1)
    a, b = _grouped_strategy(), _grouped_strategy()
    batch_a, _ = a.ask()
    batch_b, _ = b.ask()
    assert batch_a.ids == batch_b.ids
    mask = a.layout.mask(8, 4)
    correct = (rng.random((8, 4)) < 0.5).astype(float)
    fmt = rng.random((8, 4))
    rewards = np.stack([correct, fmt])
    noisy = rewards.copy()
    noisy[:, ~mask] = rng.random(((~mask).sum(),)) * 100  # whatever sits outside a member's block is not read
    ra, rb = a.tell(batch_a, np.where(mask[None], rewards, np.nan)), b.tell(batch_b, noisy)
    np.testing.assert_array_equal(ra.z, rb.z)
    # the pass rate of problem j is over the 4 members that scored it
    expected_rate = (correct * mask).sum(axis=0) / 4
    np.testing.assert_array_equal(ra.pass_rate, expected_rate)
    # fitness: a member's mean over its own 2 problems, the difficulty weights on correctness
    w = ra.weights
    own = [np.flatnonzero(mask[n]) for n in range(8)]
    fitness = [np.mean(w[c] * correct[n, c]) + np.mean(fmt[n, c]) for n, c in enumerate(own)]
    np.testing.assert_allclose(ra.fitness, fitness, rtol=1e-12)
    for g in range(2):
        assert abs(ra.z[4 * g : 4 * g + 4].sum()) < 1e-9


def test_one_group_is_the_shared_layout():
    """members_per_group = N: one group that scores every problem, the reference up to float rounding."""
    rng = np.random.default_rng(2)
    shared = DartES([f"q{i}" for i in range(16)], population_size=4, batch_size=4, reward_weights=(1.0, 0.1))
    one_group = DartES(
        [f"q{i}" for i in range(16)],
        population_size=4,
        batch_size=4,
        reward_weights=(1.0, 0.1),
        population_layout="grouped",
        members_per_group=4,
    )
    for _ in range(3):
        (bs, ms), (bg, mg) = shared.ask(), one_group.ask()
        assert bs.ids == bg.ids and ms == mg
        rewards = np.stack([(rng.random((4, 4)) < 0.4).astype(float), rng.random((4, 4))])
        rs, rg = shared.tell(bs, rewards), one_group.tell(bg, rewards)
        np.testing.assert_allclose(rs.z, rg.z, atol=1e-12)
        np.testing.assert_array_equal(rs.weights, rg.weights)
    assert shared.difficulty.state_dict() == one_group.difficulty.state_dict()


# -------------------------------------------------------------------------------------- learning rate
@pytest.mark.parametrize("antithetic", [False, True])
def test_matched_learning_rate_keeps_the_update_rms_across_population_sizes(antithetic):
    """(alpha(N) / N) sum_n z_n eps_n has the same RMS for N = 4 ... 64 when alpha(N) follows the rule."""
    rng = np.random.default_rng(3)
    dim, trials = 4000, 40

    def rms(n):
        values = []
        for _ in range(trials):
            k = n // 2 if antithetic else n
            eps = rng.normal(size=(k, dim))
            if antithetic:
                eps = np.repeat(eps, 2, axis=0) * np.tile([1.0, -1.0], k)[:, None]
            # antithetic fitness: each pair's two values are correlated, like a smooth objective's
            f = (
                rng.normal(size=n)
                if not antithetic
                else np.repeat(rng.normal(size=k), 2) * np.tile([1, -1], k)
            )
            f = f + 0.3 * rng.normal(size=n)
            z = shape_fitness(f, "zscore")
            alpha = matched_learning_rate(1e-3, n, 4)
            values.append(np.sqrt(np.mean((alpha / n * z @ eps) ** 2)))
        return float(np.mean(values))

    ref = rms(4)
    for n in (16, 64):
        assert rms(n) == pytest.approx(ref, rel=0.1)
    # without the rule, N = 64 moves 4x less than N = 4
    assert matched_learning_rate(1e-3, 64, 4) == pytest.approx(4e-3)
    with pytest.raises(ValueError, match="population_size must be a positive integer"):
        matched_learning_rate(1e-3, 0, 4)


# ------------------------------------------------------------------------------------------ backends
@pytest.mark.parametrize("backend", [p for p in backend_params() if "cuda" not in str(p.values[0])])
def test_grouped_population_generates_each_members_own_prompts_and_trains(backend, tokenizer, tmp_path):
    """Each member generates for its block only (as it would alone), and a grouped run trains, deterministically."""
    trainer = backend_trainer(
        backend, tokenizer, tmp_path / "a", population_size=4, per_device_train_batch_size=4,
        antithetic=True, population_layout="grouped", members_per_group=2, max_steps=2,
    )  # fmt: skip
    prompts = toy_dataset(8)["prompt"][:4]
    members = trainer.strategy.members(0)
    cols = trainer.strategy.layout.columns(4, 4)
    together = trainer.rollout.generate_population(prompts, members, columns=cols)
    assert [len(g.texts) for g in together] == [2, 2, 2, 2]
    for member, mine, gen in zip(members, cols, together, strict=True):
        [alone] = trainer.rollout.generate_population([prompts[i] for i in mine], [member])
        assert gen.token_ids == alone.token_ids
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    told = []
    tell = trainer.strategy.tell
    trainer.strategy.tell = lambda batch, rewards: told.append(np.array(rewards)) or tell(batch, rewards)
    trainer.train()
    assert trainer.state.global_step == 2
    mask = trainer.strategy.layout.mask(4, 4)
    for rewards in told:  # scored where a member generated, NaN elsewhere
        assert np.isfinite(rewards[:, mask]).all() and np.isnan(rewards[:, ~mask]).all()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    if backend == "transformers":  # the same seed, the same trajectory
        again = backend_trainer(
            backend, tokenizer, tmp_path / "b", population_size=4, per_device_train_batch_size=4,
            antithetic=True, population_layout="grouped", members_per_group=2, max_steps=2,
        )  # fmt: skip
        again.train()
        for (name, p), q in zip(trainer.model.named_parameters(), again.model.parameters(), strict=True):
            assert torch.equal(p, q), name
