import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_dart_es.difficulty import DifficultyState, difficulty_weight


def solved(*columns):
    """N x B matrix from per-problem columns (lists of 0/1 over the population)."""
    return np.array(columns).T


def test_hand_computed_sequence():
    # N = 4, lambda = 0.7, tau = 0.5, P = 2, w = 0.8 + exp(-3 pbar). Worked out on paper:
    state = DifficultyState()
    # Step 1: a solved by 1/4, b by none, c by all.
    w = state.update(["a", "b", "c"], solved([1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]))
    assert state.pass_rate("a") == 0.25 and state.pass_rate("b") == 0.0 and state.pass_rate("c") == 1.0
    assert [state.zero_streak(i) for i in "abc"] == [0, 1, 0]
    assert state.replay_buffer == {"a"}  # a: rare solvable; b: streak 1 < P; c: mastered
    np.testing.assert_allclose(w, [0.8 + math.exp(-0.75), 1.8, 0.8 + math.exp(-3.0)])
    assert w[0] == pytest.approx(1.2723665527410147)

    # Step 2 (order b, a): a solved by 3/4 -> pbar = 0.7*0.25 + 0.3*0.75 = 0.4; b unsolved again.
    w = state.update(["b", "a"], solved([0, 0, 0, 0], [1, 1, 1, 0]))
    assert state.pass_rate("a") == pytest.approx(0.4) and state.zero_streak("b") == 2
    assert state.replay_buffer == {"a"}
    np.testing.assert_allclose(w, [1.8, 0.8 + math.exp(-1.2)])

    # Step 3: a solved by all -> pbar = 0.7*0.4 + 0.3 = 0.58 >= tau: mastered, leaves.
    #         b solved by 2/4 -> pbar = 0.15, streak reset, rare solvable: joins.
    state.update(["a", "b"], solved([1, 1, 1, 1], [1, 1, 0, 0]))
    assert state.pass_rate("a") == pytest.approx(0.58) and state.pass_rate("b") == pytest.approx(0.15)
    assert state.zero_streak("b") == 0
    assert state.replay_buffer == {"b"}

    # Step 4: b unsolved, streak 1 < P: rule 4, stays. Step 5: streak 2 >= P: unsolvable, leaves.
    state.update(["b"], solved([0, 0, 0, 0]))
    assert state.replay_buffer == {"b"} and state.pass_rate("b") == pytest.approx(0.105)
    state.update(["b"], solved([0, 0, 0, 0]))
    assert state.replay_buffer == frozenset() and state.zero_streak("b") == 2
    assert state.visits("b") == 5 and state.visits("c") == 1


def test_rule_order_mastered_wins():
    # pbar >= tau removes even though c > 0 (rule 1 before rule 3).
    state = DifficultyState(replay_pass_threshold=0.5)
    state.update(["x"], solved([1, 1, 0, 0]))  # p = 0.5 on first visit
    assert state.replay_buffer == frozenset()


def test_weights_and_lookups():
    state = DifficultyState(weight_floor=0.5, weight_exponent=2.0)
    state.update(["a"], solved([1, 0]))
    np.testing.assert_allclose(state.weights(["a"]), [0.5 + math.exp(-1.0)])
    assert state.pass_rate("zzz") is None and state.zero_streak("zzz") == 0
    with pytest.raises(KeyError, match="zzz"):
        state.weights(["zzz"])


def test_validation_messages():
    state = DifficultyState()
    with pytest.raises(ValueError, match="'a'"):
        state.update(["a", "b", "a"], np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"\(population, 3\).*\(2, 4\)"):
        state.update(["a", "b", "c"], np.zeros((2, 4)))
    with pytest.raises(ValueError, match="0 and 1"):
        state.update(["a"], np.array([[0.5]]))
    with pytest.raises(ValueError, match="0 and 1"):
        state.update(["a"], np.array([[np.nan]]))
    with pytest.raises(ValueError, match="ema_decay"):
        DifficultyState(ema_decay=1.5)
    with pytest.raises(ValueError, match="zero_pass_patience"):
        DifficultyState(zero_pass_patience=0)
    assert state.num_seen == 0  # failed updates change nothing


def test_state_dict_json_round_trip_exact():
    rng = np.random.default_rng(0)
    state = DifficultyState()
    ids = [f"q{i}" for i in range(20)]
    for _ in range(6):
        batch = list(rng.choice(ids, size=8, replace=False))
        state.update(batch, rng.integers(0, 2, size=(5, 8)))
    restored = DifficultyState()
    restored.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert restored.state_dict() == state.state_dict()
    assert all(restored.pass_rate(i) == state.pass_rate(i) for i in ids)  # bitwise floats
    batch, a = ids[:8], rng.integers(0, 2, size=(5, 8))
    np.testing.assert_array_equal(restored.update(batch, a), state.update(batch, a))
    assert restored.replay_buffer == state.replay_buffer


def test_load_warns_on_other_hyperparameters():
    state = DifficultyState()
    state.update(["a"], solved([1, 0]))
    other = DifficultyState(ema_decay=0.9)
    with pytest.warns(UserWarning, match="ema_decay"):
        other.load_state_dict(state.state_dict())
    assert other.ema_decay == 0.9 and other.pass_rate("a") == 0.5


# ----------------------------------------------------------------------------------------- properties
ID_POOL = [f"p{i}" for i in range(6)]


@st.composite
def steps(draw):
    n = draw(st.integers(1, 4))
    out = []
    for _ in range(draw(st.integers(1, 12))):
        batch = draw(st.lists(st.sampled_from(ID_POOL), min_size=1, max_size=len(ID_POOL), unique=True))
        matrix = draw(
            st.lists(
                st.lists(st.integers(0, 1), min_size=len(batch), max_size=len(batch)), min_size=n, max_size=n
            )
        )
        out.append((batch, np.array(matrix)))
    return out


@settings(max_examples=150, deadline=None)
@given(
    seq=steps(),
    lam=st.floats(0, 1),
    tau=st.floats(0.05, 1),
    patience=st.integers(1, 3),
)
def test_buffer_rules_hold_after_every_step(seq, lam, tau, patience):
    state = DifficultyState(ema_decay=lam, replay_pass_threshold=tau, zero_pass_patience=patience)
    for batch, a in seq:
        before = {i: (state.pass_rate(i), state.zero_streak(i), i in state.replay_buffer) for i in ID_POOL}
        state.update(batch, a)
        counts = dict(zip(batch, a.sum(axis=0).tolist(), strict=True))
        for i in ID_POOL:
            ema0, streak0, member0 = before[i]
            if i not in batch:  # untouched
                assert (state.pass_rate(i), state.zero_streak(i), i in state.replay_buffer) == before[i]
                continue
            c, p = counts[i], counts[i] / a.shape[0]
            ema = p if ema0 is None else lam * ema0 + (1 - lam) * p
            assert state.pass_rate(i) == pytest.approx(ema, abs=1e-12)
            assert state.zero_streak(i) == (streak0 + 1 if c == 0 else 0)
            pbar = state.pass_rate(i)
            if pbar >= tau:
                expected = False
            elif c == 0 and state.zero_streak(i) >= patience:
                expected = False
            elif c > 0:
                expected = True
            else:
                expected = member0
            assert (i in state.replay_buffer) == expected
        # Everything in the buffer is rare-solvable: below tau and seen.
        assert all(state.pass_rate(i) is not None and state.pass_rate(i) < tau for i in state.replay_buffer)


@given(
    p1=st.floats(0, 1),
    p2=st.floats(0, 1),
    floor=st.floats(0, 2),
    kappa=st.floats(0.01, 10),
)
def test_weight_monotone_decreasing_in_pass_rate(p1, p2, floor, kappa):
    lo, hi = min(p1, p2), max(p1, p2)
    assert difficulty_weight(lo, floor, kappa) >= difficulty_weight(hi, floor, kappa)
    if hi - lo > 1e-6:
        assert difficulty_weight(lo, floor, kappa) > difficulty_weight(hi, floor, kappa)
    assert difficulty_weight(0.0, floor, kappa) == pytest.approx(1.0 + floor)
