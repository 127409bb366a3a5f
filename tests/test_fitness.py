import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trl_dart_es.fitness import dart_fitness, shape_fitness, solved_matrix

nan = float("nan")


def test_dart_fitness_hand_computed():
    # K = 2 (correctness, format), N = 2, B = 2, w = [2, 1], beta = [1, 0.1].
    r0 = [[1, 0], [0, 1]]
    r1 = [[1, 0.1], [0.5, 0.5]]
    f = dart_fitness([r0, r1], [2.0, 1.0], [1.0, 0.1])
    # F_0 = (2*1 + 1*0)/2 + 0.1*(1 + 0.1)/2 = 1.055 ; F_1 = (0 + 1)/2 + 0.1*(0.5 + 0.5)/2 = 0.55
    np.testing.assert_allclose(f, [1.055, 0.55])


def test_plain_mean_not_divided_by_weight_sum():
    f = dart_fitness(np.ones((1, 3, 4)), [2.0, 2.0, 2.0, 2.0], [1.0])
    np.testing.assert_allclose(f, [2.0, 2.0, 2.0])


def test_weights_apply_to_primary_only():
    r = np.array([[[1.0, 0.0]], [[1.0, 1.0]]])  # K=2, N=1, B=2
    np.testing.assert_allclose(dart_fitness(r, [3.0, 1.0], [1.0, 1.0], primary_index=0), [1.5 + 1.0])
    np.testing.assert_allclose(dart_fitness(r, [3.0, 1.0], [1.0, 1.0], primary_index=1), [0.5 + 2.0])


def test_nan_rewards_are_left_out_of_the_mean():
    r0 = [[1.0, nan, 0.0], [nan, nan, nan], [1.0, 1.0, 1.0]]
    r1 = [[0.5, 0.5, nan], [1.0, 0.0, 1.0], [nan, nan, nan]]
    f = dart_fitness([r0, r1], [2.0, 1.0, 1.0], [1.0, 0.1])
    # member 0: (2*1 + 1*0)/2 + 0.1*(0.5+0.5)/2 ; member 1: 0 + 0.1*2/3 ; member 2: (2+1+1)/3 + 0
    np.testing.assert_allclose(f, [1.0 + 0.05, 0.2 / 3, 4 / 3])


def test_dart_fitness_validation():
    with pytest.raises(ValueError, match="K x N x B"):
        dart_fitness(np.ones((2, 3)), [1, 1, 1], [1.0])
    with pytest.raises(ValueError, match=r"weights must have shape \(3,\)"):
        dart_fitness(np.ones((1, 2, 3)), [1, 1], [1.0])
    with pytest.raises(ValueError, match="2 values"):
        dart_fitness(np.ones((2, 2, 3)), [1, 1, 1], [1.0])
    with pytest.raises(ValueError, match="primary_index"):
        dart_fitness(np.ones((1, 2, 3)), [1, 1, 1], [1.0], primary_index=1)
    with pytest.raises(ValueError, match="inf"):
        dart_fitness(np.full((1, 2, 3), np.inf), [1, 1, 1], [1.0])


def test_zscore_hand_computed():
    z = shape_fitness([1.0, 2.0, 3.0, 4.0])
    s = np.sqrt(1.25)  # population std
    np.testing.assert_allclose(z, [-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s], rtol=1e-7)


def test_rank_shaping_average_ties():
    np.testing.assert_allclose(shape_fitness([10.0, 30.0, 20.0, 20.0], "rank"), [-0.5, 0.5, 0.0, 0.0])
    np.testing.assert_allclose(shape_fitness([3.0, 1.0], "rank"), [0.5, -0.5])


@pytest.mark.parametrize("method", ["zscore", "rank", "running-zscore"])
def test_no_signal_returns_none(method):
    assert shape_fitness([0.7, 0.7, 0.7], method, scale=1.0) is None
    assert shape_fitness([0.7], method, scale=1.0) is None


def test_running_zscore_keeps_the_size_of_the_differences():
    f = np.array([0.1, 0.3, 0.2, 0.6])
    # with the step's own std as the scale it is the z-score; with a larger scale the same ranks, shorter
    np.testing.assert_allclose(shape_fitness(f, "running-zscore", scale=f.std()), shape_fitness(f), atol=1e-7)
    z = shape_fitness(f, "running-zscore", scale=4 * f.std())
    np.testing.assert_allclose(z * 4, shape_fitness(f), atol=1e-6)
    for bad in (None, -1.0, float("nan")):
        with pytest.raises(ValueError, match="scale"):
            shape_fitness(f, "running-zscore", scale=bad)


def test_shape_validation():
    with pytest.raises(ValueError, match="shaping"):
        shape_fitness([1.0, 2.0], "softmax")
    with pytest.raises(ValueError, match="finite"):
        shape_fitness([1.0, nan])


@given(st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=30))
def test_shaping_properties(values):
    z = shape_fitness(values)
    ranks = shape_fitness(values, "rank")
    if len(set(values)) == 1:
        assert z is None and ranks is None
        return
    assert abs(z.mean()) < 1e-9 and abs(ranks.mean()) < 1e-12
    assert ranks.min() >= -0.5 and ranks.max() <= 0.5  # tied extremes share an average rank
    # Both preserve order.
    order = np.argsort(values, kind="stable")
    assert np.all(np.diff(z[order]) >= -1e-12) and np.all(np.diff(ranks[order]) >= 0)


def test_solved_matrix():
    a = solved_matrix([[1.0, 0.5, nan], [0.99, 1.0, 2.0]], threshold=1.0)
    assert a.dtype.kind == "i"
    np.testing.assert_array_equal(a, [[1, 0, 0], [0, 1, 1]])
    np.testing.assert_array_equal(solved_matrix([[0.5, nan]], threshold=0.5), [[1, 0]])
    with pytest.raises(ValueError, match="N x B"):
        solved_matrix([1.0, 0.0])
